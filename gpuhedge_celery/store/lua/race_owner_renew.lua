-- race_owner_renew: extend or drop the ownership lease, only for the token and owner holding it
-- (the owner too: a failover that lost the counter's last writes must not let an equal token
-- issued to someone else pass).
-- KEYS[1] owner STRING "token|owner"
-- ARGV[1] token   ARGV[2] lease in ms, or 0 to release the lease   ARGV[3] owner name
-- Returns 1 renewed (or released), 0 the token no longer holds the lease (expired or taken over)
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
if held ~= ARGV[1] .. '|' .. ARGV[3] then
  return 0
end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 1
