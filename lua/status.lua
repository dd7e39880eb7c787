-- status.lua: one consistent snapshot of the balancer, for get_status and operators.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  sticky bucket width (ms)    ARGV[2]  buckets to search back
-- Keeps    read only.
-- Returns  { sticky session total, now (ms), rows, holders, waiting } where each row is
--          { id, in-flight, draining (0/1), leases, sticky sessions, acquires,
--            sticky hits, reclaimed, JSON metadata, sticky sessions re-pinned away from it
--            by the affinity margin, then health (below), then its engine report ("" = none,
--            lib/engine.lua) } for every replica (full or ejected ones too), holders is { live,
--            dead, leases of dead holders awaiting reclaim, live ones on probation after a
--            pause of Redis, ms the probation has left },
--          waiting is { waiting now, the first one's wait so far (ms), served after waiting,
--          their total and longest wait (ms), given up, abandoned (process died) }
-- Health   per row: capacity ("" = none), ejected until (ms, "" = not), why, failures in a
--          row, failures reported, ejections in a row.
-- Uses     lib/base
local width, span = tonumber(ARGV[1]), tonumber(ARGV[2])
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
    rows[#rows + 1] = {
      id, tonumber(ids[i + 1]), draining,
      redis.call('ZCARD', P .. 'held:' .. id), sticky,
      tonumber(redis.call('HGET', P .. 'acquires', id) or 0),
      tonumber(redis.call('HGET', P .. 'sticky_hits', id) or 0),
      tonumber(redis.call('HGET', P .. 'reclaimed', id) or 0),
      redis.call('HGET', P .. 'servers', id),
      tonumber(redis.call('HGET', P .. 'repins', id) or 0),
      redis.call('HGET', P .. 'capacity', id) or '',
      redis.call('ZSCORE', P .. 'ejected', id) or '',
      redis.call('HGET', P .. 'eject_why', id) or '',
      tonumber(redis.call('HGET', P .. 'fails', id) or 0),
      tonumber(redis.call('HGET', P .. 'failures', id) or 0),
      tonumber(redis.call('HGET', P .. 'ejections', id) or 0),
      redis.call('HGET', P .. 'engine', id) or '',
    }
  end
end
-- Dead: deadline passed while Redis could hear heartbeats; on probation: unheard only during a
-- pause of Redis (lib/base.lua liveness()), counted live until the probation ends.
local horizon, till = liveness(now)
local dead = redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', int(horizon))
local waiting = 0
for _, holder in ipairs(dead) do waiting = waiting + redis.call('ZCARD', P .. 'owned:' .. holder) end
local live = redis.call('ZCOUNT', P .. 'holders', '(' .. int(horizon), '+inf')
local probation = 0
if till > now then probation = redis.call('ZCOUNT', P .. 'holders', '(' .. int(horizon), int(now)) end
local head = redis.call('ZRANGE', P .. 'waiters', '0', '0')[1]
local oldest = 0
if head then
  local w = redis.call('HGET', P .. 'waiting', head)
  if w then oldest = now - tonumber(string.match(w, '(%d+)$')) end
end
local ws = redis.call('HMGET', P .. 'waitstats', 'served', 'waited_ms', 'max_ms', 'timed_out',
  'abandoned')
for k = 1, 5 do ws[k] = tonumber(ws[k] or 0) end
return { sessions, now, rows, { live, #dead, waiting, probation, int(math.max(0, till - now)) },
  { redis.call('ZCARD', P .. 'waiters'), oldest, ws[1], ws[2], ws[3], ws[4], ws[5] } }
