-- drain.lua: stop sending new sessions to replicas; their sticky sessions stay.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     server ids
-- Returns  how many replicas changed state (were taking new sessions).
-- Keeps    I1: the count moves with the replica from `load` to `draining` unchanged (a
--          replica that is off, full or ejected, returns to `draining`).
-- Uses     lib/base
local n = 0
for _, id in ipairs(ARGV) do
  local count = redis.call('ZSCORE', P .. 'load', id)
  if count then
    redis.call('ZREM', P .. 'load', id)
    redis.call('ZADD', P .. 'draining', count, id)
    n = n + 1
  elseif redis.call('HGET', P .. 'back', id) == 'load' then
    redis.call('HSET', P .. 'back', id, 'draining') -- full or ejected: returns draining
    n = n + 1
  end
end
return n
