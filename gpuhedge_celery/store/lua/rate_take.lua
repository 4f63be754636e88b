-- rate_take: take one request token from a shared token bucket, or reserve the next one.
-- Time is Redis's own (TIME), so every host of the fleet reads one clock: no skew between
-- the processes that share the bucket.
-- KEYS[1] bucket HASH: tokens (may be negative: tokens already reserved), ts (ms of the last
--         refill, Redis time)
-- ARGV[1] capacity (tokens; the burst)
-- ARGV[2] refill rate, tokens per ms
-- ARGV[3] max wait, ms: a reservation further ahead than this is refused, nothing is taken
-- ARGV[4] key TTL, ms (an idle bucket vanishes; a vanished bucket reads as full)
-- ARGV[5] hold (optional, default 0): tokens kept for takers without one. A taker with a
--         hold waits behind them: it is granted only a token free now beyond the hold, never
--         a reservation, so it never holds a slot one of them would have had.
-- Returns {1, wait_ms}  granted: send the request wait_ms from now (0: at once)
--         {0, wait_ms}  refused: the next token is due in wait_ms; nothing changed
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens, ts = cap, now
end
if now > ts then
  tokens = math.min(cap, tokens + (now - ts) * rate)
  ts = now
end
local hold = tonumber(ARGV[5] or '0')
local wait = 0
if tokens - hold < 1 then
  wait = (1 + hold - tokens) / rate
end
if wait > tonumber(ARGV[3]) or (hold > 0 and wait > 0) then
  return {0, math.ceil(wait)}
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(ts))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, math.ceil(wait)}
