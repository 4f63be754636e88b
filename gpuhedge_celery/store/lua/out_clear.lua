-- out_clear: reasons that kept a GPU out of the pool are gone; if none is left, wake its waiters.
-- KEYS[1] the GPU's out-of-pool hash (reason -> since_ms|detail)   KEYS[2] the GPU's registry hash
-- ARGV[1] wake channel   ARGV[2..] the reasons to clear
-- Returns 1 if the GPU is back in the pool now (no reason left), 0 if it is still out.
-- The wake message names the GPU's pool, so that pool's waiters claim again at once.
local removed = redis.call('HDEL', KEYS[1], unpack(ARGV, 2))
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
if removed > 0 then
  local pool = redis.call('HGET', KEYS[2], 'pool')
  if pool then
    redis.call('PUBLISH', ARGV[1], pool)
  end
end
return 1
