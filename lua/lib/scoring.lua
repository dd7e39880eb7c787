-- lib/scoring.lua: engine-aware least loaded, opt-in (uses base).
-- A replica's score is its lease count plus what its engine reports beyond it, from its latest
-- fresh report (P.."engine", written by `redis-router load` through engine_report.lua):
--   extra = max(0, running + waiting - leases_at) + kv_weight * kv_usage (+ PAST while the
--           KV usage is at or above the ceiling)
-- where leases_at is the replica's lease count when the report was written: the requests the
-- engine holds beyond this library's leases (sent around the router, or still queued behind a
-- slow replica's work) count as load, and the leases taken since the report keep the score
-- fresh between scrapes. A report older than the ttl counts for nothing (counts alone).
-- The setting is pinned in P.."config" field "engine": "<ttl_ms> <kv_weight> <ceiling permille
-- or ->", "" = off; an acquire sends it among its settings (lib/base.lua config()).
-- Keys: P.."eextra" HASH id -> the extra applied (absent = 0); P.."escore" ZSET id -> count +
-- extra, for every replica of the pool (I12, while the key exists: the first engine-aware
-- acquire builds it, every count change, report and stale report keeps it).
-- least_tokens ranks tokens in flight: its scores (P.."wscore", beside P.."weighted") add the
-- same extra valued in tokens (P.."wextra"): the extra times the replica's tokens per lease at
-- the report (else the pool's; 1 when no lease is weighed). I12 holds for them as for escore.
-- The procedures are made on the first engine-aware use (scoring()), so a call on counts
-- alone makes none of them. They keep a call's state in its context (lib/base.lua), never in
-- upvalues of their own, so a Functions library makes them once and every later call reuses
-- them (SCORING is kept across calls there; under EVALSHA each call starts without them):
-- cx.engine { ttl = ms, w = kv weight, ceil = permille or nil } while engine-aware, and the
-- call's caches: cx.scored / cx.wscored (P.."escore" / P.."wscore" known to exist),
-- cx.extras (every report's extra applied), cx.pool_tpl (tokens per lease over the pool).
-- Added to a replica at or above the KV ceiling: every replica below it scores lower.
local PAST = 1000000000
-- Replicas read at once when picking; a level that fills them is read whole.
local EPEEK = 16
local SCORING = nil -- once per library: the procedures, which hold no state of a call

local function scoring()
  if SCORING then return SCORING end

  -- The extra of a report record "<at> <running> <waiting> <kv permille> <leases_at>" (0 when
  -- stale at `now`).
  local function engine_extra(rec, setting, now)
    if not rec then return 0 end
    local at, running, waiting, kv, leases = string.match(rec, '^(%d+) (%d+) (%d+) (%-?%d+) (%d+)')
    if not at or now - tonumber(at) > setting.ttl then return 0 end
    local e = math.max(0, tonumber(running) + tonumber(waiting) - tonumber(leases))
    kv = tonumber(kv)
    if kv >= 0 then
      e = e + setting.w * kv / 1000
      if setting.ceil and kv >= setting.ceil then e = e + PAST end
    end
    return e
  end

  -- True when id's fresh report shows requests waiting in its engine, or KV usage at or above
  -- the ceiling: a sticky session may then move off it (with an affinity margin).
  local function engine_pressed(cx, id)
    local rec = redis.call('HGET', P .. 'engine', id)
    if not rec then return false end
    local at, waiting, kv = string.match(rec, '^(%d+) %d+ (%d+) (%-?%d+)')
    local setting = cx.engine
    if not at or cx.now - tonumber(at) > setting.ttl then return false end
    return tonumber(waiting) > 0 or (setting.ceil ~= nil and tonumber(kv) >= setting.ceil)
  end

  -- Tokens per lease: id's own (its weighed leases' tokens over its count), else the pool's, else
  -- 1 (read once per call).
  local function tokens_per_lease(cx, id)
    local w = tonumber(redis.call('ZSCORE', P .. 'weighted', id)) or 0
    local c = tonumber(redis.call('ZSCORE', LOAD, id) or redis.call('ZSCORE', P .. 'draining', id)
      or redis.call('ZSCORE', P .. 'off', id)) or 0
    if w > 0 and c > 0 then return w / c end
    if not cx.pool_tpl then
      local ws, cs = 0, 0
      for _, zs in ipairs({ 'load', 'draining', 'off' }) do
        local rows = redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES')
        for k = 2, #rows, 2 do cs = cs + tonumber(rows[k]) end
      end
      local rows = redis.call('ZRANGE', P .. 'weighted', 0, -1, 'WITHSCORES')
      for k = 2, #rows, 2 do ws = ws + tonumber(rows[k]) end
      cx.pool_tpl = (ws > 0 and cs > 0) and ws / cs or 1
    end
    return cx.pool_tpl
  end

  -- Set a hash field to `v` (absent when 0) and move the score in `zs` by the change, while
  -- `zs` exists (ZADD XX: never creates it).
  local function move_extra(hash, zs, id, v)
    local old = tonumber(redis.call('HGET', hash, id)) or 0
    if v == old then return end
    if v == 0 then
      redis.call('HDEL', hash, id)
    else
      redis.call('HSET', hash, id, tostring(v))
    end
    redis.call('ZADD', zs, 'XX', 'INCR', tostring(v - old), id)
  end

  -- Apply `e` (requests) as id's extra, for least loaded and, valued in tokens, least_tokens.
  local function set_extra(cx, id, e)
    move_extra(P .. 'eextra', P .. 'escore', id, e)
    move_extra(P .. 'wextra', P .. 'wscore', id, e == 0 and 0 or e * tokens_per_lease(cx, id))
  end

  -- Every replica's extra from its report, once per call: before scores are made (the first
  -- engine-aware pick, or after a key was lost), as reports written before scoring was
  -- pinned set none.
  local function extras_from_reports(cx)
    if cx.extras then return end
    cx.extras = true
    for _, id in ipairs(redis.call('HKEYS', P .. 'servers')) do
      set_extra(cx, id, engine_extra(redis.call('HGET', P .. 'engine', id), cx.engine, cx.now))
    end
  end

  -- Make the sorted set `zs` of base + extra per replica, from `rows` (id, base, ...) and the
  -- extras in `hash`.
  local function build(zs, rows, hash)
    local flat = {}
    for k = 1, #rows, 2 do
      local e = tonumber(redis.call('HGET', hash, rows[k])) or 0
      flat[#flat + 1], flat[#flat + 2] = tostring(tonumber(rows[k + 1]) + e), rows[k]
    end
    if #flat > 0 then flat_call('ZADD', zs, flat) end
  end

  -- Before an engine-aware acquire: reports gone stale count for nothing.
  local function engine_ready(cx)
    local stale = redis.call('ZRANGEBYSCORE', P .. 'engine_at', '-inf',
      int(cx.now - cx.engine.ttl - 1), 'LIMIT', '0', '16')
    for _, id in ipairs(stale) do
      set_extra(cx, id, 0)
      redis.call('ZREM', P .. 'engine_at', id)
    end
  end

  -- Before reading scores: they exist (the first engine-aware pick builds them; until then the
  -- counts' increments, ZADD XX, leave them unmade).
  local function scored(cx)
    if cx.scored then return end
    cx.scored = true
    if redis.call('EXISTS', P .. 'escore') == 1 then return end
    extras_from_reports(cx)
    for _, zs in ipairs({ 'load', 'draining', 'off' }) do
      build(P .. 'escore', redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES'), P .. 'eextra')
    end
  end

  -- least_tokens' scores: tokens in flight plus the extra in tokens, made from P.."weighted" the
  -- first time an engine-aware least_tokens picks (or after the key was lost).
  local function wscored(cx)
    if cx.wscored then return end
    cx.wscored = true
    if redis.call('EXISTS', P .. 'wscore') == 1 then return end
    extras_from_reports(cx)
    build(P .. 'wscore', redis.call('ZRANGE', P .. 'weighted', 0, -1, 'WITHSCORES'), P .. 'wextra')
  end

  -- The lowest score in `zs` (escore or wscore) among the replicas taking new sessions (in
  -- P.."load") and those that have it; nil when none takes new sessions. O(log N) while few
  -- replicas drain or are off.
  local function level_of(zs)
    local rows = redis.call('ZRANGE', zs, 0, EPEEK - 1, 'WITHSCORES')
    local best, ties, full = nil, {}, #rows == 2 * EPEEK
    for k = 1, #rows, 2 do
      local s = rows[k + 1]
      if best and s ~= best then
        full = false
        break
      end
      if redis.call('ZSCORE', LOAD, rows[k]) then
        best = best or s
        ties[#ties + 1] = rows[k]
      end
    end
    if best and not full then return tonumber(best), ties end
    -- The level fills what was read, or nothing read takes new sessions: read further.
    rows = redis.call('ZRANGE', zs, 0, -1, 'WITHSCORES')
    best, ties = nil, {}
    for k = 1, #rows, 2 do
      local s = rows[k + 1]
      if best and s ~= best then break end
      if redis.call('ZSCORE', LOAD, rows[k]) then
        best = best or s
        ties[#ties + 1] = rows[k]
      end
    end
    return tonumber(best), ties
  end

  local function engine_level(cx)
    scored(cx)
    return level_of(P .. 'escore')
  end

  -- A replica of least score in `zs`, uniformly among ties (rand: the client's integer);
  -- `ensure` makes the scores when they do not exist yet. While nothing drains, is off or is
  -- excluded (lib/acquiring), every scored replica takes new sessions: the lowest level is
  -- counted and indexed as picking.lua does with counts, three calls at most.
  local function least_of(cx, rand, zs, ensure)
    if not cx.excl and redis.call('EXISTS', P .. 'draining', P .. 'off') == 0 then
      local top = redis.call('ZRANGE', zs, 0, 0, 'WITHSCORES')
      if not top[1] then -- none yet: made from the pool, then read again
        ensure(cx)
        top = redis.call('ZRANGE', zs, 0, 0, 'WITHSCORES')
      end
      if not top[1] then return nil end
      local r = rand % redis.call('ZCOUNT', zs, top[2], top[2])
      if r == 0 then return top[1] end
      local rank = int(r)
      return redis.call('ZRANGE', zs, rank, rank)[1]
    end
    ensure(cx)
    local _, ties = level_of(zs)
    if #ties == 0 then return nil end
    return ties[rand % #ties + 1]
  end

  local function least_engine(cx, rand) return least_of(cx, rand, P .. 'escore', scored) end
  -- least_tokens, engine-aware: fewest tokens in flight plus the engines' extra in tokens.
  local function least_engine_tokens(cx, rand)
    return least_of(cx, rand, P .. 'wscore', wscored)
  end

  SCORING = {
    setting = engine_setting, extra = engine_extra, pressed = engine_pressed,
    set_extra = set_extra, ready = engine_ready, level = engine_level, least = least_engine,
    least_tokens = least_engine_tokens,
  }
  return SCORING
end
