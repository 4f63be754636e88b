-- force_release: reconcile frees a lease whatever its holder says.
-- KEYS[1] lease key
-- ARGV[1] token to match, or '' to free whichever lease is there
-- Returns 1   freed
--         0   nothing freed (no lease, or it carries another token)
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
if ARGV[1] ~= '' and string.match(value, '^(%d+)|') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
