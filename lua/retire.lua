-- retire.lua: a closed balancer's holder lets its leases go now and leaves.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  holder            ARGV[2]  budget: most leases to end in this call
-- Returns  { 1 if the holder was registered, leases ended, 1 if some are left (the caller
--          calls again) }.
-- Keeps    I1, I2: each of its leases ends exactly once, its count with it; the holder leaves
--          P.."holders" once it owns nothing, and until then is dead (deadline 0), so a call
--          that never comes back (the process exits) leaves the rest to any reaper. I11: a
--          replica a lease leaves takes new sessions again and wakes the first waiter.
--          Safe to resend: a second copy finds fewer leases (or none) to end.
-- Uses     lib/base, lib/admission, lib/leases
local holder, budget = ARGV[1], tonumber(ARGV[2])
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
