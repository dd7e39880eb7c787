-- prefix_cache_clear.lua: drop the whole prefix index of one balancer (its leases, sessions
-- and replicas stay; destroy() runs this before the core's destroy.lua).
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see prefix_cache_index.lua)
-- Returns  how many blocks the index held.
-- Keeps    I7: only this balancer's pc: keys are touched.
-- Uses     lib/base, prefix_cache_index
local n = redis.call('HLEN', P .. 'pc:idx')
-- UNLINK frees a large index off the main thread (Redis >= 4), so clearing does not stall.
redis.call('UNLINK', P .. 'pc:idx', P .. 'pc:lru', P .. 'pc:n')
return n
