-- shard_place.lua: the shard of each session (or GRPO group): where it went, else a new one.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- ARGV[1]  bucket width (ms)    ARGV[2]  record ttl (ms)    ARGV[3]  buckets to search back
--          ARGV[4]  shards to avoid, joined by SEP ("" = none)    ARGV[5..] session (or
--          group) ids
-- Returns  each id's shard (0-based) in order; -1 where no shard has a replica.
-- Keeps    D1; D2: a session's record is in exactly one bucket, moved to the newest on each
--          lookup, so it lives ttl after the last one. A new session goes to the shard with
--          the fewest requests per replica by its last published in-flight total plus the
--          sessions placed there since (new:<s>): the count moves with each placement, so a
--          burst spreads over the shards instead of herding onto the one that looked best.
--          Safe to resend: a second copy finds the records written (and counts nothing).
-- Uses     lib/base
local width, ttl, span = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local k = tonumber(redis.call('HGET', P .. 'layout', 'shards') or '0')
local now = now_ms()
local cur = math.floor(now / width)
local lo = math.max(cur - span, math.floor((now - ttl) / width))
local avoid = {}
for s in string.gmatch(ARGV[4], '[^' .. SEP .. ']+') do avoid[tonumber(s)] = true end
local got = {}
local stats = redis.call('HGETALL', P .. 'shards')
for i = 1, #stats, 2 do got[stats[i]] = tonumber(stats[i + 1]) end
local load, size = {}, {}
for s = 0, k - 1 do
  size[s] = got['n:' .. s] or 0
  load[s] = (got['in:' .. s] or 0) + (got['new:' .. s] or 0)
end
local newest = P .. 'placed:' .. int(cur)
local out, placed, moved = {}, {}, false
for i = 5, #ARGV do
  local id, home = ARGV[i], nil
  for b = cur, lo, -1 do
    local key = P .. 'placed:' .. int(b)
    local s = redis.call('HGET', key, id)
    if s then
      home = tonumber(s)
      if b ~= cur then redis.call('HDEL', key, id) end
      break
    end
  end
  if home and avoid[home] then home = nil end
  if not home then
    local best, score = -1, nil
    for s = 0, k - 1 do
      if size[s] > 0 and not avoid[s] then
        local per = load[s] / size[s]
        if not score or per < score then best, score = s, per end
      end
    end
    if best >= 0 then
      load[best] = load[best] + 1
      placed[best] = (placed[best] or 0) + 1
    end
    home = best
  end
  out[#out + 1] = home
  if home >= 0 then
    redis.call('HSET', newest, id, home)
    moved = true
  end
end
if moved then redis.call('PEXPIREAT', newest, (cur + 1) * width + ttl) end
for s, c in pairs(placed) do redis.call('HINCRBY', P .. 'shards', 'new:' .. s, c) end
return out
