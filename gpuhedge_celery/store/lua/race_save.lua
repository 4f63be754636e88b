-- race_save: write a race's state only if its version is the one the caller read.
-- KEYS[1] state HASH {v = version, s = the last saves "version:id ...", p:... = the state's
--         parts (store/race_parts.py), deadline = for waiting callers}
-- ARGV[1] expected version (0 = the race must not exist yet)
-- ARGV[2] base: '' = a full write (every part, the others dropped); else the id of the save
--         that wrote the expected version: the parts below are a delta from that state, and
--         are applied only if that save still heads the history (the same state, not a race
--         id created again). A base that does not match is answered as a conflict.
-- ARGV[3] expiry in ms for the state key, 0 = keep the current expiry
-- ARGV[4] this save's id ('' = none). A save sent again after its answer was lost (a dropped
--         connection) is answered as saved, not as a conflict with itself, if it is among the
--         last 8 saves: its caller then performs the step's actions, which nobody else would.
--         budget_settle.lua reads that history too: a settlement riding in a save runs only if
--         the save's entry 'version:id' is there (it won).
-- ARGV[5] n, the number of parts to set; ARGV[6 .. 5+2n] field, JSON pairs;
--         ARGV[6+2n ..] the fields of parts to delete
-- Returns {1, new_version}      saved (now, or already by this same save id)
--         {0, current_version, fields}
--                               conflict: someone saved since (current 0 = no such race), or
--                               the delta's base is not the state there; fields: the state
--                               hash as it is (HGETALL), so the caller can decide again from
--                               it without a round trip to read it
-- Redis's Lua stack holds about 8,000 values: HSET and HDEL go in chunks of fields.
local CHUNK = 1000
local function hdel_all(fields, first, last)
  for i = first, last, CHUNK do
    redis.call('HDEL', KEYS[1], unpack(fields, i, math.min(i + CHUNK - 1, last)))
  end
end
local expected = tonumber(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
local history = redis.call('HGET', KEYS[1], 's') or ''
if current ~= expected then
  local mine = (expected + 1) .. ':' .. ARGV[4]
  if ARGV[4] ~= '' and string.find(' ' .. history .. ' ', ' ' .. mine .. ' ', 1, true) then
    return {1, expected + 1}
  end
  return {0, current, redis.call('HGETALL', KEYS[1])}
end
local base = ARGV[2]
if base ~= '' then
  local head = string.match(history, '^%S+') or ''
  -- 'data': a whole state an older version saved over the parts since: not the base
  if head ~= expected .. ':' .. base or redis.call('HEXISTS', KEYS[1], 'data') == 1 then
    return {0, current, redis.call('HGETALL', KEYS[1])}
  end
else
  -- a full write: drop every part of the state it replaces (and an older save's whole state)
  local gone = {}
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    if field == 'data' or string.sub(field, 1, 2) == 'p:' then
      gone[#gone + 1] = field
    end
  end
  hdel_all(gone, 1, #gone)
end
local n = tonumber(ARGV[5])
local last = 5 + 2 * n
hdel_all(ARGV, last + 1, #ARGV)
local version = current + 1
local kept = {version .. ':' .. ARGV[4]}
for entry in string.gmatch(history, '%S+') do
  if #kept >= 8 then break end
  kept[#kept + 1] = entry
end
redis.call('HSET', KEYS[1], 'v', version, 's', table.concat(kept, ' '))
for i = 6, last, 2 * CHUNK do  -- field, JSON pairs
  redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 2 * CHUNK - 1, last)))
end
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {1, version}
