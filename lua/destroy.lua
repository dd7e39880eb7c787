-- destroy.lua: delete every key of this balancer (replicas, leases, sessions, counters).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)    ARGV[2]  buckets to search back
-- Returns  how many keys were deleted.
-- Keeps    I7: only keys under this balancer's prefix are touched.
-- Uses     lib/base
local width, span = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = math.floor(now_ms() / width)
local n = 0
for _, zs in ipairs({ 'load', 'draining', 'off' }) do
  for _, id in ipairs(redis.call('ZRANGE', P .. zs, 0, -1)) do
    n = n + redis.call('DEL', P .. 'held:' .. id)
  end
end
for _, holder in ipairs(redis.call('ZRANGE', P .. 'holders', 0, -1)) do
  n = n + redis.call('DEL', P .. 'owned:' .. holder)
end
for _, ticket in ipairs(redis.call('ZRANGE', P .. 'waiters', 0, -1)) do
  n = n + redis.call('DEL', P .. 'wake:' .. ticket)
end
for b = cur + 1, cur - span, -1 do
  n = n + redis.call('DEL', P .. 'sticky:' .. b, P .. 'stickyn:' .. b, P .. 'group:' .. b)
end
for _, k in ipairs({ 'servers', 'load', 'draining', 'leases', 'byreq', 'holders', 'remembered',
                     'remembered:old', 'released', 'released:old', 'ended', 'ended:old',
                     'acquires', 'sticky_hits', 'reclaimed', 'repins', 'config', 'weights',
                     'weighted', 'locality', 'weight_version', 'off', 'back', 'capacity',
                     'ejected', 'eject_why', 'fails', 'ejections', 'failures', 'waiters',
                     'waiting', 'waitseq', 'waitstats', 'clock', 'heal', 'engine',
                     'engine_at', 'escore', 'eextra', 'wscore', 'wextra', 'pinned',
                     'last_error' }) do
  n = n + redis.call('DEL', P .. k)
end
return n
