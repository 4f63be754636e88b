-- wait_claim: join (or stay in) a pool's FIFO queue and claim a GPU if it is this waiter's turn.
-- Queueing and claiming happen in one script, so no GPU can be freed "between" them.
-- KEYS[1] waiters zset (holder -> arrival number)   KEYS[2] waitinfo hash   KEYS[3] arrival counter
-- KEYS[4] the pool's processes zset (process id -> last heartbeat)
-- KEYS[5] freeat hash (gpu -> fence|ms)   (every key on the pool's hash tag: one slot)
-- KEYS[6..] for each candidate GPU, in order: its lease key, its fence counter, its out-of-pool
--           hash (present while the GPU takes no new lease: drained, model not loaded, unhealthy)
-- ARGV[1] holder           ARGV[2] now (client epoch ms, the lease's since)   ARGV[3] TTL in ms
-- ARGV[4] grace (ms): the entry is removed once it has not re-checked for this long
-- ARGV[5] GPUs this waiter accepts, comma-separated ('' = any)
-- ARGV[6] wake channel     ARGV[7] pool name
-- ARGV[8] '1' on the waiter's first call, '0' on later ones
-- ARGV[9] this waiter's process id (its heartbeat is recorded here too)
-- ARGV[10] prefix of the process channels: a live process stays subscribed to prefix .. its id
-- ARGV[11] a process whose heartbeat is older than this (ms) is dead
-- ARGV[12] pass-over window (ms)
-- ARGV[13] '1' if this waiter wakes on lease events (so it may be passed over), '0' if not
-- ARGV[14..] candidate GPU ids, in KEYS order
-- Returns {1, gpu_id, token, ttl_ms}   claimed; the waiter left the queue
--         {0, rank, wait_ms}           still waiting: 0-based place in the queue and the ms until
--                                      a check may change the outcome (the soonest held lease is
--                                      due, or a pass-over window closes; -1 if neither)
--         {-5}                         another process cancelled this waiter (leave with cancel)
-- Turn rule: walking the queue from its head, every live waiter ahead takes the first free GPU
-- it accepts; this waiter claims only a free GPU still left after that. A waiter ahead is dead,
-- and removed on the way, when its process is gone (no subscriber on its channel: the process
-- exited or was killed), silent (heartbeat older than ARGV[11]: paused, or its host is cut off)
-- or it stopped re-checking (ARGV[4]). A live waiter ahead that wakes on events and has not checked within a pass-over
-- window of the GPU becoming free (see `overdue`) is passed over for that GPU but keeps its
-- place. All liveness times are the server's (TIME), so client clock skew does not matter.
-- A GPU that is out of the pool is never free here, whatever its lease: it waits for no one.
local holder = ARGV[1]
local grace, proc_ttl, window = tonumber(ARGV[4]), tonumber(ARGV[11]), tonumber(ARGV[12])
local n = (#KEYS - 5) / 3
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if not redis.call('ZSCORE', KEYS[1], holder) then
  if ARGV[8] == '0' and redis.call('HGET', KEYS[2], holder) == 'cancelled' then
    redis.call('HDEL', KEYS[2], holder)
    return {-5}
  end
  -- First call, or removed while alive (e.g. paused): (re)join at the back.
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[3]), holder)
end
-- Entry: alive_until|checked|passable|process|filter
redis.call('HSET', KEYS[2], holder,
  (now + grace) .. '|' .. now .. '|' .. ARGV[13] .. '|' .. ARGV[9] .. '|' .. ARGV[5])
redis.call('ZADD', KEYS[4], now, ARGV[9])

local function accepts(filter, gpu)
  return filter == '' or string.find(',' .. filter .. ',', ',' .. gpu .. ',', 1, true) ~= nil
end

local ids = {}
for i = 1, n do
  ids[i] = ARGV[13 + i]
end
local seen = {}
if n > 0 then
  seen = redis.call('HMGET', KEYS[5], unpack(ids))
end

-- PTTL on a logically expired key deletes it now, so a due lease is probed, not waited for.
local free = {}
local nfree = 0
local wait_ms = -1
for i = 1, n do
  local out = redis.call('EXISTS', KEYS[5 + 3 * i]) == 1
  local pttl = -1
  if not out then
    pttl = redis.call('PTTL', KEYS[3 + 3 * i])
  end
  if pttl == -2 then
    free[i] = true
    nfree = nfree + 1
  else
    if seen[i] then
      redis.call('HDEL', KEYS[5], ids[i])
    end
    if pttl >= 0 and (wait_ms < 0 or pttl < wait_ms) then
      wait_ms = pttl
    end
  end
end

-- When waiters first saw free GPU i: recorded on first need, with the GPU's fence counter, so
-- a record left from an earlier free period (the fence moved on since) is not trusted.
local since = {}
local function since_of(i)
  if since[i] == nil then
    local fence = redis.call('GET', KEYS[4 + 3 * i]) or '0'
    local rec = seen[i]
    local sep = rec and string.find(rec, '|', 1, true)
    if sep and string.sub(rec, 1, sep - 1) == fence then
      since[i] = tonumber(string.sub(rec, sep + 1))
    else
      since[i] = now
      redis.call('HSET', KEYS[5], ids[i], fence .. '|' .. now)
    end
  end
  return since[i]
end

-- Every waiter that is not given a free GPU re-checks at each window boundary since + k*window
-- (the wait_ms returned below). So once window k has closed, a live waiter has checked at or
-- after boundary k-1 (the free moment itself for k = 1); one that has not is overdue.
local function overdue(checked, i)
  local s = since_of(i)
  local k = math.floor((now - s) / window)
  return k >= 1 and checked < s + (k - 1) * window
end

local alive = {[ARGV[9]] = true}  -- process id -> alive (this waiter's process is)
local function process_alive(proc)
  if alive[proc] == nil then
    local beat = tonumber(redis.call('ZSCORE', KEYS[4], proc))
    alive[proc] = beat ~= nil and now - beat <= proc_ttl
      and redis.call('PUBSUB', 'NUMSUB', ARGV[10] .. proc)[2] > 0
  end
  return alive[proc]
end

local rank = redis.call('ZRANK', KEYS[1], holder)
local reserved = {}  -- free GPUs left to a waiter ahead that may still be passed over
if nfree > 0 and rank > 0 then
  local ahead = redis.call('ZRANGE', KEYS[1], 0, rank - 1)
  for _, other in ipairs(ahead) do
    local info = redis.call('HGET', KEYS[2], other)
    local alive_until, checked, passable, proc, filter
    if info then
      alive_until, checked, passable, proc, filter =
        string.match(info, '^(%d+)|(%d+)|([01])|([^|]*)|(.*)$')
    end
    if not proc or tonumber(alive_until) < now or not process_alive(proc) then
      redis.call('ZREM', KEYS[1], other)
      redis.call('HDEL', KEYS[2], other)
    else
      checked = tonumber(checked)
      for i = 1, n do
        if free[i] and accepts(filter, ids[i]) and not (passable == '1' and overdue(checked, i)) then
          free[i] = nil
          nfree = nfree - 1
          reserved[i] = passable == '1'
          break
        end
      end
      if nfree == 0 then
        break
      end
    end
  end
end

for i = 1, n do
  if free[i] and accepts(ARGV[5], ids[i]) then
    local token = next_token(KEYS[4 + 3 * i], now)  -- _token.lua, prepended
    redis.call('SET', KEYS[3 + 3 * i], token_text(token) .. '|' .. ARGV[2] .. '|' .. holder,
      'NX', 'PX', ARGV[3])
    redis.call('ZREM', KEYS[1], holder)
    redis.call('HDEL', KEYS[2], holder)
    if seen[i] or since[i] then
      redis.call('HDEL', KEYS[5], ids[i])
    end
    -- Other GPUs are still free: tell the waiters behind us it may be their turn.
    if nfree > 1 and redis.call('ZCARD', KEYS[1]) > 0 then
      redis.call('PUBLISH', ARGV[6], ARGV[7])
    end
    return {1, ids[i], token, tonumber(ARGV[3])}
  end
end

-- Not our turn: come back when a window closes on a GPU we would take if passed to us.
for i = 1, n do
  if reserved[i] and accepts(ARGV[5], ids[i]) then
    local s = since_of(i)
    local next_at = s + (math.floor((now - s) / window) + 1) * window
    if wait_ms < 0 or next_at - now < wait_ms then
      wait_ms = next_at - now
    end
  end
end
return {0, redis.call('ZRANK', KEYS[1], holder) or 0, wait_ms}
