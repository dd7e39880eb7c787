-- clear_sticky.lua: forget every sticky session; the next turn of each is balanced anew.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)    ARGV[2]  buckets to search back
-- Returns  { sticky entries forgotten, flat array: server id, in-flight, ... for the pool }
--          (what verl's rebalancing reads: how many sessions were unpinned, and the load).
-- Keeps    I1 (leases and counts untouched), I13 (the pinned-session counts go with them).
-- Uses     lib/base
local width, span = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = math.floor(now_ms() / width)
local n = 0
for b = cur + 1, cur - span, -1 do
  local key = P .. 'sticky:' .. int(b)
  n = n + redis.call('HLEN', key)
  redis.call('DEL', key, P .. 'stickyn:' .. int(b))
end
redis.call('DEL', P .. 'pinned') -- the replicas' pinned sessions (lib/picking)
local loads = {}
for _, zs in ipairs({ 'load', 'draining', 'off' }) do
  for _, v in ipairs(redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES')) do loads[#loads + 1] = v end
end
return { n, loads }
