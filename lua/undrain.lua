-- undrain.lua: let draining replicas take new sessions again.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     server ids
-- Returns  how many replicas changed state (were draining).
-- Keeps    I1: the count moves with the replica from `draining` to `load` unchanged (a
--          replica that is off returns to `load`); a waiter is woken.
-- Uses     lib/base, lib/admission, lib/leases
local n = 0
for _, id in ipairs(ARGV) do
  local count = redis.call('ZSCORE', P .. 'draining', id)
  if count then
    redis.call('ZREM', P .. 'draining', id)
    redis.call('ZADD', P .. 'load', count, id)
    n = n + 1
    admit().wake_first()
  elseif redis.call('HGET', P .. 'back', id) == 'draining' then
    redis.call('HSET', P .. 'back', id, 'load') -- full or ejected: returns to `load`
    n = n + 1
  end
end
return n
