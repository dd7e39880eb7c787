-- lib/pinning.lua: the tie-break of spread_sessions (uses base, before lib/picking). An
-- acquire script holds this part only while its balancer pins spread_sessions on
-- (redis_router.scripts.OPTIONAL): picking.lua's least_loaded calls pinning() only then.
-- Pinned sessions (spread_sessions, pinned; off: cx.seat is nil and none of this runs). A
-- session thinking between turns holds no lease, so its replica's count does not show it;
-- P.."pinned" (HASH) holds, per replica, the live sticky entries naming it, and under "@"
-- the oldest sticky bucket it counts (I13). The acquire procedure adds to it as it writes
-- entries (lib/acquiring; a batch's changes wait in seat.d for its end), end_session.lua
-- takes ended sessions off, clear_sticky, bump and destroy delete it. A bucket that expires
-- takes its entries with it, so when "@" is not the oldest live bucket (seat.lo) the hash is
-- made again from the live buckets' per-replica counts (P.."stickyn:"..b): once per bucket
-- width (sticky_ttl / 4), O(replicas with sessions x buckets). cx.seat = { lo, d } is
-- set by acquire_all; pinning() makes the procedures on a script's first tie (a Functions
-- library on its first tie ever: they keep a call's state only in its context).
local PINNING = nil -- once per library: the procedures below, which hold no state of a call
local SEATS_MAX = 8 -- tied replicas whose pinned sessions one pick compares

local function pinning()
  if PINNING then return PINNING end
  local function rebuild(cx)
    local seat = cx.seat
    local t, kv = {}, { '@', int(seat.lo) }
    for b = seat.lo, cx.cur do
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
      local t = tonumber(got[1]) ~= seat.lo and rebuild(cx)
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
