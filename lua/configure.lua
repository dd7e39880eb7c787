-- configure.lua: read the settings every process of one balancer must share (read only: the
-- first acquire pins them, so constructing a balancer or running a read-only command never
-- writes).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     the fields of P.."config" to read (sticky_ttl_ms, affinity_margin, ...)
-- Returns  their pinned values, false for a field not pinned yet ("" = an option pinned off).
-- Keeps    read only.
-- Uses     lib/base
return redis.call('HMGET', P .. 'config', unpack(ARGV))
