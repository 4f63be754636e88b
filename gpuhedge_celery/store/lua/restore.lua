-- restore: reconcile re-creates the lease of a job a worker reports running, keeping its token.
-- KEYS[1] lease key        KEYS[2] fence counter     KEYS[3] highest accepted token
-- ARGV[1] holder           ARGV[2] token             ARGV[3] TTL in ms
-- ARGV[4] since (epoch ms)
-- Returns 1   the lease now exists with this token (created, or already there and refreshed)
--         0   another token holds the lease: left alone
--        -3   the token is older than one the GPU already accepted: refused
local token = tonumber(ARGV[2])
local value = redis.call('GET', KEYS[1])
if value then
  if tonumber(string.match(value, '^(%d+)|')) == token then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return 1
  end
  return 0
end
if token < tonumber(redis.call('GET', KEYS[3]) or '0') then
  return -3
end
-- Never let the counter fall behind a token in use, or a later claim could reuse it.
if tonumber(redis.call('GET', KEYS[2]) or '0') < token then
  redis.call('SET', KEYS[2], token_text(token))  -- _token.lua, prepended
end
redis.call('SET', KEYS[1], token_text(token) .. '|' .. ARGV[4] .. '|' .. ARGV[1], 'PX', ARGV[3])
return 1
