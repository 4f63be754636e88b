-- _token: the fencing-token rule, prepended by store/scripts.py to every script that calls
-- next_token or token_text (it is no script of its own).
-- A token is max(INCR of the GPU's fence counter, Redis TIME in ms x 1000); when the floor wins
-- the counter is SET to it. So a token issued after a failover that lost the counter's last
-- writes is still above every earlier one, as long as the new primary's clock is not behind
-- the old one's by more than the failover took and no millisecond issued over 1000 tokens.
-- Tokens (about 1.8e15) stay below 2^53, so a Lua number holds them exactly; they are written
-- with token_text, never with `..` or tostring, which give '1.8e+15' in Lua 5.1.
local function token_text(n)
  return string.format('%d', n)
end

-- The Redis server's clock in epoch ms.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The next token of the counter at counter_key (now_ms: the server's ms if already read).
local function next_token(counter_key, now_ms)
  local floor = (now_ms or server_ms()) * 1000
  local token = redis.call('INCR', counter_key)
  if token < floor then
    token = floor
    redis.call('SET', counter_key, token_text(token))
  end
  return token
end
