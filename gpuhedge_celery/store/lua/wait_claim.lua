-- wait_claim: join (or stay in) a pool's FIFO queue and claim a GPU if it is this waiter's turn.
-- Queueing and claiming happen in one script, so no GPU can be freed "between" them.
-- KEYS[1] waiters zset (holder -> arrival number)   KEYS[2] waitinfo hash   KEYS[3] arrival counter
-- KEYS[4..] for each candidate GPU, in order: its lease key, then its fence counter
-- ARGV[1] holder           ARGV[2] now (epoch ms)     ARGV[3] TTL in ms
-- ARGV[4] this waiter is presumed dead after this time (epoch ms)
-- ARGV[5] GPUs this waiter accepts, comma-separated ('' = any)
-- ARGV[6] wake channel     ARGV[7] pool name
-- ARGV[8] '1' on the waiter's first call, '0' on later ones
-- ARGV[9..] candidate GPU ids, in KEYS order
-- Returns {1, gpu_id, token, ttl_ms}   claimed; the waiter left the queue
--         {0, rank, min_pttl}          still waiting: 0-based place in the queue and the PTTL of
--                                      the soonest-expiring held lease (-1 if none expires)
--         {-5}                         another process cancelled this waiter (leave with cancel)
-- Turn rule: walking the queue from its head, every live waiter ahead takes the first free GPU
-- it accepts; this waiter claims only a free GPU still left after that. Waiters whose liveness
-- time passed are removed on the way (a crashed process cannot block the queue).
local holder = ARGV[1]
local now = tonumber(ARGV[2])
local n = (#KEYS - 3) / 2

if not redis.call('ZSCORE', KEYS[1], holder) then
  if ARGV[8] == '0' and redis.call('HGET', KEYS[2], holder) == 'cancelled' then
    redis.call('HDEL', KEYS[2], holder)
    return {-5}
  end
  -- First call, or aged out while alive (e.g. paused): (re)join at the back.
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[3]), holder)
end
redis.call('HSET', KEYS[2], holder, ARGV[4] .. '|' .. ARGV[5])

local function accepts(filter, gpu)
  return filter == '' or string.find(',' .. filter .. ',', ',' .. gpu .. ',', 1, true) ~= nil
end

-- PTTL on a logically expired key deletes it now, so a due lease is probed, not waited for.
local free = {}
local nfree = 0
local min_pttl = -1
for i = 1, n do
  local pttl = redis.call('PTTL', KEYS[2 + 2 * i])
  if pttl == -2 then
    free[i] = true
    nfree = nfree + 1
  elseif pttl >= 0 and (min_pttl < 0 or pttl < min_pttl) then
    min_pttl = pttl
  end
end

local rank = redis.call('ZRANK', KEYS[1], holder)
if nfree > 0 and rank > 0 then
  local ahead = redis.call('ZRANGE', KEYS[1], 0, rank - 1)
  for _, other in ipairs(ahead) do
    local info = redis.call('HGET', KEYS[2], other)
    local sep = info and string.find(info, '|', 1, true)
    if not sep or tonumber(string.sub(info, 1, sep - 1)) < now then
      redis.call('ZREM', KEYS[1], other)
      redis.call('HDEL', KEYS[2], other)
    else
      local filter = string.sub(info, sep + 1)
      for i = 1, n do
        if free[i] and accepts(filter, ARGV[8 + i]) then
          free[i] = nil
          nfree = nfree - 1
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
  if free[i] and accepts(ARGV[5], ARGV[8 + i]) then
    local token = redis.call('INCR', KEYS[3 + 2 * i])
    redis.call('SET', KEYS[2 + 2 * i], token .. '|' .. ARGV[2] .. '|' .. holder, 'NX', 'PX', ARGV[3])
    redis.call('ZREM', KEYS[1], holder)
    redis.call('HDEL', KEYS[2], holder)
    -- Other GPUs are still free: tell the waiters behind us it may be their turn.
    if nfree > 1 and redis.call('ZCARD', KEYS[1]) > 0 then
      redis.call('PUBLISH', ARGV[6], ARGV[7])
    end
    return {1, ARGV[8 + i], token, tonumber(ARGV[3])}
  end
end
return {0, redis.call('ZRANK', KEYS[1], holder) or 0, min_pttl}
