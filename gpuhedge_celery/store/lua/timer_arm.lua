-- timer_arm: add one timer to a timer namespace, waking sleepers if it is the new earliest.
-- KEYS[1] due ZSET (id -> due ms)      KEYS[2] data HASH (id -> JSON record)
-- KEYS[3] sequence counter              KEYS[4] in-flight ZSET (id -> lease deadline ms)
-- KEYS[5] chains HASH (chain key -> id of its newest timer)
-- ARGV[1] timer key (e.g. "race|hedge") ARGV[2] due time, epoch ms
-- ARGV[3] JSON record                   ARGV[4] explicit timer id, or "" to number one
-- ARGV[5] wake-up channel name (pub/sub channels are not keys)
-- ARGV[6] chain mode: ""     a timer on its own
--                     "head" the timer is the newest of its key's chain (a job's next watch
--                            poll; its id is "<key>|...", so an acknowledgement finds the key)
--                     "idle" as "head", but only if the chain has no timer waiting or in
--                            flight (a recovery's poll must not start a second chain)
-- Returns {id, 1}  armed
--         {id, 0}  an explicit id that is already pending or in flight: nothing changed
--                  (with "idle": the id of the chain's live timer)
local id = ARGV[4]
local mode = ARGV[6]
if mode == 'idle' then
  local head = redis.call('HGET', KEYS[5], ARGV[1])
  if head and (redis.call('ZSCORE', KEYS[1], head) or redis.call('ZSCORE', KEYS[4], head)) then
    return {head, 0}
  end
end
if mode ~= '' then
  redis.call('HSET', KEYS[5], ARGV[1], id)
end
if id == '' then
  id = ARGV[1] .. '|' .. redis.call('INCR', KEYS[3])
elseif redis.call('ZSCORE', KEYS[1], id) or redis.call('ZSCORE', KEYS[4], id) then
  return {id, 0}
end
local due = tonumber(ARGV[2])
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[1], due, id)
redis.call('HSET', KEYS[2], id, ARGV[3])
-- Sleepers plan their wake-up from the earliest due time they last saw; only a timer that
-- becomes the new earliest can make them late, so only that one is announced.
if head[2] == nil or due < tonumber(head[2]) then
  redis.call('PUBLISH', ARGV[5], ARGV[2])
end
return {id, 1}
