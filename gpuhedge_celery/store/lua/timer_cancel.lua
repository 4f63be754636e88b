-- timer_cancel: remove a timer whether it is waiting or in flight.
-- KEYS[1] due ZSET   KEYS[2] in-flight ZSET   KEYS[3] data HASH   KEYS[4] deliveries HASH
-- ARGV[1] timer id
-- Returns 1 if the timer existed (waiting or in flight), 0 if it had fired or never existed.
local found = redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if found > 0 then
  return 1
end
return 0
