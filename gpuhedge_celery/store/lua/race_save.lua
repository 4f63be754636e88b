-- race_save: write a race's serialised state only if its version is the one the caller read.
-- KEYS[1] state HASH {v = version, data = JSON}
-- ARGV[1] expected version (0 = the race must not exist yet)
-- ARGV[2] new state JSON
-- ARGV[3] expiry in ms for the state key, 0 = keep the current expiry
-- Returns {1, new_version}      saved
--         {0, current_version}  conflict: someone saved since (current 0 = no such race)
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if current ~= tonumber(ARGV[1]) then
  return {0, current}
end
local version = current + 1
redis.call('HSET', KEYS[1], 'v', version, 'data', ARGV[2])
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {1, version}
