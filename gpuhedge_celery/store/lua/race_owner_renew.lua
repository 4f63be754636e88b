-- race_owner_renew: extend or drop the ownership lease, only for the token that holds it.
-- KEYS[1] owner STRING "token|owner"
-- ARGV[1] token   ARGV[2] lease in ms, or 0 to release the lease
-- Returns 1 renewed (or released), 0 the token no longer holds the lease (expired or taken over)
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
local sep = string.find(held, '|', 1, true)
if string.sub(held, 1, sep - 1) ~= ARGV[1] then
  return 0
end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 1
