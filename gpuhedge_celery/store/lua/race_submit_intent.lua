-- race_submit_intent: record the intent to submit an attempt's job, riding in the round trip
-- of the save that created the attempt's race, only if that save won.
-- KEYS[1] the race's jobs HASH (attempt id -> intent or job handle, store/race_jobs.py)
-- KEYS[2] the race's state HASH (race_save.lua; its history of saves in field s)
-- ARGV[1] the mark 'version:save id' of that save
-- ARGV[2] attempt id
-- ARGV[3] the intent (JSON)
-- Returns -1 when the save did not win (nothing recorded); else what is recorded for the
-- attempt now: ARGV[3] itself when the intent is ours (set now, or by this save's first send).
local history = redis.call('HGET', KEYS[2], 's') or ''
if not string.find(' ' .. history .. ' ', ' ' .. ARGV[1] .. ' ', 1, true) then
  return -1
end
redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3])
return redis.call('HGET', KEYS[1], ARGV[2])
