-- adaptive_take: spend one hedge token of an adaptive policy's budget, if there is one, once per
-- race and role: a race step applied again after a conflict asks again and keeps its token.
-- KEYS[1] counts HASH: tokens (see adaptive_next.lua)
-- KEYS[2] took STRING: set when this race and role spent a token (absent for no marker: an
--   empty key name would hash to a slot of its own on a cluster)
-- ARGV[1] capacity: what an empty hash holds
-- ARGV[2] how long the marker is kept, ms
-- Returns 1 (a token spent, now or before for the same marker) or 0 (none left: nothing changed)
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
  return 1
end
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or ARGV[1]) or tonumber(ARGV[1])
if tokens < 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1))
if KEYS[2] then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
end
return 1
