-- leave.lua: a waiting acquire gives up (its time is up): its ticket leaves the queue.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  ticket
-- Returns  1 if it was waiting.
-- Keeps    I11: if it had been woken, the wake passes to the next waiter.
-- Uses     lib/base, lib/admission, lib/leases
local ticket = ARGV[1]
if redis.call('ZREM', P .. 'waiters', ticket) == 0 then return 0 end
redis.call('HDEL', P .. 'waiting', ticket)
redis.call('DEL', P .. 'wake:' .. ticket)
redis.call('HINCRBY', P .. 'waitstats', 'timed_out', '1')
admit().wake_first()
return 1
