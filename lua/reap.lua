-- reap.lua: reclaim the leases of dead holders now (processes that stopped sending heartbeats).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  budget: most entries to examine in this call (the caller repeats while it is met)
-- ARGV[2]  how long resent releases are recognised (ms)
-- ARGV[3]  the caller's lease ttl (ms): a gap in what Redis heard is judged by it; "" (a tool
--          that holds no leases, `redis-router reap`): by the longest lease ttl in use
-- ARGV[4]  "1": report the probation while any holder is on probation, with leases or not (a
--          caller that waits to see every unheard holder declared dead); else only while one
--          that still has leases is
-- Returns  { leases reclaimed, entries examined, ms until the probation after a pause ends
--          while a holder on probation (ARGV[4]) remains (0: none), and then how often (ms)
--          a caller waiting it out must call so that Redis hears it through it }.
-- Keeps    I1, I2: each lease of a dead holder is reclaimed exactly once, its count with it;
--          a holder unheard only during a pause of Redis is on probation, not dead.
-- Uses     lib/base, lib/admission, lib/leases
local now = now_ms()
rotate_released(now, tonumber(ARGV[2]))
local ttl = tonumber(ARGV[3])
if not ttl then ttl = tonumber(redis.call('HGET', P .. 'clock', 'long') or 20000) end
local horizon, till, listen = liveness(now, ttl)
local reclaimed, examined = reap(horizon, tonumber(ARGV[1]))
local limbo = 0
if till > now then
  -- A holder on probation (deadline passed during the gap) that still has leases, or any.
  local every = ARGV[4] == '1'
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', P .. 'holders', '(' .. int(horizon), int(now),
    'LIMIT', '0', '64')) do
    if every or redis.call('EXISTS', P .. 'owned:' .. h) == 1 then
      limbo = till - now
      break
    end
  end
end
return { reclaimed, examined, int(limbo), int(listen) }
