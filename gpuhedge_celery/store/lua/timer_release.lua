-- timer_release: give claimed, unfired timers back (a claimer that stops before their due time).
-- KEYS[1] due ZSET   KEYS[2] in-flight ZSET   KEYS[3] deliveries HASH
-- ARGV    triples: id1, deadline1, due1, ...  (deadline = the claim's token; due = epoch ms)
-- Only a claim that is still current is given back: its timer waits again at its due time,
-- and this delivery is not counted. Returns how many were given back.
local n = 0
for i = 1, #ARGV, 3 do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[2], id)
  if score and tonumber(score) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[1], tonumber(ARGV[i + 2]), id)
    redis.call('HINCRBY', KEYS[3], id, -1)
    n = n + 1
  end
end
return n
