-- claim: take a free GPU's lease and issue the next fencing token in one step (next_token:
-- _token.lua, prepended).
-- KEYS[1] lease key        KEYS[2] fence counter
-- KEYS[3] GPU hash         KEYS[4] the pool's TTL (ms; absent: ARGV[4])
-- (all on the pool's hash tag: one slot)
-- KEYS[5] the GPU's out-of-pool hash (reason -> detail; present while the GPU takes no lease:
--         drained, model not loaded, unhealthy)
-- ARGV[1] holder           ARGV[2] TTL in ms, 0 = the pool's TTL
-- ARGV[3] now (epoch ms)   ARGV[4] default TTL in ms when the pool has none
-- Returns {1, token, ttl_ms, pool}  claimed
--         {0}                       the GPU is held by someone
--         {-4}                      the GPU is not registered
--         {-6}                      the GPU is out of the pool (KEYS[5] exists)
local pool = redis.call('HGET', KEYS[3], 'pool')
if not pool then
  return {-4}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0}
end
if redis.call('EXISTS', KEYS[5]) == 1 then
  return {-6}
end
local ttl = tonumber(ARGV[2])
if ttl <= 0 then
  ttl = tonumber(redis.call('GET', KEYS[4]) or ARGV[4])
end
local token = next_token(KEYS[2])
redis.call('SET', KEYS[1], token_text(token) .. '|' .. ARGV[3] .. '|' .. ARGV[1], 'NX', 'PX', ttl)
return {1, token, ttl, pool}
