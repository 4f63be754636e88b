-- gpu_finish: the GPU worker's steps after a job, in one round trip: clear the GPU's running
-- record if it is this job's, then release the lease (as release.lua: token and holder).
-- KEYS[1] the GPU's running record   KEYS[2] lease key
-- ARGV[1] this job's task id followed by '|'   ARGV[2] the job's token   ARGV[3] its holder id
-- Returns 1 released, -1 no lease (it expired or was freed), -2 another token or holder holds it
local running = redis.call('GET', KEYS[1])
if running and string.sub(running, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
local value = redis.call('GET', KEYS[2])
if not value then
  return -1
end
local token, holder = string.match(value, '^(%d+)|[^|]*|(.*)$')
if token ~= ARGV[2] or holder ~= ARGV[3] then
  return -2
end
redis.call('DEL', KEYS[2])
return 1
