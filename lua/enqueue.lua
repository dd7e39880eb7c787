-- enqueue.lua: queue an acquire that found every eligible replica full (or ejected), to be
-- served first come first served across every process.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  ticket (client-made, unique)   ARGV[2]  holder (alive while its heartbeats come)
-- ARGV[3]  how long it waits at most (ms)
-- Returns  how many wait before it (0: it is first).
-- Keeps    I11: tickets wait in arrival order; the first one is woken (LPUSH on
--          P.."wake:"..ticket, which its process BLPOPs) whenever a replica takes new
--          sessions; a ticket whose time is up or whose holder is dead is dropped by the next
--          script that looks at the queue. Safe to resend: a ticket is queued once.
-- Uses     lib/base, lib/admission, lib/leases
local ticket, holder = ARGV[1], ARGV[2]
if redis.call('HEXISTS', P .. 'waiting', ticket) == 0 then
  local now = now_ms()
  redis.call('ZADD', P .. 'waiters', redis.call('INCR', P .. 'waitseq'), ticket)
  redis.call('HSET', P .. 'waiting', ticket,
    holder .. SEP .. int(now + tonumber(ARGV[3])) .. SEP .. int(now))
end
admit().wake_first()
return redis.call('ZRANK', P .. 'waiters', ticket) or 0
