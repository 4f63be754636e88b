-- check_fence: the GPU worker's gate; accept work only for the newest, current token. Given
-- KEYS[3] and KEYS[4] it is the whole start of a GPU job in one round trip (gpu_run,
-- tasks/gpu_steps.py): the request's stop flag first, the running record once accepted.
-- KEYS[1] lease key        KEYS[2] highest accepted token
-- KEYS[3] (optional) the request's stop flag   KEYS[4] (with KEYS[3]) the GPU's running record
-- ARGV[1] the token carried by the work   ARGV[2] (with KEYS[4]) this delivery's running record
-- ARGV[3] (optional) the work's holder id: the current token must be this holder's, as in
--         renew.lua (a failover can issue a number again); absent or '' = the token alone
-- Returns {1, token}       accepted (and recorded as the highest accepted); with KEYS[4]:
--                          {1, previous}, the running record now ARGV[2], previous its old
--                          value ('' if none)
--         {0, ''}          (with KEYS[3]) someone asked the request to stop: nothing written
--         {-3, accepted}   stale: a newer token was already accepted
--         {-1, 0}          no lease (it expired or was freed)
--         {-2, current}    the lease carries another token
--         {-2, 0}          (with ARGV[3]) it carries this token for another holder
-- Repeating it after a lost reply is safe: the same token is accepted again, and the running
-- record's previous value is then this delivery's own.
if #KEYS >= 3 and redis.call('EXISTS', KEYS[3]) == 1 then
  return {0, ''}
end
local token = tonumber(ARGV[1])
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
if token < accepted then
  return {-3, accepted}
end
local value = redis.call('GET', KEYS[1])
if not value then
  return {-1, 0}
end
local current_text, holder = string.match(value, '^(%d+)|[^|]*|(.*)$')
local current = tonumber(current_text)
if current ~= token then
  return {-2, current}
end
if ARGV[3] and ARGV[3] ~= '' and holder ~= ARGV[3] then
  return {-2, 0}
end
if token > accepted then
  redis.call('SET', KEYS[2], token_text(token))  -- _token.lua, prepended
end
if #KEYS >= 4 then
  return {1, redis.call('SET', KEYS[4], ARGV[2], 'GET') or ''}
end
return {1, token}
