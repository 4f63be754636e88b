-- timer_claim: acknowledge fired timers, cancel timers, then take up to ARGV[2] timers that
-- are due (or whose claimer's lease ran out). Acknowledgements and cancels ride in the claim
-- that follows them, so a busy timer service spends one round trip on all three; either alone
-- is a claim of 0.
-- KEYS[1] due ZSET (id -> due ms)      KEYS[2] in-flight ZSET (id -> lease deadline ms)
-- KEYS[3] data HASH (id -> JSON record) KEYS[4] deliveries HASH (id -> claim count)
-- KEYS[5] chains HASH (chain key -> id of its newest timer; see timer_arm): an acknowledged
--         or cancelled timer that heads its chain leaves it, so the chain reads as idle
-- ARGV[1] now, epoch ms                 ARGV[2] most timers to claim (0: none)
-- ARGV[3] lease in ms: unacknowledged claims become claimable again after it
-- ARGV[4] look-ahead in ms (0: none): also take timers due up to now + this; the claimer
--         holds them and fires each at its due time (one claim for a window of timers)
-- ARGV[5] n, the number of pairs to acknowledge that follow
-- ARGV[6 .. 5+2n] pairs to acknowledge: id1, deadline1, ... (deadline = that claim's token)
-- ARGV[6+2n ..] timer ids to cancel, waiting or in flight
-- Returns {deadline, next_ms, n, ack codes (n), m, cancel codes (m), id1, record1, deliveries1, ...}
--   deadline  the lease deadline of this claim (the token an acknowledgement gives back)
--   next_ms   the earliest due time or lease deadline left after this claim, -1 if none
--   ack codes  1 acknowledged and removed
--              0 not in flight any more (cancelled, or already acknowledged)
--             -1 claimed again by someone else after that claim's lease ran out: left to them
--   cancel codes  1 the timer existed (waiting or in flight) and is gone; 0 it had fired or
--                 never existed
local now = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local deadline = now + tonumber(ARGV[3])
local horizon = now + tonumber(ARGV[4])
local out = {deadline, -1, 0}

-- A timer's chain key is its id up to the last '|' ("<key>|<due>" for a watch poll).
local function leave_chain(id)
  local key = string.match(id, '^(.*)|')
  if key and redis.call('HGET', KEYS[5], key) == id then
    redis.call('HDEL', KEYS[5], key)
  end
end

local acks_end = 5 + 2 * tonumber(ARGV[5])
for i = 6, acks_end, 2 do
  local id = ARGV[i]
  local score = redis.call('ZSCORE', KEYS[2], id)
  local code = 0
  if score and tonumber(score) ~= tonumber(ARGV[i + 1]) then
    code = -1
  elseif score then
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[4], id)
    leave_chain(id)
    code = 1
  end
  out[#out + 1] = code
end
out[3] = #out - 3

local m_at = #out + 1
out[m_at] = 0
for i = acks_end + 1, #ARGV do
  local id = ARGV[i]
  local found = redis.call('ZREM', KEYS[1], id) + redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[4], id)
  if found > 0 then
    leave_chain(id)
  end
  out[#out + 1] = found > 0 and 1 or 0
end
out[m_at] = #out - m_at

local function take(id)
  local record = redis.call('HGET', KEYS[3], id)
  if not record then
    -- Cancelled between being scheduled and claimed: drop the orphan entry.
    redis.call('ZREM', KEYS[2], id)
    return
  end
  redis.call('ZADD', KEYS[2], deadline, id)
  local n = redis.call('HINCRBY', KEYS[4], id, 1)
  out[#out + 1] = id
  out[#out + 1] = record
  out[#out + 1] = n
end

if limit > 0 then
  -- Claims whose holder died come first: they were due before anything still waiting.
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)
  for _, id in ipairs(expired) do
    take(id)
  end
  local room = limit - #expired
  if room > 0 then
    local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', horizon, 'LIMIT', 0, room)
    for _, id in ipairs(due) do
      redis.call('ZREM', KEYS[1], id)
      take(id)
    end
  end
end

local next_ms = -1
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if head[2] then
  next_ms = tonumber(head[2])
end
head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if head[2] and (next_ms < 0 or tonumber(head[2]) < next_ms) then
  next_ms = tonumber(head[2])
end
out[2] = next_ms
return out
