-- configure.lua: pin settings that every process of one balancer must share.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky ttl (ms) this process wants
-- Returns  the sticky ttl (ms) pinned in Redis (this one if it is the first).
-- Keeps    the sticky bucket layout identical across processes (I3).
redis.call('HSETNX', P .. 'config', 'sticky_ttl_ms', ARGV[1])
return redis.call('HGET', P .. 'config', 'sticky_ttl_ms')
