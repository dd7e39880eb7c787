-- lib/picking.lua: choosing a replica for a new session: least loaded with a fair random
-- tie-break, or rendezvous hashing (uses base).
-- Least in-flight among the replicas that take new sessions; ties broken uniformly by the
-- client-supplied integer `rand` (I4; never the Lua RNG, see DESIGN.md). O(log N).
-- The minimum and how many replicas share it are kept in `LL` for the rest of the script:
-- after each +1 on `load` (reported through load_incremented) the ties shrink by one, so a
-- batch reads the sorted set once per level instead of twice per request. In a batch
-- (LL.batch) a level of at most LEVEL_MAX replicas is also read whole, in rank order, and
-- picks index it instead of asking ZRANGE for each rank. Only acquire_all changes `load`
-- during an acquire, so the cache stays exact.
local LL = {}
local LEVEL_MAX = 128

-- Replicas read by load_peek: a level of up to PEEK - 1 tied replicas (a whole pool of 8, or
-- the least loaded few of a busy pool) is known from that one call.
local PEEK = 9

-- Read the minimum and the replicas at the lowest ranks, in one call. When the lowest level
-- ends within them (or they are the whole pool) its size and members are known, so the pick
-- needs no ZCOUNT and no ZRANGE: a small pool, or a busy one, routes with this call alone.
-- False when no replica takes new sessions.
local function load_peek()
  local top = redis.call('ZRANGE', LOAD, 0, PEEK - 1, 'WITHSCORES')
  local n = #top / 2
  if n == 0 then return false end
  local mins = top[2] -- Redis formats equal scores identically, so strings compare as numbers
  local level, k = { top[1] }, 1
  while k < n and top[2 * k + 2] == mins do
    k = k + 1
    level[k] = top[2 * k - 1]
  end
  LL.min, LL.mins, LL.first = tonumber(mins), mins, top[1]
  if k < n or n < PEEK then
    LL.ties, LL.level = k, level
  else
    LL.ties, LL.level = nil, nil
  end
  return true
end

-- `id`'s count in `load` is now `score` (it was score - 1).
local function load_incremented(score, id)
  if LL.min and tonumber(score) == LL.min + 1 then
    if LL.ties and LL.ties > 1 then
      LL.ties, LL.first = LL.ties - 1, nil
      local level = LL.level
      if level then
        for k = 1, #level do
          if level[k] == id then
            table.remove(level, k)
            break
          end
        end
      end
    else
      LL.min = nil -- the level emptied (or its size is unknown): read it again when needed
    end
  end
end

local function least_loaded(rand)
  if CAPS then return admit().least_relative(rand) end -- relative to capacity (lib/leases)
  if not LL.min and not load_peek() then return nil end
  if not LL.ties then LL.ties = redis.call('ZCOUNT', LOAD, LL.mins, LL.mins) end
  local r = rand % LL.ties
  if LL.level then return LL.level[r + 1] end
  if r == 0 and LL.first then return LL.first end
  if LL.batch and LL.ties <= LEVEL_MAX then
    LL.level = redis.call('ZRANGE', LOAD, '0', int(LL.ties - 1))
    return LL.level[r + 1]
  end
  local rank = int(r)
  return redis.call('ZRANGE', LOAD, rank, rank)[1]
end

-- Rendezvous (highest random weight) hashing over the replicas that take new sessions: a pure
-- function of (request id, set of ids), and removing a replica moves only its own requests (I5).
local function rendezvous(req)
  local best, best_h = nil, nil
  for _, id in ipairs(redis.call('ZRANGE', P .. 'load', 0, -1)) do
    local h = redis.sha1hex(req .. SEP .. id)
    if not best_h or h > best_h then best, best_h = id, h end
  end
  return best
end
