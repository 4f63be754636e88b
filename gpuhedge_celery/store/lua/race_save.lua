-- race_save: write a race's serialised state only if its version is the one the caller read.
-- KEYS[1] state HASH {v = version, data = JSON, s = the last saves, "version:id ..."}
-- ARGV[1] expected version (0 = the race must not exist yet)
-- ARGV[2] new state JSON
-- ARGV[3] expiry in ms for the state key, 0 = keep the current expiry
-- ARGV[4] this save's id ('' = none). A save sent again after its answer was lost (a dropped
--         connection) is answered as saved, not as a conflict with itself, if it is among the
--         last 8 saves: its caller then performs the step's actions, which nobody else would.
--         budget_settle.lua reads that history too: a settlement riding in a save runs only if
--         the save's entry 'version:id' is there (it won).
-- Returns {1, new_version}      saved (now, or already by this same save id)
--         {0, current_version}  conflict: someone saved since (current 0 = no such race)
local expected = tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
local history = redis.call('HGET', KEYS[1], 's') or ''
if current ~= expected then
  local mine = (expected + 1) .. ':' .. ARGV[4]
  if ARGV[4] ~= '' and string.find(' ' .. history .. ' ', ' ' .. mine .. ' ', 1, true) then
    return {1, expected + 1}
  end
  return {0, current}
end
local version = current + 1
local kept = {version .. ':' .. ARGV[4]}
for entry in string.gmatch(history, '%S+') do
  if #kept >= 8 then break end
  kept[#kept + 1] = entry
end
redis.call('HSET', KEYS[1], 'v', version, 'data', ARGV[2], 's', table.concat(kept, ' '))
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {1, version}
