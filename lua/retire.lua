-- retire.lua: declare a holder dead now (its balancer was closed and keeps nothing alive).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  holder
-- Returns  1 if the holder was registered.
-- Keeps    I2: its leases stay counted until reaped (by any acquire, heartbeat or reap), each
--          exactly once; a holder with no leases simply leaves.
-- Uses     lib/base
if not redis.call('ZSCORE', P .. 'holders', ARGV[1]) then return 0 end
if redis.call('EXISTS', P .. 'owned:' .. ARGV[1]) == 1 then
  redis.call('ZADD', P .. 'holders', '0', ARGV[1])
else
  redis.call('ZREM', P .. 'holders', ARGV[1])
end
return 1
