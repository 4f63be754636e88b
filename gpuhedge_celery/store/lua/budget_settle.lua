-- budget_settle: settle reservations of one race to what their attempts actually cost: each
-- scope's reserved counter drops by the reservation, its spent counter grows by the cost, and
-- the settlement is appended to the ledger stream. A reservation settles once; a repeat, or an
-- attempt that never reserved, changes nothing.
-- KEYS[1] totals HASH   KEYS[2] open ZSET   KEYS[3] ledger STREAM
-- KEYS[4] the race's request counter STRING
-- KEYS[5] with a save mark only (ARGV[3]): the race's state HASH (race_save.lua)
-- KEYS[5 or 6 ..] the reservation records (HASH), one per reservation to settle
-- ARGV[1] how long a settled record stays (ms)   ARGV[2] now, epoch ms
-- ARGV[3] '' (settle), or the mark 'version:save id' of the race save this settlement rides
--         with: it settles only if that save won, i.e. the mark is in the state's history of
--         saves (field s). A save that lost its version check was computed from an old copy
--         of the race, and a reservation settles once: its figure would stick.
-- ARGV[4 ..] per reservation, in KEYS order: cost in integer nano-dollars, and its source
--            (reconciled | estimated | unproven | not_submitted | late | late_estimate)
-- Sources 'late' and 'late_estimate' settle again, once, a reservation already settled: a job
-- settled at its price to an accepted cancel that then showed more (a late result, the
-- janitor's confirmed cancel). Its spent counters move by the difference (the new figure, at
-- most the reservation, less the old), an 'adjust' entry (nano: that difference) joins the
-- ledger, and the record keeps 'late' 1 and 'late_source'. A 'late' figure is the provider's
-- own and moves either way; a 'late_estimate' (our clock, after a delivery nothing checked)
-- never lowers the first. On a reservation not settled yet, either settles as usual.
-- A cost above its reservation settles at the reservation (the worst case was the bound the
-- caps were checked against); the figure asked for stays in the ledger entry as
-- 'reported_nano' with 'over_reported' 1, and the provider's count of such settlements in
-- KEYS[1] ('o|<provider>', read by metrics serve) grows by one.
-- Every argument is checked before the first write (Lua is not rolled back on an error):
-- a bad one fails the whole call with "ERR budget_settle: ..." and changes nothing.
-- Returns {settled, nano}: how many reservations settled now, and their cost together
local MAX_NANO = 9007199254740992  -- 2^53: exact in a Lua number, far inside HINCRBY's range
local first = 5
if ARGV[3] ~= '' then
  first = 6
  local history = redis.call('HGET', KEYS[5], 's') or ''
  if not string.find(' ' .. history .. ' ', ' ' .. ARGV[3] .. ' ', 1, true) then
    return {0, 0}
  end
end
if #ARGV ~= 3 + (#KEYS - first + 1) * 2 then
  return redis.error_reply('budget_settle: expected a cost and a source per reservation')
end
local costs = {}
for k = first, #KEYS do
  local a = 4 + (k - first) * 2
  local cost = tonumber(ARGV[a])
  if not cost or cost ~= cost or cost < 0 or cost > MAX_NANO or cost ~= math.floor(cost) then
    return redis.error_reply('budget_settle: cost ' .. tostring(ARGV[a]) .. ' of ' .. KEYS[k] ..
      ' is not a whole number of nano-dollars from 0 to 2^53')
  end
  costs[k] = cost
end
local settled, total = 0, 0
for k = first, #KEYS do
  local a = 4 + (k - first) * 2
  local cost, source = costs[k], ARGV[a + 1]
  local r = redis.call('HMGET', KEYS[k], 'amount', 'settled', 'scopes', 'race', 'attempt',
    'provider', 'key', 'role', 'day', 'late')
  if r[1] and r[2] and (source == 'late' or source == 'late_estimate') and not r[10] then
    local new = math.min(cost, tonumber(r[1]))
    if source == 'late_estimate' then
      new = math.max(new, tonumber(r[2]))
    end
    local delta = new - tonumber(r[2])
    for scope in string.gmatch(r[3], '[^,]+') do
      redis.call('HINCRBY', KEYS[1], 's|' .. scope, delta)
    end
    if redis.call('EXISTS', KEYS[4]) == 1 then
      redis.call('INCRBY', KEYS[4], delta)
    end
    redis.call('HSET', KEYS[k], 'settled', new, 'late', 1, 'late_source', source,
      'settled_at', ARGV[2])
    local entry = {'type', 'adjust', 'id', r[4] .. '/' .. r[5], 'nano', delta, 'source', source,
      'race', r[4], 'attempt', r[5], 'provider', r[6], 'key', r[7], 'role', r[8], 'day', r[9]}
    if cost > new and cost > tonumber(r[1]) then
      for _, v in ipairs({'reported_nano', string.format('%d', cost), 'over_reported', 1}) do
        entry[#entry + 1] = v
      end
      redis.call('HINCRBY', KEYS[1], 'o|' .. r[6], 1)
    end
    redis.call('XADD', KEYS[3], '*', unpack(entry))
    total = total + delta
  elseif r[1] and not r[2] then
    local amount = tonumber(r[1])
    local reported = cost
    if cost > amount then
      cost = amount
    end
    for scope in string.gmatch(r[3], '[^,]+') do
      redis.call('HINCRBY', KEYS[1], 'r|' .. scope, -amount)
      redis.call('HINCRBY', KEYS[1], 's|' .. scope, cost)
    end
    if redis.call('EXISTS', KEYS[4]) == 1 then
      redis.call('INCRBY', KEYS[4], cost - amount)
    end
    redis.call('HSET', KEYS[k], 'settled', cost, 'source', source, 'settled_at', ARGV[2])
    redis.call('PEXPIRE', KEYS[k], ARGV[1])
    local id = r[4] .. '/' .. r[5]
    redis.call('ZREM', KEYS[2], id)
    local entry = {'type', 'settle', 'id', id, 'nano', cost, 'reserved_nano', amount,
      'source', source, 'race', r[4], 'attempt', r[5], 'provider', r[6], 'key', r[7],
      'role', r[8], 'day', r[9]}
    if reported > cost then
      for _, v in ipairs({'reported_nano', string.format('%d', reported), 'over_reported', 1}) do
        entry[#entry + 1] = v
      end
      redis.call('HINCRBY', KEYS[1], 'o|' .. r[6], 1)
    end
    redis.call('XADD', KEYS[3], '*', unpack(entry))
    settled = settled + 1
    total = total + cost
  end
end
return {settled, total}
