-- race_finish: the end of a race: store the final receipt, unregister the jobs shown stopped,
-- drop the request, let the race's keys expire with the receipt, append the race's record and
-- update the race indexes. One script, so nobody reads the jobs as gone with the old receipt.
-- With a save mark it rides in the pipeline of the save whose step finished the race and is
-- done only if that save won: the receipt was assembled from the state the save wrote.
-- All its keys are on the slot of the race's shard: the race's own and its shard's indexes.
-- KEYS[1] receipt STRING   KEYS[2] live jobs HASH   KEYS[3] state HASH (race_save.lua)
-- KEYS[4] request STRING   KEYS[5] the shard's record STREAM
-- KEYS[6] the shard's recently finished ZSET   KEYS[7] the shard's live races ZSET
-- KEYS[8..n] other keys of the race, to expire with the receipt
-- ARGV[1] '' (finish now), or the mark 'version:save id' of the save it rides with: it runs
--         only if the mark is in the state's history of saves (the save won)
-- ARGV[2] receipt JSON     ARGV[3] time to keep the race's keys, ms   ARGV[4] now, epoch ms
-- ARGV[5] race id          ARGV[6] most races the recently finished index keeps
-- ARGV[7] record JSON, '' for none   ARGV[8] the record stream's MAXLEN (approximate)
-- ARGV[9..n] attempt ids whose jobs reached a terminal state (unregistered)
-- Returns {1, live}   finished; live = provider jobs still registered (the janitor's if > 0:
--                     the race then stays in the live index)
--         {-1, 0}     (with a mark) the save did not win: nothing done
-- With a mark, sent again after a lost answer (the same save id), it writes the same receipt
-- again but appends no second record: a receipt already there was written with the record.
local again = false
if ARGV[1] ~= '' then
  local history = redis.call('HGET', KEYS[3], 's') or ''
  if not string.find(' ' .. history .. ' ', ' ' .. ARGV[1] .. ' ', 1, true) then
    return {-1, 0}
  end
  again = redis.call('EXISTS', KEYS[1]) == 1
end
local ttl = ARGV[3]
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
for i = 9, #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
end
redis.call('DEL', KEYS[4])  -- nothing submits once the race is finished
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
for i = 8, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ttl)
end
if ARGV[7] ~= '' and not again then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[8], '*', 'r', ARGV[7])
end
local now = tonumber(ARGV[4])
redis.call('ZADD', KEYS[6], now, ARGV[5])
redis.call('ZREMRANGEBYRANK', KEYS[6], 0, -tonumber(ARGV[6]) - 1)
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now - tonumber(ttl))
redis.call('PEXPIRE', KEYS[6], ttl)
local live = redis.call('HLEN', KEYS[2])
if live == 0 then
  redis.call('ZREM', KEYS[7], ARGV[5])  -- a job still registered keeps it for the janitor
end
return {1, live}
