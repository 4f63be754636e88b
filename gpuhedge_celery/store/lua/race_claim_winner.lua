-- race_claim_winner: make one attempt the race's only winner, ever.
-- KEYS[1] winner STRING
-- ARGV[1] attempt id claiming the win
-- ARGV[2] expiry in ms of the winner key, 0 = none (finish() sets the final expiry)
-- Returns {1, attempt, 1}  this claim made the attempt the winner
--         {1, attempt, 0}  the same attempt had already won (a redelivered claim): still won
--         {0, winner, 0}   another attempt won first
local winner = redis.call('GET', KEYS[1])
if winner then
  if winner == ARGV[1] then
    return {1, winner, 0}
  end
  return {0, winner, 0}
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return {1, ARGV[1], 1}
