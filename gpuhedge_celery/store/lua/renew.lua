-- renew: extend a lease, only for the holder of the current fencing token.
-- KEYS[1] lease key
-- ARGV[1] the caller's token   ARGV[2] new TTL in ms   ARGV[3] the caller's holder id
-- Returns 1   renewed
--        -1   no lease (it expired or was freed)
--        -2   the lease carries another token, or this token with another holder (a failover
--             that lost writes can issue a number again: the holder tells the two apart)
local value = redis.call('GET', KEYS[1])
if not value then
  return -1
end
local token, holder = string.match(value, '^(%d+)|[^|]*|(.*)$')
if token ~= ARGV[1] or holder ~= ARGV[3] then
  return -2
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
