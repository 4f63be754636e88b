-- pooled_dead_takers: taken pooled requests whose taker process is dead.
-- KEYS[1] the pool's taken index (zset id -> taken ms)   KEYS[2] the pool's processes zset
-- KEYS[3..] the records of the requests to look at, in ARGV[4..] order
-- (every key on the pool's hash tag: one slot; the caller read the ids from KEYS[1])
-- ARGV[1] dead after this silence (ms)   ARGV[2] prefix of the processes' liveness channels
-- ARGV[3] at most this many ids   ARGV[4..] the request ids, one per record in KEYS[3..]
-- Returns id, taker, id, taker...; drops index entries whose record is gone or no longer taken.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local alive, dead = {}, {}
for i = 3, #KEYS do
  local id = ARGV[i + 1]
  local state, taker = unpack(redis.call('HMGET', KEYS[i], 'state', 'taker'))
  if state ~= 'taken' or not taker then
    redis.call('ZREM', KEYS[1], id)
  else
    if alive[taker] == nil then
      local beat = tonumber(redis.call('ZSCORE', KEYS[2], taker))
      alive[taker] = beat ~= nil and now - beat <= tonumber(ARGV[1])
        and redis.call('PUBSUB', 'NUMSUB', ARGV[2] .. taker)[2] > 0
    end
    if not alive[taker] then
      dead[#dead + 1] = id
      dead[#dead + 1] = taker
      if #dead >= 2 * tonumber(ARGV[3]) then break end
    end
  end
end
return dead
