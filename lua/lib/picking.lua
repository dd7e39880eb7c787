-- lib/picking.lua: choosing a replica for a new session: least loaded with a fair random
-- tie-break, or rendezvous hashing (uses base; lib/scoring and lib/pinning, which the loader
-- puts before it while engine scoring or spread_sessions is on: scripts.OPTIONAL).
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
