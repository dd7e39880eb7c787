-- bump.lua: a new weight version: every replica's KV cache is stale, so every record of what
-- the replicas hold is dropped at once, for every worker; leases and counts stay exact.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)   ARGV[2]  buckets to search back
-- ARGV[3]  1 = forget the sticky sessions too (their next turn is balanced anew)
-- ARGV[4..] locality keys the caller's routing policy declares (suffixes after P); remembered
--          in P.."locality", so a later bump by any process (the CLI) drops them as well
-- Returns  { the new weight version, locality keys deleted, sticky entries forgotten }
-- Keeps    I1, I2 (leases, counts, holders untouched), I7. Drops the documented locality
--          records: group placements (group:<b>), the prefix-cache index (pc:idx, pc:lru,
--          pc:n), every key in P.."locality" or ARGV, with ARGV[3] = 1 the sticky buckets
--          and the pinned-session counts.
-- Uses     lib/base
local width, span = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = math.floor(now_ms() / width)
local keys = { 'pc:idx', 'pc:lru', 'pc:n' }
for b = cur + 1, cur - span, -1 do keys[#keys + 1] = 'group:' .. int(b) end
for i = 4, #ARGV do
  redis.call('SADD', P .. 'locality', ARGV[i])
end
for _, k in ipairs(redis.call('SMEMBERS', P .. 'locality')) do keys[#keys + 1] = k end
local deleted = 0
for _, k in ipairs(keys) do deleted = deleted + redis.call('UNLINK', P .. k) end
local sticky = 0
if ARGV[3] == '1' then
  for b = cur + 1, cur - span, -1 do
    local key = P .. 'sticky:' .. int(b)
    sticky = sticky + redis.call('HLEN', key)
    redis.call('DEL', key, P .. 'stickyn:' .. int(b))
  end
  redis.call('DEL', P .. 'pinned') -- the replicas' pinned sessions (lib/picking)
end
return { redis.call('INCR', P .. 'weight_version'), deleted, sticky }
