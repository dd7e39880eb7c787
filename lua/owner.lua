-- owner.lua: which replica serves a request now (for a targeted abort), without a scan.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  request id    ARGV[2]  sticky bucket width (ms)    ARGV[3]  buckets to search back
-- Returns  the replica holding a live lease of the request, or false when none does. The
--          session's sticky entry names the replica and its request index entry confirms a
--          lease there (a few lookups); only when that fails (no entry: cleared, expired, or a
--          lease still running where the session was pinned before) is each replica of the
--          pool probed, one HEXISTS each.
-- Keeps    read only.
-- Uses     lib/base
local req, width, span = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = math.floor(now_ms() / width)
local pinned
for b = cur, cur - span, -1 do
  pinned = redis.call('HGET', P .. 'sticky:' .. int(b), req)
  if pinned then break end
end
if pinned and redis.call('HEXISTS', P .. 'byreq', pinned .. SEP .. req) == 1 then return pinned end
for _, zs in ipairs({ 'load', 'draining', 'off' }) do
  for _, id in ipairs(redis.call('ZRANGE', P .. zs, 0, -1)) do
    if redis.call('HEXISTS', P .. 'byreq', id .. SEP .. req) == 1 then return id end
  end
end
return false
