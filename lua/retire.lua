-- retire.lua: a closed balancer's holder lets its leases go now and leaves.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  holder            ARGV[2]  budget: most leases to end in this call
-- ARGV[3]  how long resent releases are recognised (ms), as heartbeat.lua's ARGV[4]: the
--          generation of remembered releases gets its expiry if no heartbeat has given it one
--          (the process closes before its first), so it never outlives the last process
-- Returns  { 1 if the holder was registered, leases ended, 1 if some are left (the caller
--          calls again) }.
-- Keeps    I1, I2: each of its leases ends exactly once, its count with it; the holder leaves
--          P.."holders" once it owns nothing, and until then is dead (deadline 0), so a call
--          that never comes back (the process exits) leaves the rest to any reaper. I11: a
--          replica a lease leaves takes new sessions again and wakes the first waiter.
--          Safe to resend: a second copy finds fewer leases (or none) to end. I9: remembered
--          releases stay their window, then go (lib/leases.lua expire_remembered).
-- Uses     lib/base, lib/admission, lib/leases
local holder, budget = ARGV[1], tonumber(ARGV[2])
if ARGV[3] then expire_remembered(tonumber(ARGV[3])) end
if not redis.call('ZSCORE', P .. 'holders', holder) then return { 0, 0, 0 } end
local owned = P .. 'owned:' .. holder
local n = 0
for _, token in ipairs(redis.call('ZRANGE', owned, '0', int(budget - 1))) do
  if end_lease(token) then n = n + 1 else redis.call('ZREM', owned, token) end
end
if redis.call('EXISTS', owned) == 1 then
  redis.call('ZADD', P .. 'holders', '0', holder)
  return { 1, n, 1 }
end
redis.call('ZREM', P .. 'holders', holder)
return { 1, n, 0 }
