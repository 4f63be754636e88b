-- pooled_requeue: make a pooled request "sent" again, only if it still is what the sweep saw.
-- KEYS[1] the request's record   KEYS[2] untaken index   KEYS[3] taken index
-- KEYS[4] missing index   KEYS[5] handed index
-- (every key on the pool's hash tag: one slot)
-- ARGV[1] request id   ARGV[2] the state the sweep saw ('sent', 'taken' or 'handed')
-- ARGV[3] the taker the sweep saw ('' for none)   ARGV[4] now (ms, the untaken index's clock)
-- Returns the request's data (arguments JSON) to send again, or false when it changed meanwhile
-- (taken by a live delivery, handed to a GPU, ended).
local state, taker, data = unpack(redis.call('HMGET', KEYS[1], 'state', 'taker', 'data'))
if not data or state ~= ARGV[2] or (taker or '') ~= ARGV[3] then return false end
redis.call('HSET', KEYS[1], 'state', 'sent')
redis.call('HDEL', KEYS[1], 'taker', 'delivery', 'attempt', 'gpu', 'token')
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
return data
