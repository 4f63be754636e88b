-- race_claim_winner: make one attempt the race's only winner, ever.
-- KEYS[1] winner STRING
-- KEYS[2] with a save mark only (ARGV[3]): the race's state HASH (race_save.lua)
-- KEYS[3] (optional) the caller's result key (STRING, the result backend's): written and
--         published with ARGV[4] only by the claim that makes the winner
-- ARGV[1] attempt id claiming the win
-- ARGV[2] expiry in ms of the winner key, 0 = none (finish() sets the final expiry)
-- ARGV[3] (optional) the mark 'version:save id' of the race save this claim rides with: it
--         claims only if that save won (the mark is in the state's history of saves, field s);
--         a save that lost its version check was computed from an old copy of the race
-- ARGV[4] (with KEYS[3]) the caller's result as the backend stores it; ARGV[5] its expiry in
--         ms, 0 = none. The same SET and PUBLISH the backend itself would make: a caller
--         waiting on the key's channel wakes with it.
-- Returns {1, attempt, 1}  this claim made the attempt the winner (with a save mark: or this
--                          save's first send did, its answer lost: the state's field w
--                          keeps the mark of the save whose claim made the winner)
--         {1, attempt, 0}  the same attempt had already won (a redelivered claim): still won
--         {0, winner, 0}   another attempt won first
--         {-1, '', 0}      (with a save mark) that save did not win: nothing claimed
local function set(key, value, ttl_ms)
  if ttl_ms > 0 then
    redis.call('SET', key, value, 'PX', ttl_ms)
  else
    redis.call('SET', key, value)
  end
end
local marked = ARGV[3] and ARGV[3] ~= ''
if marked then
  local history = redis.call('HGET', KEYS[2], 's') or ''
  if not string.find(' ' .. history .. ' ', ' ' .. ARGV[3] .. ' ', 1, true) then
    return {-1, '', 0}
  end
end
local winner = redis.call('GET', KEYS[1])
if winner then
  if winner == ARGV[1] then
    if marked and redis.call('HGET', KEYS[2], 'w') == ARGV[3] then
      return {1, winner, 1}  -- written already by the first send, result included
    end
    return {1, winner, 0}
  end
  return {0, winner, 0}
end
set(KEYS[1], ARGV[1], tonumber(ARGV[2]))
if marked then
  redis.call('HSET', KEYS[2], 'w', ARGV[3])
end
if KEYS[3] then
  set(KEYS[3], ARGV[4], tonumber(ARGV[5]))
  redis.call('PUBLISH', KEYS[3], ARGV[4])
end
return {1, ARGV[1], 1}
