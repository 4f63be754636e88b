-- coordinator_beat: renew (or end) a timer coordinator's lease and list the live ones, in the
-- Redis server's time (no client clock skew between hosts).
-- KEYS[1] coordinators zset (coordinator id -> lease expiry, server epoch ms)
-- ARGV[1] coordinator id
-- ARGV[2] lease length (ms); 0 ends the lease (a coordinator that stops)
-- Returns the ids whose lease runs, this one included unless it ended
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl * 4)
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return redis.call('ZRANGE', KEYS[1], 0, -1)
