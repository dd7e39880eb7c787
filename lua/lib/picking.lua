-- lib/picking.lua: choosing a replica for a new session: least loaded with a fair random
-- tie-break, or rendezvous hashing (uses base, scoring: the loader prepends lib/scoring).
-- Least in-flight among the replicas that take new sessions; ties broken uniformly by the
-- client-supplied integer `rand` (I4; never the Lua RNG, see DESIGN.md). O(log N).
-- The minimum and how many replicas share it are kept in the call's `cx.ll` for the rest of
-- the script: after each +1 on `load` (reported through load_incremented) the ties shrink by
-- one, so a batch reads the sorted set once per level instead of twice per request. In a
-- batch (ll.batch) a level of at most LEVEL_MAX replicas is also read whole, in rank order,
-- and picks index it instead of asking ZRANGE for each rank. Only acquire_all changes `load`
-- during an acquire, so the cache stays exact.
local LEVEL_MAX = 128

-- Replicas read by load_peek: a level of up to PEEK - 1 tied replicas (a whole pool of 8, or
-- the least loaded few of a busy pool) is known from that one call.
local PEEK = 9

-- Read the minimum and the replicas at the lowest ranks, in one call. When the lowest level
-- ends within them (or they are the whole pool) its size and members are known, so the pick
-- needs no ZCOUNT and no ZRANGE: a small pool, or a busy one, routes with this call alone.
-- False when no replica takes new sessions.
local function load_peek(cx)
  local top = redis.call('ZRANGE', LOAD, 0, PEEK - 1, 'WITHSCORES')
  local n = #top / 2
  if n == 0 then return false end
  local mins = top[2] -- Redis formats equal scores identically, so strings compare as numbers
  local level, k = { top[1] }, 1
  while k < n and top[2 * k + 2] == mins do
    k = k + 1
    level[k] = top[2 * k - 1]
  end
  local ll = cx.ll
  ll.min, ll.mins, ll.first = tonumber(mins), mins, top[1]
  if k < n or n < PEEK then
    ll.ties, ll.level = k, level
  else
    ll.ties, ll.level = nil, nil
  end
  return true
end

-- `id`'s count in `load` is now `score` (it was score - 1).
local function load_incremented(cx, score, id)
  local ll = cx.ll
  if ll.min and tonumber(score) == ll.min + 1 then
    if ll.ties and ll.ties > 1 then
      ll.ties, ll.first = ll.ties - 1, nil
      local level = ll.level
      if level then
        for k = 1, #level do
          if level[k] == id then
            table.remove(level, k)
            break
          end
        end
      end
    else
      ll.min = nil -- the level emptied (or its size is unknown): read it again when needed
    end
  end
end

-- Pinned sessions (spread_sessions, pinned; off: cx.seat is nil and none of this runs). A
-- session thinking between turns holds no lease, so its replica's count does not show it;
-- P.."pinned" (HASH) holds, per replica, the live sticky entries naming it, and under "@"
-- the oldest sticky bucket it counts (I13). The acquire procedure adds to it as it writes
-- entries (lib/acquiring; a batch's changes wait in seat.d for its end), end_session.lua
-- takes ended sessions off, clear_sticky, bump and destroy delete it. A bucket that expires
-- takes its entries with it, so when "@" is not the oldest live bucket (seat.lo) the hash is
-- made again from the live buckets' per-replica counts (P.."stickyn:"..b): once per bucket
-- width (sticky_ttl / 4), O(replicas with sessions x buckets). cx.seat = { lo, cur, d } is
-- set by acquire_all; pinning() makes the procedures on a script's first tie (a Functions
-- library on its first tie ever: they keep a call's state only in its context).
local PINNING = nil -- once per library: the procedures below, which hold no state of a call
local SEATS_MAX = 8 -- tied replicas whose pinned sessions one pick compares

local function pinning()
  if PINNING then return PINNING end
  local function rebuild(seat)
    local t, kv = {}, { '@', int(seat.lo) }
    for b = seat.lo, seat.cur do
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
  local function tied(cx, ties, r)
    local level, k = cx.ll.level, math.min(ties, SEATS_MAX)
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
    fewest = function(cx, ties, rand)
      local seat = cx.seat
      local cands = tied(cx, ties, rand % ties)
      local got = redis.call('HMGET', P .. 'pinned', '@', unpack(cands))
      local t = tonumber(got[1]) ~= seat.lo and rebuild(seat)
      local best, nb, low, d = {}, 0, nil, seat.d
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

-- The running acquire's context, for least_loaded(rand): the form a policy's choose(i) was
-- first written against, before procedures took the context (acquire_all sets it).
local CALL = nil -- per call

-- A replica for a new session: least loaded (engine-aware or relative to capacity when those
-- are on), ties broken by `rand`, the client's integer; nil when none takes new sessions.
-- A policy calls it as least_loaded(cx, rand) with the context its choose(i, cx) receives.
local function least_loaded(cx, rand)
  if rand == nil then cx, rand = CALL, cx end
  if cx.engine then return scoring().least(cx, rand) end -- engine-aware (lib/scoring)
  if cx.caps then return admit().least_relative(rand) end -- relative to capacity (lib/admission)
  local ll = cx.ll
  if not ll.min and not load_peek(cx) then return nil end
  if not ll.ties then ll.ties = redis.call('ZCOUNT', LOAD, ll.mins, ll.mins) end
  if cx.seat and ll.ties > 1 then return pinning().fewest(cx, ll.ties, rand) end
  local r = rand % ll.ties
  if ll.level then return ll.level[r + 1] end
  if r == 0 and ll.first then return ll.first end
  if ll.batch and ll.ties <= LEVEL_MAX then
    ll.level = redis.call('ZRANGE', LOAD, '0', int(ll.ties - 1))
    return ll.level[r + 1]
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
