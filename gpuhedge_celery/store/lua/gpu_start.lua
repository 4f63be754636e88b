-- gpu_start: the GPU worker's steps before a job starts, in one round trip: the request's stop
-- flag, the fencing check (as check_fence.lua), then the GPU's running record.
-- KEYS[1] the request's stop flag   KEYS[2] lease key   KEYS[3] highest accepted token
-- KEYS[4] the GPU's running record (task id|token|ms)
-- ARGV[1] the token carried by the job   ARGV[2] this delivery's running record
-- Returns {0, ''}          someone asked the request to stop: nothing checked or written
--         {1, previous}    accepted (the token recorded as the highest accepted) and the running
--                          record written; previous: its value before ('' if none)
--         {-3, accepted} / {-1, 0} / {-2, current}  refused, as check_fence.lua: nothing written
-- Repeating it after a lost reply is safe: the same token is accepted again and the running
-- record's previous value is then this delivery's own.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, ''}
end
local token = tonumber(ARGV[1])
local accepted = tonumber(redis.call('GET', KEYS[3]) or '0')
if token < accepted then
  return {-3, accepted}
end
local value = redis.call('GET', KEYS[2])
if not value then
  return {-1, 0}
end
local current = tonumber(string.match(value, '^(%d+)|'))
if current ~= token then
  return {-2, current}
end
if token > accepted then
  redis.call('SET', KEYS[3], token)
end
return {1, redis.call('SET', KEYS[4], ARGV[2], 'GET') or ''}
