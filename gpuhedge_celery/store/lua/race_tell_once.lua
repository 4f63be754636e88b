-- race_tell_once: decide once what a race's caller is told (with replicas to wait for), so a
-- winner and an explicit failure racing each other never both reach the caller.
-- KEYS[1] state HASH (race_save.lua)
-- ARGV[1] the field that keeps the decision   ARGV[2] this teller's outcome ('won', 'failed')
-- Returns the outcome decided (this one, or the one decided before); false when the race's
-- state is gone (expired): nothing is written, so no key is left without an expiry.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], ARGV[1])
