-- pooled_direct: a caller claims a free GPU for its pooled request itself, when nobody waits.
-- Claiming the lease and recording the request as handed to that GPU happen in one script, so a
-- caller that dies after it leaves a record the sweep resends once the unrenewed lease ends.
-- KEYS[1] the request's record (hash)   KEYS[2] handed index (zset id -> handed ms)
-- KEYS[3] the pool's waiters (zset)      KEYS[4] the pool's lease TTL (ms; absent: ARGV[5])
-- KEYS[5] the pool's freeat hash (gpu -> fence|ms, kept by wait_claim.lua)
-- KEYS[6..] for each candidate GPU, in order: its lease key, its fence counter, its out-of-pool
--           hash, its host's heartbeat key in the pool, its registry hash
-- (every key on the pool's hash tag: one slot)
-- ARGV[1] request id   ARGV[2] the record's data (JSON: args, kwargs, queue)
-- ARGV[3] the record's TTL (ms)   ARGV[4] the pool's name   ARGV[5] the lease TTL (ms) when the
-- pool has none   ARGV[6..] candidate GPU ids, in KEYS order
-- Returns {1, gpu_id, token, ttl_ms, since_ms}  claimed and recorded as handed (since: Redis's
--                                               clock); also a repeat of this request's own
--                                               claim whose reply was lost: the same lease
--         {0}                                   someone waits in the pool's queue, no candidate
--                                               is free (its lease held, out of the pool, its
--                                               host silent, registered elsewhere), or the
--                                               request already has a record of another kind:
--                                               it goes through the wait queue as usual
-- Fairness: it never claims a GPU while a request is queued for the pool.
local state, delivery, gpu0, token0 =
  unpack(redis.call('HMGET', KEYS[1], 'state', 'delivery', 'gpu', 'token'))
if state then
  if state == 'handed' and delivery == 'direct' then
    for i = 1, (#KEYS - 5) / 5 do
      if ARGV[5 + i] == gpu0 then
        local value = redis.call('GET', KEYS[5 + 5 * (i - 1) + 1])
        if value and string.sub(value, 1, #token0 + 1) == token0 .. '|' then
          local since = string.match(value, '^%d+|(%d+)|')
          local ttl = tonumber(redis.call('GET', KEYS[4]) or ARGV[5])
          return {1, gpu0, tonumber(token0), ttl, tonumber(since)}
        end
      end
    end
  end
  return {0}
end
if redis.call('ZCARD', KEYS[3]) > 0 then return {0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, (#KEYS - 5) / 5 do
  local base = 5 + 5 * (i - 1)
  if redis.call('EXISTS', KEYS[base + 1]) == 0 and redis.call('EXISTS', KEYS[base + 3]) == 0
      and redis.call('EXISTS', KEYS[base + 4]) == 1
      and redis.call('HGET', KEYS[base + 5], 'pool') == ARGV[4] then
    local gpu = ARGV[5 + i]
    local ttl = tonumber(redis.call('GET', KEYS[4]) or ARGV[5])
    local token = next_token(KEYS[base + 2], now)  -- _token.lua, prepended
    local text = token_text(token)
    redis.call('SET', KEYS[base + 1], text .. '|' .. now .. '|' .. ARGV[1], 'NX', 'PX', ttl)
    redis.call('HDEL', KEYS[5], gpu)
    redis.call('HSET', KEYS[1], 'data', ARGV[2], 'state', 'handed', 'delivery', 'direct',
      'attempt', '0', 'gpu', gpu, 'token', text)
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    redis.call('ZADD', KEYS[2], now, ARGV[1])
    return {1, gpu, token, ttl, now}
  end
end
return {0}
