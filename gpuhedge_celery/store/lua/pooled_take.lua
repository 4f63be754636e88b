-- pooled_take: a worker takes a pooled request, unless a live delivery already has it.
-- KEYS[1] the request's record (hash: data, state, taker, delivery)
-- KEYS[2] untaken index (zset id -> sent ms)   KEYS[3] taken index (zset id -> taken ms)
-- KEYS[4] missing index (zset)                   KEYS[5] the pool's processes zset (id -> heartbeat
--         ms; the taker is marked alive there now: it waits on the pool next)
-- KEYS[6] handed index (zset)   (every key on the pool's hash tag: one slot)
-- ARGV[1] request id   ARGV[2] this process id   ARGV[3] this delivery (unique per run)
-- ARGV[4] a heartbeat older than this (ms) is a dead process
-- ARGV[5] prefix of the processes' liveness channels
-- ARGV[6] this delivery's attempt (a request sent back to waiting after its GPU was lost comes
--         with a higher attempt: it always takes the request, and the older delivery is stale)
-- ARGV[7] the record's TTL (ms), counted again from the take: a long wait does not expire it
-- Returns 'taken' (go on), 'duplicate' (another live delivery has it: drop this one),
-- 'handed' (already handed to a GPU: drop this one) or 'unrecorded' (no record: go on).
-- A taker counts as alive as in wait_claim.lua: a fresh heartbeat and its channel subscribed.
if redis.call('EXISTS', KEYS[1]) == 0 then return 'unrecorded' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state, taker, delivery, attempt =
  unpack(redis.call('HMGET', KEYS[1], 'state', 'taker', 'delivery', 'attempt'))
if tonumber(ARGV[6]) <= tonumber(attempt or '-1') then
  if state == 'handed' then return 'handed' end
  if state == 'taken' and taker and delivery ~= ARGV[3] then
    local beat = tonumber(redis.call('ZSCORE', KEYS[5], taker))
    if beat ~= nil and now - beat <= tonumber(ARGV[4])
        and redis.call('PUBSUB', 'NUMSUB', ARGV[5] .. taker)[2] > 0 then
      return 'duplicate'
    end
  end
end
redis.call('HSET', KEYS[1], 'state', 'taken', 'taker', ARGV[2], 'delivery', ARGV[3],
  'attempt', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[5], now, ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1])
return 'taken'
