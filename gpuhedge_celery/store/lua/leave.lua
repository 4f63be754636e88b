-- leave: take a waiter out of a pool's queue (its wait ended, or another process cancels it).
-- KEYS[1] waiters zset     KEYS[2] waitinfo hash
-- ARGV[1] holder           ARGV[2] wake channel      ARGV[3] pool name
-- ARGV[4] '1' when another process cancels the wait: leaves a 'cancelled' mark that the
--         waiter's next wait_claim finds (and removes), so its acquire ends instead of rejoining
-- Returns 1   removed (the waiters behind it are told it may be their turn; a cancelled
--             waiter is told too, so its acquire ends now)
--         0   it was not queued
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if removed == 1 and ARGV[4] == '1' then
  redis.call('HSET', KEYS[2], ARGV[1], 'cancelled')
else
  redis.call('HDEL', KEYS[2], ARGV[1])
end
if removed == 1 and (ARGV[4] == '1' or redis.call('ZCARD', KEYS[1]) > 0) then
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return removed
