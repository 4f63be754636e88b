-- race_finish: store the final receipt and let the race's keys expire with it.
-- KEYS[1] receipt STRING   KEYS[2] live jobs HASH   KEYS[3..n] other keys (state, winner, ...)
-- ARGV[1] receipt JSON     ARGV[2] time to keep them, in ms
-- Returns how many provider jobs are still registered as live (the janitor's business if > 0)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
for i = 2, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return redis.call('HLEN', KEYS[2])
