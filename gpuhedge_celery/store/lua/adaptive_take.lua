-- adaptive_take: spend one hedge token of an adaptive policy's budget, if there is one.
-- KEYS[1] counts HASH: tokens (see adaptive_next.lua)
-- ARGV[1] capacity: what an empty hash holds
-- Returns 1 (a token spent) or 0 (none left: nothing changed)
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or ARGV[1]) or tonumber(ARGV[1])
if tokens < 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1))
return 1
