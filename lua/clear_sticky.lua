-- clear_sticky.lua: forget every sticky session; the next turn of each is balanced anew.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)    ARGV[2]  buckets to search back
-- Returns  how many bucket keys were deleted.
-- Keeps    I1 (leases and counts untouched).
local width, span = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = math.floor(now_ms() / width)
local n = 0
for b = cur + 1, cur - span, -1 do
  n = n + redis.call('DEL', P .. 'sticky:' .. b, P .. 'stickyn:' .. b)
end
return n
