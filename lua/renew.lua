-- renew.lua: restart a lease's age, for a request that may run longer than max_lease_age.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  lease token
-- Returns  1 if renewed, 0 if the lease is gone (released or reclaimed).
-- Keeps    I1 (no count changes). Liveness is the holder's heartbeat (heartbeat.lua), not this.
-- Uses     lib/base, lib/admission, lib/leases
local rec = redis.call('HGET', P .. 'leases', ARGV[1])
if not rec then return 0 end
local _, _, holder = split_record(rec)
redis.call('ZADD', P .. 'owned:' .. holder, 'XX', int(now_ms()), ARGV[1])
return 1
