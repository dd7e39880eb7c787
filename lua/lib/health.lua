-- lib/health.lua: outcomes of requests and health probes, and ejection (uses base,
-- admission).
-- Envoy's outlier detection, shared by every process: `after` failures in a row eject a
-- replica for base * (ejections in a row) ms, at most max ms, while at most `share` of the
-- pool is ejected; a success ends the streak. Streaks and the last error are kept with
-- ejection off too, so status shows a failing replica as failing. The settings are pinned in
-- P.."config" field `ejection` ("after base_ms max_ms share mode"; "" = off): a failure reads
-- them, a success never (the release's operation id says whether ejection is on, see
-- released()).
--   P.."fails"      HASH  id -> failures in a row, counted with ejection on or off. On, a
--                         success ("+") deletes it. Off, a release makes no health call: the
--                         streak holds while no lease on id ended, other than by a failure or
--                         a reclaim, since its last failure (the mark in P.."last_error"), so a
--                         success ends it without a write (so does a close)
--   P.."last_error" HASH  id -> at_ms..SEP..mark..SEP..why: the last failure reported for id,
--                         and the mark then (mark_of(id); 0 with ejection on, where none is read)
--   P.."ejected"    ZSET  id -> ejected until (ms); P.."eject_why" HASH id -> why
--   P.."ejections"  HASH  id -> ejections in a row, id..SEP.."t" -> when the last one ends;
--                         a replica not ejected for `max` ms starts again at base
--   P.."failures"   HASH  id -> failures reported (a counter, for status)
-- The procedures take the call's context (lib/base.lua) first: cx.streaks is whether P.."fails"
-- exists, read at most once per call.
local MAX_WHY = 200 -- bytes of a failure's reason kept

-- The leases on id that ended other than by a reclaim (acquired, less those held and those
-- reclaimed): a success moves it without a health write, so a failure streak can tell that
-- a request succeeded since its last failure. status.lua reads the same three counters.
local function mark_of(id)
  return tonumber(redis.call('HGET', P .. 'acquires', id) or 0)
    - redis.call('ZCARD', P .. 'held:' .. id)
    - tonumber(redis.call('HGET', P .. 'reclaimed', id) or 0)
end
local HEALTH = nil -- once per library: the procedures below, which hold no state of a call

-- The procedures, made on first use (as lib/leases.lua's admit): a release that reports
-- nothing makes none of them.
local function health()
  if HEALTH then return HEALTH end
  local H = {}

  function H.settings()
    local s = redis.call('HGET', P .. 'config', 'ejection')
    if not s or s == '' then return nil end
    local after, base, max, share = string.match(s, '^(%S+) (%S+) (%S+) (%S+)')
    return tonumber(after), tonumber(base), tonumber(max), tonumber(share)
  end

  -- Eject id (a pool member) until now + its ejection time, unless it is ejected already or
  -- one more ejection would exceed the share of the pool. Returns the end time, or nil.
  function H.eject(id, why, now, base, max, share)
    if redis.call('ZSCORE', P .. 'ejected', id) or redis.call('HEXISTS', P .. 'servers', id) == 0
    then
      return nil
    end
    admit().restore_due(now) -- an ejection whose time is up no longer counts toward the share
    local pool = redis.call('HLEN', P .. 'servers')
    if redis.call('ZCARD', P .. 'ejected') + 1 > math.floor(pool * share + 1e-9) then return nil end
    local k = tonumber(redis.call('HGET', P .. 'ejections', id) or 0)
    local last = tonumber(redis.call('HGET', P .. 'ejections', id .. SEP .. 't') or 0)
    if now - last > max then k = 0 end
    k = k + 1
    local til = now + math.min(base * k, max)
    redis.call('HSET', P .. 'ejections', id, int(k), id .. SEP .. 't', int(til))
    redis.call('ZADD', P .. 'ejected', int(til), id)
    redis.call('HSET', P .. 'eject_why', id, why)
    admit().take_off(id)
    return til
  end

  -- A request to (or a probe of) id failed: count it toward the streak (ejection on or off),
  -- keep why (`err`) as id's last error, and eject id when the streak reaches `after`.
  -- `ended`: 1 when the failure ended a lease (a failed request), 0 for a probe.
  function H.failed(cx, id, why, now, ended, err)
    redis.call('HINCRBY', P .. 'failures', id, '1')
    local after, base, max, share = H.settings()
    local mark, n = 0, 1 -- the mark is read only with ejection off
    if after then -- a success ends the streak itself ("+")
      n = redis.call('HINCRBY', P .. 'fails', id, '1')
    else
      mark = mark_of(id)
      local last = redis.call('HGET', P .. 'last_error', id)
      if last and tonumber(string.match(last, '^%d+' .. SEP .. '(%-?%d+)')) == mark - ended then
        n = redis.call('HINCRBY', P .. 'fails', id, '1')
      else
        redis.call('HSET', P .. 'fails', id, '1') -- a success (or a close) came in between
      end
    end
    redis.call('HSET', P .. 'last_error', id,
      int(now) .. SEP .. int(mark) .. SEP .. string.sub(err, 1, MAX_WHY))
    cx.streaks = true
    if after and n >= after
      and H.eject(id, int(n) .. ' ' .. why .. ' in a row', now, base, max, share) then
      redis.call('HDEL', P .. 'fails', id)
    end
  end

  -- A request to (or a probe of) id succeeded: its streak, if any, ends.
  function H.succeeded(cx, id)
    local streaks = cx.streaks
    if streaks == nil then
      streaks = redis.call('EXISTS', P .. 'fails') == 1
      cx.streaks = streaks
    end
    if streaks then redis.call('HDEL', P .. 'fails', id) end
  end

  HEALTH = H
  return H
end

-- A lease on id was released by operation `op`: its request failed when op starts with "!",
-- succeeded with ejection on when it starts with "+" (its streak ends); any other release is
-- a success with ejection off (every process pins it): no call, its lease's end moves the
-- replica's mark past its streak's (mark_of).
local function released(cx, id, op)
  local mark = id and string.byte(op)
  if mark == 33 then
    health().failed(cx, id, 'failed requests', now_ms(), 1, 'request failed')
  elseif mark == 43 then
    health().succeeded(cx, id)
  end
end
