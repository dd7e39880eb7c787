-- reap.lua: reclaim expired leases now (their holders died or forgot to release).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  budget: most leases to reclaim in this call (the caller repeats while it is met)
-- Returns  how many leases were reclaimed.
-- Keeps    I1, I2: each expired lease is reclaimed exactly once, its count with it.
return reap(now_ms(), tonumber(ARGV[1]))
