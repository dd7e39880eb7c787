-- configure.lua: read the settings every process of one balancer must share (read only: the
-- first acquire pins them, so constructing a balancer or running a read-only command never
-- writes).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- Returns  the pinned sticky ttl (ms), or false when none is pinned yet.
-- Keeps    read only.
-- Uses     lib/base
return redis.call('HGET', P .. 'config', 'sticky_ttl_ms')
