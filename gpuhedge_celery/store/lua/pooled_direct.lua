-- pooled_direct: a caller claims a free GPU for its pooled request itself, when nobody waits.
-- Claiming the lease and recording the request as handed to that GPU happen in one script, so a
-- caller that dies after it leaves a record the sweep resends once the unrenewed lease ends.
-- KEYS[1] the request's record (hash)   KEYS[2] handed index (zset id -> handed ms)
-- KEYS[3] the pool's waiters (zset)      KEYS[4] lease TTLs by pool (hash)
-- KEYS[5] the pool's freeat hash (gpu -> fence|ms, kept by wait_claim.lua)
-- KEYS[6..] for each candidate GPU, in order: its lease key, its fence counter, its out-of-pool
--           hash, its host's heartbeat key
-- ARGV[1] request id   ARGV[2] the record's data (JSON: args, kwargs, queue)
-- ARGV[3] the record's TTL (ms)   ARGV[4] now (client epoch ms, the lease's since)
-- ARGV[5] the pool's name   ARGV[6] the lease TTL (ms) when the pool has none
-- ARGV[7..] candidate GPU ids, in KEYS order
-- Returns {1, gpu_id, token, ttl_ms}  claimed and recorded as handed
--         {0}                         someone waits for this pool, or no candidate is free (its
--                                     lease held, out of the pool, or its host silent): the
--                                     request goes through the wait queue as usual
-- Fairness: a request never overtakes a waiter; it claims only what wait_claim.lua would give
-- the head of an empty queue.
if redis.call('ZCARD', KEYS[3]) > 0 then return {0} end
local n = (#KEYS - 5) / 4
for i = 1, n do
  local base = 5 + 4 * (i - 1)
  if redis.call('EXISTS', KEYS[base + 1]) == 0 and redis.call('EXISTS', KEYS[base + 3]) == 0
      and redis.call('EXISTS', KEYS[base + 4]) == 1 then
    local gpu = ARGV[6 + i]
    local ttl = tonumber(redis.call('HGET', KEYS[4], ARGV[5]) or ARGV[6])
    local token = redis.call('INCR', KEYS[base + 2])
    redis.call('SET', KEYS[base + 1], token .. '|' .. ARGV[4] .. '|' .. ARGV[1], 'NX', 'PX', ttl)
    redis.call('HDEL', KEYS[5], gpu)
    local t = redis.call('TIME')
    redis.call('HSET', KEYS[1], 'data', ARGV[2], 'state', 'handed', 'delivery', 'direct',
      'attempt', '0', 'gpu', gpu, 'token', token)
    redis.call('HDEL', KEYS[1], 'taker')
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    redis.call('ZADD', KEYS[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
    return {1, gpu, token, ttl}
  end
end
return {0}
