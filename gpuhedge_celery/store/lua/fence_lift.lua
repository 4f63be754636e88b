-- fence_lift: a GPU worker refused work whose token is below its own mark (a failover lost the
-- counter's last writes and the new primary's clock is behind): free that work's lease, and
-- lift the fence counter to the mark so the next token issued (INCR) is one the worker takes.
-- KEYS[1] lease key        KEYS[2] fence counter
-- ARGV[1] the refused token   ARGV[2] its holder id, or '' to free whichever holder carries it
-- ARGV[3] the worker's mark
-- Returns {freed, counter}  freed 1 if the lease carried the token (and holder) and is gone, else
--                           0; counter: the fence counter now (never lowered)
-- Repeating it after a lost reply is safe: nothing is left to free, and the counter stays.
local freed = 0
local value = redis.call('GET', KEYS[1])
if value then
  local token, holder = string.match(value, '^(%d+)|[^|]*|(.*)$')
  if token == ARGV[1] and (ARGV[2] == '' or holder == ARGV[2]) then
    redis.call('DEL', KEYS[1])
    freed = 1
  end
end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
local mark = tonumber(ARGV[3])
if counter < mark then
  counter = mark
  redis.call('SET', KEYS[2], token_text(counter))  -- _token.lua, prepended
end
return {freed, token_text(counter)}
