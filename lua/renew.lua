-- renew.lua: push a lease's expiry to now + lease ttl (Redis clock).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  lease ttl (ms)    ARGV[2]  lease token
-- Returns  1 if renewed, 0 if the lease is gone (released or reclaimed).
-- Keeps    I1 (no count changes); the due index stays a lower bound, so reaping stays correct.
local rec = redis.call('HGET', P .. 'leases', ARGV[2])
if not rec then return 0 end
redis.call('ZADD', P .. 'held:' .. server_of(rec), 'XX', now_ms() + tonumber(ARGV[1]), ARGV[2])
return 1
