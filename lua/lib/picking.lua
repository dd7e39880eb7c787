-- lib/picking.lua: choosing a replica for a new session: least loaded with a fair random
-- tie-break, or rendezvous hashing (uses base, scoring: the loader prepends lib/scoring).
-- Least in-flight among the replicas that take new sessions; ties broken uniformly by the
-- client-supplied integer `rand` (I4; never the Lua RNG, see DESIGN.md). O(log N).
-- The minimum and how many replicas share it are kept in `LL` for the rest of the script:
-- after each +1 on `load` (reported through load_incremented) the ties shrink by one, so a
-- batch reads the sorted set once per level instead of twice per request. In a batch
-- (LL.batch) a level of at most LEVEL_MAX replicas is also read whole, in rank order, and
-- picks index it instead of asking ZRANGE for each rank. Only acquire_all changes `load`
-- during an acquire, so the cache stays exact.
local LL = {} -- per call
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

-- Pinned sessions (spread_sessions, pinned; off: SEAT is nil and none of this runs). A
-- session thinking between turns holds no lease, so its replica's count does not show it;
-- P.."pinned" (HASH) holds, per replica, the live sticky entries naming it, and under "@"
-- the oldest sticky bucket it counts (I13). The acquire procedure adds to it as it writes
-- entries (lib/acquiring; a batch's changes wait in SEAT.d for its end), end_session.lua
-- takes ended sessions off, clear_sticky, bump and destroy delete it. A bucket that expires
-- takes its entries with it, so when "@" is not the oldest live bucket (SEAT.lo) the hash is
-- made again from the live buckets' per-replica counts (P.."stickyn:"..b): once per bucket
-- width (sticky_ttl / 4), O(replicas with sessions x buckets). SEAT = { lo, cur, d } is set by
-- acquire_all; pinning() makes the procedures on a script's first tie (a Functions library
-- on its first tie ever: they keep no state of a call but in SEAT and LL).
local SEAT = nil -- per call
local PINNING = nil -- once per library: the procedures below, which hold no state of a call
local SEATS_MAX = 8 -- tied replicas whose pinned sessions one pick compares

local function pinning()
  if PINNING then return PINNING end
  local function rebuild()
    local t, kv = {}, { '@', int(SEAT.lo) }
    for b = SEAT.lo, SEAT.cur do
      local flat = redis.call('HGETALL', P .. 'stickyn:' .. int(b))
      for k = 1, #flat, 2 do t[flat[k]] = (t[flat[k]] or 0) + tonumber(flat[k + 1]) end
    end
    redis.call('DEL', P .. 'pinned')
    for id, n in pairs(t) do
      if n ~= 0 then kv[#kv + 1], kv[#kv + 2] = id, int(n) end
    end
    flat_call('HSET', P .. 'pinned', kv)
    return t
  end
  -- Among `ties` tied replicas, those the tie-break compares: all of them up to SEATS_MAX,
  -- else SEATS_MAX in a row from rank `r` (wrapping), so a pick stays O(log N).
  local function tied(ties, r)
    local level, k = LL.level, math.min(ties, SEATS_MAX)
    if level and ties <= SEATS_MAX then return level end
    local out = {}
    if level then
      for j = 0, k - 1 do out[j + 1] = level[(r + j) % ties + 1] end
      return out
    end
    local last = r + k - 1
    out = redis.call('ZRANGE', LOAD, int(r), int(math.min(last, ties - 1)))
    if last >= ties then
      for _, id in ipairs(redis.call('ZRANGE', LOAD, '0', int(last - ties))) do
        out[#out + 1] = id
      end
    end
    return out
  end
  PINNING = {
    -- Of `ties` tied replicas, one with the fewest pinned sessions, uniformly at random among
    -- those; `rand` (the client's 48-bit integer) gives the window's start (rand % ties) and,
    -- independently, the pick among equals (its quotient).
    fewest = function(ties, rand)
      local cands = tied(ties, rand % ties)
      local got = redis.call('HMGET', P .. 'pinned', '@', unpack(cands))
      local t = tonumber(got[1]) ~= SEAT.lo and rebuild()
      local best, nb, low, d = {}, 0, nil, SEAT.d
      for k, id in ipairs(cands) do
        local n = (t and (t[id] or 0) or tonumber(got[k + 1]) or 0) + (d[id] or 0)
        if not low or n < low then
          low, nb = n, 1
          best[1] = id
        elseif n == low then
          nb = nb + 1
          best[nb] = id
        end
      end
      return best[math.floor(rand / ties) % nb + 1]
    end,
  }
  return PINNING
end

local function least_loaded(rand)
  if ENGINE then return scoring().least(rand) end -- engine-aware (lib/scoring)
  if CAPS then return admit().least_relative(rand) end -- relative to capacity (lib/leases)
  if not LL.min and not load_peek() then return nil end
  if not LL.ties then LL.ties = redis.call('ZCOUNT', LOAD, LL.mins, LL.mins) end
  if SEAT and LL.ties > 1 then return pinning().fewest(LL.ties, rand) end
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
