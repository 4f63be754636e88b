-- proc_beat: a waiting process's heartbeat, in the Redis server's time (no client clock skew).
-- KEYS[1] processes zset (process id -> last heartbeat, server epoch ms)
-- ARGV[1] process id
-- ARGV[2] forget processes silent for longer than this (ms); a missing process counts as dead
-- Returns the server time of the heartbeat (epoch ms)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[2])))
return now
