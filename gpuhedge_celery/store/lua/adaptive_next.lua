-- adaptive_next: number the next request of an adaptive policy and refill its hedge budget.
-- KEYS[1] counts HASH: seq (requests planned so far), tokens (the hedge budget's bucket)
-- ARGV[1] budget: tokens added per request ('' for none: tokens are not kept)
-- ARGV[2] capacity: the most tokens the bucket holds (an empty hash starts full)
-- Returns {seq, tokens as a string ('' without a budget)}
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
if ARGV[1] == '' then
  return {seq, ''}
end
local cap = tonumber(ARGV[2])
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or ARGV[2]) or cap
tokens = math.min(cap, tokens + tonumber(ARGV[1]))
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens))
return {seq, tostring(tokens)}
