-- pooled_handoff: the delivery that holds a GPU for a pooled request hands it to the GPU.
-- KEYS[1] the request's record   KEYS[2] taken index (zset)
-- ARGV[1] request id   ARGV[2] this delivery   ARGV[3] the record's TTL (ms), counted again
-- Returns 'handed' (go on), 'unrecorded' (no record: go on) or 'superseded' (another delivery
-- took the request since, its taker judged dead: give the GPU back, drop this one).
if redis.call('EXISTS', KEYS[1]) == 0 then return 'unrecorded' end
local state, delivery = unpack(redis.call('HMGET', KEYS[1], 'state', 'delivery'))
-- A repeat of this delivery's own handoff (its reply was lost, and the call sent again) goes on.
if state == 'handed' and delivery == ARGV[2] then return 'handed' end
if state ~= 'taken' or delivery ~= ARGV[2] then return 'superseded' end
redis.call('HSET', KEYS[1], 'state', 'handed')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[1])
return 'handed'
