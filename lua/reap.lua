-- reap.lua: reclaim the leases of dead holders now (processes that stopped sending heartbeats).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  budget: most entries to examine in this call (the caller repeats while it is met)
-- ARGV[2]  how long resent releases are recognised (ms)
-- Returns  { leases reclaimed, entries examined }.
-- Keeps    I1, I2: each lease of a dead holder is reclaimed exactly once, its count with it.
-- Uses     lib/base, lib/admission, lib/leases
local now = now_ms()
rotate_ended(now, tonumber(ARGV[2]))
local reclaimed, examined = reap(now, tonumber(ARGV[1]))
return { reclaimed, examined }
