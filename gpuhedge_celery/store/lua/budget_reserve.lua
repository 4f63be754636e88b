-- budget_reserve: reserve one attempt's worst-case cost against every cap that applies, or
-- refuse it, and append what happened to the ledger stream; all in one atomic step, so two
-- workers can never both take the last headroom of a cap.
-- KEYS[1] totals HASH ("r|<scope>" reserved, "s|<scope>" spent, nano-dollars)
-- KEYS[2] open ZSET (reservation id -> epoch ms after which the janitor may settle it)
-- KEYS[3] ledger STREAM
-- KEYS[4] this reservation's record HASH
-- KEYS[5] the race's request counter STRING (nano-dollars reserved or spent by the race)
-- ARGV[1] reservation id "<race>/<attempt>"    ARGV[2] amount, integer nano-dollars
-- ARGV[3] open-until epoch ms                   ARGV[4] how long request counters stay (ms)
-- ARGV[5] UTC day   ARGV[6] provider   ARGV[7] budget key ('' for none)   ARGV[8] role
-- ARGV[9] the per-request cap, ARGV[10 ..] the cap of each scope in order, nano-dollars
--         (-1: counted, no cap). The scopes, as core/budget.py's scopes() names them:
--         all, d:<day>, p:<provider>, d:<day>:p:<provider>, and with a key k:<key>,
--         d:<day>:k:<key>
-- KEYS[6] (optional) the race's state HASH (race_save.lua), with ARGV[10 + number of scopes]
--         the mark 'version:save id' of the race save this reservation rides with (the create
--         of the race): it reserves only if that save won, i.e. the mark is in the state's
--         history of saves (field s). A redelivered create that lost reserves nothing.
-- Returns {1, amount, 0, 0}          reserved now
--         {2, amount, 0, 0}          reserved already (a repeat: nothing changes)
--         {3, settled, 0, 0}         reserved and settled already: do not submit again
--         {0, cap, used, slot}       refused: used + amount would pass the cap of the slot
--                                    (0 = per request, i = the i-th scope)
--         {-1, 0, 0, 0}              (with a save mark) that save did not win: nothing done
-- Every number is checked before the first write (Lua is not rolled back on an error): a bad
-- one fails the call with "ERR budget_reserve: ..." and changes nothing.
local MAX_NANO = 9007199254740992  -- 2^53: exact in a Lua number, far inside HINCRBY's range
local function whole(i, low)
  local v = tonumber(ARGV[i])
  if not v or v ~= v or v < low or v > MAX_NANO or v ~= math.floor(v) then
    error('budget_reserve: ARGV[' .. i .. '] ' .. tostring(ARGV[i]) ..
      ' is not a whole number from ' .. low .. ' to 2^53')
  end
  return v
end
local id, amount = ARGV[1], whole(2, 0)
whole(3, 0)
whole(4, 1)
local found = redis.call('HMGET', KEYS[4], 'amount', 'settled')
if found[1] then
  if found[2] then
    return {3, tonumber(found[2]), 0, 0}
  end
  return {2, tonumber(found[1]), 0, 0}
end
local day, provider, key, role = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local race, attempt = string.match(id, '^(.*)/([^/]*)$')
local scopes = {'all', 'd:' .. day, 'p:' .. provider, 'd:' .. day .. ':p:' .. provider}
if key ~= '' then
  scopes[5] = 'k:' .. key
  scopes[6] = 'd:' .. day .. ':k:' .. key
end
if KEYS[6] then
  local history = redis.call('HGET', KEYS[6], 's') or ''
  if not string.find(' ' .. history .. ' ', ' ' .. ARGV[10 + #scopes] .. ' ', 1, true) then
    return {-1, 0, 0, 0}
  end
end
local function refuse(cap, used, slot)
  redis.call('XADD', KEYS[3], '*', 'type', 'refuse', 'id', id, 'nano', amount, 'race', race,
    'attempt', attempt, 'provider', provider, 'key', key, 'role', role, 'day', day,
    'cap_index', slot, 'cap_nano', cap, 'used_nano', used)
  return {0, cap, used, slot}
end
for i = 9, 9 + #scopes do
  whole(i, -1)
end
local request_cap = tonumber(ARGV[9])
if request_cap >= 0 then
  local used = tonumber(redis.call('GET', KEYS[5]) or '0')
  if used + amount > request_cap then
    return refuse(request_cap, used, 0)
  end
end
local fields, capped = {}, {}
for i = 1, #scopes do
  if tonumber(ARGV[9 + i]) >= 0 then
    capped[#capped + 1] = i
    fields[#fields + 1] = 'r|' .. scopes[i]
    fields[#fields + 1] = 's|' .. scopes[i]
  end
end
if #fields > 0 then
  local v = redis.call('HMGET', KEYS[1], unpack(fields))
  for j, i in ipairs(capped) do
    local cap = tonumber(ARGV[9 + i])
    local used = tonumber(v[2 * j - 1] or '0') + tonumber(v[2 * j] or '0')
    if used + amount > cap then
      return refuse(cap, used, i)
    end
  end
end
for i = 1, #scopes do
  redis.call('HINCRBY', KEYS[1], 'r|' .. scopes[i], amount)
end
if redis.call('INCRBY', KEYS[5], amount) == amount then
  redis.call('PEXPIRE', KEYS[5], ARGV[4])
end
redis.call('HSET', KEYS[4], 'amount', amount, 'scopes', table.concat(scopes, ','), 'race', race,
  'attempt', attempt, 'provider', provider, 'key', key, 'role', role, 'day', day,
  'open_until', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], id)
redis.call('XADD', KEYS[3], '*', 'type', 'reserve', 'id', id, 'nano', amount, 'race', race,
  'attempt', attempt, 'provider', provider, 'key', key, 'role', role, 'day', day)
return {1, amount, 0, 0}
