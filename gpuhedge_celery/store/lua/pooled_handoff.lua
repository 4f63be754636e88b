-- pooled_handoff: the delivery that holds a GPU for a pooled request hands it to the GPU.
-- KEYS[1] the request's record   KEYS[2] taken index (zset)   KEYS[3] handed index (zset)
-- (every key on the pool's hash tag: one slot)
-- ARGV[1] request id   ARGV[2] this delivery   ARGV[3] the record's TTL (ms), counted again
-- ARGV[4] the GPU   ARGV[5] the lease's token (the sweep resends the request if that lease
--         ends while the record is still handed: the GPU job never ran, or died unreported)
-- Returns 'handed' (go on), 'unrecorded' (no record: go on) or 'superseded' (another delivery
-- took the request since, its taker judged dead: give the GPU back, drop this one).
if redis.call('EXISTS', KEYS[1]) == 0 then return 'unrecorded' end
local state, delivery = unpack(redis.call('HMGET', KEYS[1], 'state', 'delivery'))
-- A repeat of this delivery's own handoff (its reply was lost, and the call sent again) goes on.
if state == 'handed' and delivery == ARGV[2] then return 'handed' end
if state ~= 'taken' or delivery ~= ARGV[2] then return 'superseded' end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'state', 'handed', 'gpu', ARGV[4], 'token', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
return 'handed'
