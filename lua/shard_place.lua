-- shard_place.lua: the shard of each session (or GRPO group): where it went, else a new one.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- ARGV[1]  a random integer (ties between shards)    ARGV[2]  shards to avoid, joined by SEP
--          ("" = none)    ARGV[3..] session (or group) ids
-- Returns  each id's shard (0-based) in order; -1 where no shard has a replica.
-- Keeps    D1; D2: a session's record is in exactly one generation, `placed` (since the last
--          rotation, which shard_totals makes) or `placed:old` (the one before); a lookup
--          moves it to `placed`, and a rotation drops `placed:old`, so a record lives at least
--          a generation after its last lookup (about two, while the pool routes). A new
--          session goes to the shard with the fewest requests per replica by its last
--          published in-flight total plus the sessions placed there since (new:<s>): the count
--          moves with each placement, so a burst spreads over the shards instead of herding
--          onto the one that looked best.
--          Safe to resend: a second copy finds the records written (and counts nothing).
-- Why      A known session's lookup is one HGET and writes nothing; a new one's is five
--          commands. Shards are read from P.."shards" (a shard without replicas, or not yet
--          in the layout, has no n:<s> there), so the call reads nothing else.
-- Uses     lib/base
local NEW, OLD = P .. 'placed', P .. 'placed:old'
local avoid = {}
local rand = tonumber(ARGV[1])
if ARGV[2] ~= '' then
  for s in string.gmatch(ARGV[2], '[^' .. SEP .. ']+') do avoid[s] = true end
end
local load, size, shards, top = nil, {}, {}, 1
local out, placed = {}, {}
-- The shard for a session without a record: the fewest requests per replica (stats read once
-- per call, and only when some session needs placing); among equals, the first from a
-- random shard on (each placement of the call one further), so sessions that find the pool
-- idle spread over the shards rather than all going to shard 0.
local function choose()
  if not load then
    load = {}
    local got = {}
    local stats = redis.call('HGETALL', P .. 'shards')
    for j = 1, #stats, 2 do got[stats[j]] = stats[j + 1] end
    for field, n in pairs(got) do
      if string.sub(field, 1, 2) == 'n:' and n ~= '0' then
        local s = string.sub(field, 3)
        shards[#shards + 1] = s
        top = math.max(top, tonumber(s) + 1)
        load[s] = (tonumber(got['in:' .. s]) or 0) + (tonumber(got['new:' .. s]) or 0)
        load[s] = load[s] / tonumber(n) -- requests per replica
        size[s] = tonumber(n)
      end
    end
  end
  local best, score, turn = nil, nil, nil
  for _, s in ipairs(shards) do
    if not avoid[s] then
      local per, t = load[s], (tonumber(s) - rand) % top
      if not score or per < score or (per == score and t < turn) then
        best, score, turn = s, per, t
      end
    end
  end
  rand = rand + 1
  if not best then return -1 end
  load[best] = load[best] + 1 / size[best]
  placed[best] = (placed[best] or 0) + 1
  return tonumber(best)
end
for i = 3, #ARGV do
  local id = ARGV[i]
  local where = NEW
  local home = redis.call('HGET', NEW, id)
  if not home then
    where = OLD
    home = redis.call('HGET', OLD, id)
    if home then redis.call('HDEL', OLD, id) end
  end
  if home and avoid[home] then home = nil end -- its shard refused it: placed anew
  if home then
    if where == OLD then redis.call('HSET', NEW, id, home) end
    out[#out + 1] = tonumber(home)
  else
    home = choose()
    if home >= 0 then redis.call('HSET', NEW, id, home) end
    out[#out + 1] = home
  end
end
for s, c in pairs(placed) do redis.call('HINCRBY', P .. 'shards', 'new:' .. s, c) end
return out
