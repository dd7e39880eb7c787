-- owned.lua: the leases of one holder old enough to be compared with what its process holds.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  holder            ARGV[2]  grace (ms): leases acquired or renewed since are left out
-- Returns  their tokens.
-- Keeps    read only.
-- Uses     lib/base
return redis.call('ZRANGEBYSCORE', P .. 'owned:' .. ARGV[1], '-inf', int(now_ms() - tonumber(ARGV[2])))
