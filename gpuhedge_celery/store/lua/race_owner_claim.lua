-- race_owner_claim: take (or re-take) the ownership lease of a race, with a fencing token.
-- KEYS[1] owner STRING "token|owner" with a PX expiry
-- KEYS[2] fencing counter (strictly increasing per race, and past a failover that lost its last
--         writes: next_token's floor from Redis TIME)
-- KEYS[3] the race's state: a new counter expires with it, never before the lease
-- ARGV[1] owner name (a coordinator or janitor id)
-- ARGV[2] lease in ms
-- ARGV[3] a new counter's TTL in ms when the state is gone (a janitor claiming a finished race)
-- Returns {1, token, owner}   claimed, or already ours (lease renewed, token unchanged)
--         {0, token, owner}   held by another owner whose lease is still running
local held = redis.call('GET', KEYS[1])
if held then
  local sep = string.find(held, '|', 1, true)
  local token = tonumber(string.sub(held, 1, sep - 1))
  local owner = string.sub(held, sep + 1)
  if owner == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, token, owner}
  end
  return {0, token, owner}
end
local token = next_token(KEYS[2])
if redis.call('PTTL', KEYS[2]) == -1 then
  local keep = redis.call('PTTL', KEYS[3])
  if keep == -2 then keep = tonumber(ARGV[3]) end
  if keep >= 0 then
    redis.call('PEXPIRE', KEYS[2], math.max(keep, tonumber(ARGV[2])))
  end
end
redis.call('SET', KEYS[1], token_text(token) .. '|' .. ARGV[1], 'PX', ARGV[2])
return {1, token, ARGV[1]}
