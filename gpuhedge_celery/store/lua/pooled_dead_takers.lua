-- pooled_dead_takers: taken pooled requests whose taker process is dead.
-- KEYS[1] taken index (zset id -> taken ms)   KEYS[2] processes zset (id -> heartbeat ms)
-- ARGV[1] record key prefix (the id is appended)   ARGV[2] dead after this silence (ms)
-- ARGV[3] prefix of the processes' liveness channels   ARGV[4] at most this many ids
-- ARGV[5] ignore requests taken less than this long ago (ms)
-- Returns id, taker, id, taker...; drops index entries whose record is gone or no longer taken.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[5]))
local alive, dead = {}, {}
for _, id in ipairs(ids) do
  local state, taker = unpack(redis.call('HMGET', ARGV[1] .. id, 'state', 'taker'))
  if state ~= 'taken' or not taker then
    redis.call('ZREM', KEYS[1], id)
  else
    if alive[taker] == nil then
      local beat = tonumber(redis.call('ZSCORE', KEYS[2], taker))
      alive[taker] = beat ~= nil and now - beat <= tonumber(ARGV[2])
        and redis.call('PUBSUB', 'NUMSUB', ARGV[3] .. taker)[2] > 0
    end
    if not alive[taker] then
      dead[#dead + 1] = id
      dead[#dead + 1] = taker
      if #dead >= 2 * tonumber(ARGV[4]) then break end
    end
  end
end
return dead
