-- forget.lua: end leases Redis counts for a holder that its process no longer holds (a release
-- lost in a failover or an outage, an acquire whose reply never arrived).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  holder            ARGV[2]  grace (ms)            ARGV[3..] tokens
-- Returns  how many leases ended.
-- Keeps    I1, I2: only leases this holder owns, acquired or renewed before now - grace (so a
--          grant still on its way to the process is never taken), each ended once, counted as
--          reclaimed.
-- Uses     lib/base, lib/admission, lib/leases
local owned = P .. 'owned:' .. ARGV[1]
local before = now_ms() - tonumber(ARGV[2])
local n = 0
for i = 3, #ARGV do
  local at = redis.call('ZSCORE', owned, ARGV[i])
  if at and tonumber(at) <= before then
    local id = end_lease(ARGV[i])
    if id then
      redis.call('HINCRBY', P .. 'reclaimed', id, '1')
      n = n + 1
    end
  end
end
return n
