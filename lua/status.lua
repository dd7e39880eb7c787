-- status.lua: one consistent snapshot of the balancer, for get_status and operators.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)    ARGV[2]  buckets to search back
-- Keeps    read only.
-- Returns  one JSON object, by name (a field that is absent is none):
--          { sessions (sticky sessions in all), now (ms), replicas, holders, waiting } where
--          replicas is a list with every replica (full or ejected ones too) of
--          { id, inflight, draining (true/false), leases, sticky (sessions), acquires,
--            sticky_hits, reclaimed, metadata (its JSON), repins (sticky sessions re-pinned
--            away from it by the affinity margin), capacity, ejected_until (ms), ejected_why,
--            streak (failures in a row; with ejection off, 0 once a lease on it ended
--            otherwise: lib/health.lua), failures (reported), ejections (in a row), engine
--            (its engine report, lib/engine.lua), last_error, last_error_at (ms) },
--          holders is { live (heard within their lease ttl), dead, awaiting_reclaim (leases
--            of dead holders), unheard (deadline passed during a gap in heartbeats: on
--            probation), probation_ms (what the probation has left), unheard_leases,
--            unheard_ms (since the longest unheard one was last heard), probation_running
--            (recorded; false: the next heartbeat, acquire or reap starts it) },
--          waiting is { now (waiting), oldest_ms (the first one's wait so far), served (after
--            waiting), waited_ms (their total wait), max_ms, timed_out (given up), abandoned
--            (their process died) }
-- Uses     lib/base
local width, span = tonumber(ARGV[1]), tonumber(ARGV[2])
local function num(v) return v and tonumber(v) or nil end
local now = now_ms()
local cur = math.floor(now / width)
local buckets, sessions = {}, 0
for b = cur, cur - span, -1 do
  if redis.call('EXISTS', P .. 'sticky:' .. b) == 1 then
    buckets[#buckets + 1] = b
    sessions = sessions + redis.call('HLEN', P .. 'sticky:' .. b)
  end
end
local rows = {}
-- With ejection on, a success deletes its replica's streak; off, the mark tells it ended.
local exact = (redis.call('HGET', P .. 'config', 'ejection') or '') ~= ''
for d, zs in ipairs({ 'load', 'draining', 'off' }) do
  local ids = redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES')
  for i = 1, #ids, 2 do
    local id = ids[i]
    local draining = d - 1
    if d == 3 then draining = redis.call('HGET', P .. 'back', id) == 'draining' and 1 or 0 end
    local sticky = 0
    for _, b in ipairs(buckets) do
      sticky = sticky + tonumber(redis.call('HGET', P .. 'stickyn:' .. b, id) or 0)
    end
    local held = redis.call('ZCARD', P .. 'held:' .. id)
    local acquires = tonumber(redis.call('HGET', P .. 'acquires', id) or 0)
    local reclaimed = tonumber(redis.call('HGET', P .. 'reclaimed', id) or 0)
    -- The last failure, and whether its streak still holds (ejection off): no lease on id
    -- ended since, other than by a failure or a reclaim (lib/health.lua mark_of).
    local last = redis.call('HGET', P .. 'last_error', id)
    local at, mark, why
    if last then
      at, mark, why = string.match(last, '^(%d+)' .. SEP .. '(%-?%d+)' .. SEP .. '(.*)$')
    end
    local streak = 0
    if exact or (mark and tonumber(mark) == acquires - held - reclaimed) then
      streak = tonumber(redis.call('HGET', P .. 'fails', id) or 0)
    end
    rows[#rows + 1] = {
      id = id, inflight = tonumber(ids[i + 1]), draining = draining == 1, leases = held,
      sticky = sticky, acquires = acquires,
      sticky_hits = tonumber(redis.call('HGET', P .. 'sticky_hits', id) or 0),
      reclaimed = reclaimed,
      metadata = redis.call('HGET', P .. 'servers', id) or nil,
      repins = tonumber(redis.call('HGET', P .. 'repins', id) or 0),
      capacity = num(redis.call('HGET', P .. 'capacity', id)),
      ejected_until = num(redis.call('ZSCORE', P .. 'ejected', id)),
      ejected_why = redis.call('HGET', P .. 'eject_why', id) or nil,
      streak = streak,
      failures = tonumber(redis.call('HGET', P .. 'failures', id) or 0),
      ejections = tonumber(redis.call('HGET', P .. 'ejections', id) or 0),
      engine = redis.call('HGET', P .. 'engine', id) or nil,
      last_error = why, last_error_at = num(at),
    }
  end
end
-- Live: heard within their lease ttl. Dead: deadline passed while Redis could hear heartbeats.
-- Unheard: deadline passed during a gap in what Redis heard (a pause of Redis, or no process
-- alive; lib/base.lua liveness()): on probation, reclaimed when it ends unless heard again.
-- The probation runs once a script that may reap has recorded it (P.."clock" till); until
-- then, the first such script (a heartbeat, an acquire, a reap) starts it.
local horizon, till = liveness(now)
local dead = redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', int(horizon))
local waiting = 0
for _, holder in ipairs(dead) do
  waiting = waiting + redis.call('ZCARD', P .. 'owned:' .. holder)
end
local live = redis.call('ZCOUNT', P .. 'holders', '(' .. int(now), '+inf')
local unheard, unheard_leases, unheard_ms, running = 0, 0, 0, 0
if till > now then
  local late = redis.call('ZRANGEBYSCORE', P .. 'holders', '(' .. int(horizon), int(now),
    'WITHSCORES')
  unheard = #late / 2
  for k = 1, #late, 2 do
    unheard_leases = unheard_leases + redis.call('ZCARD', P .. 'owned:' .. late[k])
  end
  if unheard > 0 then
    -- Since the longest unheard was last heard: its deadline less the shortest ttl in use
    -- (exact when every process uses one lease_ttl; at least this otherwise).
    local short = tonumber(redis.call('HGET', P .. 'clock', 'short') or 0)
    unheard_ms = now - tonumber(late[2]) + short
  end
  if tonumber(redis.call('HGET', P .. 'clock', 'till') or 0) == till then running = 1 end
end
local head = redis.call('ZRANGE', P .. 'waiters', '0', '0')[1]
local oldest = 0
if head then
  local w = redis.call('HGET', P .. 'waiting', head)
  if w then oldest = now - tonumber(string.match(w, '(%d+)$')) end
end
local ws = redis.call('HMGET', P .. 'waitstats', 'served', 'waited_ms', 'max_ms', 'timed_out',
  'abandoned')
for k = 1, 5 do ws[k] = tonumber(ws[k] or 0) end
return cjson.encode({
  sessions = sessions, now = now, replicas = rows,
  holders = { live = live, dead = #dead, awaiting_reclaim = waiting, unheard = unheard,
    probation_ms = math.max(0, till - now), unheard_leases = unheard_leases,
    unheard_ms = unheard_ms, probation_running = running == 1 },
  waiting = { now = redis.call('ZCARD', P .. 'waiters'), oldest_ms = oldest, served = ws[1],
    waited_ms = ws[2], max_ms = ws[3], timed_out = ws[4], abandoned = ws[5] },
})
