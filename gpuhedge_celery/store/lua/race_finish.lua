-- race_finish: store the final receipt, unregister the jobs shown stopped, and let the race's
-- keys expire with it. One script, so nobody reads the jobs as gone with the old receipt.
-- KEYS[1] receipt STRING   KEYS[2] live jobs HASH   KEYS[3..n] other keys (state, winner, ...)
-- ARGV[1] receipt JSON     ARGV[2] time to keep them, in ms
-- ARGV[3..n] attempt ids whose jobs reached a terminal state (unregistered)
-- Returns how many provider jobs are still registered as live (the janitor's business if > 0)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
for i = 3, #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
end
for i = 2, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return redis.call('HLEN', KEYS[2])
