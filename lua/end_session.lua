-- end_session.lua: forget sessions that are over, so new sessions see their replicas free.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)    ARGV[2]  sticky ttl (ms)    ARGV[3]  buckets to search
--          back    ARGV[4..] request ids (sessions) that will not come back
-- Returns  how many of them had a live sticky entry (now forgotten).
-- Keeps    I1, I2 (leases and counts untouched: a lease still running ends as usual), I3 (a
--          later turn of the id is a new session), I13 (its replica's pinned sessions -1).
--          Safe to resend: a second copy finds no entry and changes nothing.
-- Why      A finished session's entry otherwise counts as pinned until it expires
--          (sticky_ttl after its last turn), and new sessions avoid its replica meanwhile.
-- Uses     lib/base
local width, ttl, span = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local cur = math.floor(now / width)
local lo = math.max(cur - span, math.floor((now - ttl) / width)) -- as lib/acquiring
local n = 0
-- Only while spread_sessions keeps the counts (a missing hash is made from the buckets).
local pinned = redis.call('EXISTS', P .. 'pinned') == 1
for i = 4, #ARGV do
  for b = cur, lo, -1 do
    local key = P .. 'sticky:' .. int(b)
    local id = redis.call('HGET', key, ARGV[i])
    if id then
      redis.call('HDEL', key, ARGV[i])
      redis.call('HINCRBY', P .. 'stickyn:' .. int(b), id, '-1')
      if pinned then redis.call('HINCRBY', P .. 'pinned', id, '-1') end
      n = n + 1
      break
    end
  end
end
return n
