-- check_fence: the GPU worker's gate; accept work only for the newest, current token.
-- KEYS[1] lease key        KEYS[2] highest accepted token
-- ARGV[1] the token carried by the work
-- Returns {1, token}       accepted (and recorded as the highest accepted)
--         {-3, accepted}   stale: a newer token was already accepted
--         {-1, 0}          no lease (it expired or was freed)
--         {-2, current}    the lease carries another token
local token = tonumber(ARGV[1])
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
if token < accepted then
  return {-3, accepted}
end
local value = redis.call('GET', KEYS[1])
if not value then
  return {-1, 0}
end
local current = tonumber(string.match(value, '^(%d+)|'))
if current ~= token then
  return {-2, current}
end
if token > accepted then
  redis.call('SET', KEYS[2], token)
end
return {1, token}
