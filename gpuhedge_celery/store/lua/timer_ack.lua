-- timer_ack: mark claimed timers done, only where the caller's claim is still the current one.
-- KEYS[1] in-flight ZSET (id -> lease deadline ms)
-- KEYS[2] data HASH                     KEYS[3] deliveries HASH
-- ARGV    pairs: id1, deadline1, id2, deadline2, ...  (deadline = the claim's token)
-- Returns one code per pair:
--    1  acknowledged and removed
--    0  not in flight any more (cancelled, or already acknowledged)
--   -1  claimed again by someone else after this claim's lease ran out: left to them
local codes = {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[1], id)
  if not score then
    codes[#codes + 1] = 0
  elseif tonumber(score) ~= tonumber(ARGV[i + 1]) then
    codes[#codes + 1] = -1
  else
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    codes[#codes + 1] = 1
  end
end
return codes
