-- lib/base.lua: the key prefix, the key schema and small helpers every script uses. The loader
-- prepends the lib/ parts a script names on its "-- uses:" line (this one always first); they
-- read KEYS[1] only.
--
-- Key schema (P = KEYS[1] = "rr:{NAME}:"; every key shares the hash tag {NAME}, I7):
--   P.."servers"        HASH  server id -> JSON metadata (the pool)
--   P.."load"           ZSET  server id -> in-flight count, replicas that take new sessions
--   P.."draining"       ZSET  server id -> in-flight count, replicas that only serve sticky ones
--   P.."held:"..id      ZSET  lease token -> acquired at (ms, Redis clock): leases on one replica
--   P.."leases"         HASH  lease token -> id.."\31"..request id.."\31"..holder, and
--                             .."\31"..weight for a weighed lease (a policy's request weight)
--   P.."byreq"          HASH  id.."\31"..request id -> lease tokens, space separated
--   P.."holders"        ZSET  holder -> deadline (ms): a holder (one balancer instance in one
--                             process) is alive while its heartbeats keep the deadline ahead
--   P.."owned:"..h      ZSET  lease token -> acquired or renewed at (ms): the leases of holder h
--   P.."remembered"     HASH  client-made operation ids of releases, packed: last three
--                             characters -> SEP..the rest of each id..SEP ("@" -> when a
--                             heartbeat began it); P.."remembered:old" the generation
--                             before: a resent release finds its first copy here; both
--                             expire (lib/leases.lua; P.."released", P.."released:old", sets,
--                             and P.."ended", P.."ended:old", hashes: earlier clients')
--   P.."sticky:"..b     HASH  request id -> server id, sessions last seen in time bucket b
--   P.."stickyn:"..b    HASH  server id -> sessions in bucket b (expires with it)
--   P.."pinned"         HASH  server id -> live sticky sessions naming it, "@" -> the oldest
--                             bucket counted (lib/picking: new sessions' tie-break, I13)
--   P.."acquires", P.."sticky_hits", P.."reclaimed"   HASH  server id -> counter
--   P.."config"         HASH  settings every process must share (sticky_ttl_ms,
--                             affinity_margin, affinity_ratio, group_cap, group_by, ejection,
--                             engine, sticky_min_cached, spread; "" = off)
--   P.."repins"         HASH  server id -> sticky sessions moved off it by the affinity margin
--                             or because it no longer held their prompt (sticky_min_cached)
--   P.."group:"..b      HASH  group id -> server id.."\31"..members placed there in a row,
--                             groups last joined in time bucket b (expires as sticky:b does)
--   P.."weighted"       ZSET  server id -> sum of the weights of its leases (0 unless a policy
--                             weighs requests, e.g. by prompt tokens)
--   P.."capacity"       HASH  server id -> requests it can hold (declared; absent = no limit)
--   P.."escore", P.."eextra"  ZSET / HASH  engine-aware scores and what reports add to the
--                             counts (lib/scoring.lua; only while engine scoring is pinned);
--                             P.."wscore", P.."wextra" the same for least_tokens, in tokens
--   P.."off"            ZSET  server id -> in-flight count, replicas taking no acquire for now
--                             (full or ejected); P.."back" HASH id -> 'load' | 'draining'
--   P.."ejected", P.."eject_why", P.."fails", P.."ejections", P.."failures": lib/health.lua
--   P.."waiters", P.."waiting", P.."wake:"..ticket, P.."waitseq", P.."waitstats": waiting
--                             acquires (lib/leases.lua)
--   P.."clock"          HASH  when Redis last heard a heartbeat and the probation after a
--                             pause (liveness() below), when P.."remembered" began ("remembered")
--   P.."heal"           HASH  cursors of the repair pass (heal.lua)
--   P.."engine", P.."engine_at": what the engines report of their own load, and when
--                             (lib/engine.lua)
-- Invariants (docs/design.md): I1 ZSCORE load|draining|off id == ZCARD held:id after every script,
-- and ZSCORE weighted id == the sum of its leases' weights; I2 every lease is in its holder's
-- owned set, every owned token is a lease, and a holder leaves P.."holders" only once it owns
-- nothing, so no lease is ever out of reach of reaping.

local P = KEYS[1] -- per call
local SEP = '\31'
local LOAD = P .. 'load' -- per call
-- ARGV[1..HEAD] of every acquire: lease ttl (ms), sticky bucket width (ms), sticky ttl (ms),
-- buckets to search back, router flag, holder, affinity margin (in-flight requests, "" = off),
-- affinity ratio ("" = off), group cap (members, "" = none), group_by (pinned only),
-- ejection settings (pinned, lib/health.lua; "" = off; ends in ' wait' for ejected_sticky =
-- 'wait'), waiting ticket ("" = none), engine-aware scoring (pinned, lib/scoring.lua),
-- spread_sessions (pinned, lib/picking.lua; "1" = on, "" = off).
-- Requests start at ARGV[HEAD + 1]; each has OWN core arguments (request id, lease token,
-- random integer, group id or "") before a policy's own, which start at ARGV[i + OWN].
local HEAD = 14
local OWN = 4
-- Hot path: a redis.call costs ~0.2 us, and turning a number into a string ~0.3 us (Lua's
-- tostring and the server's "%.17g" both go through printf for doubles), against ~0.03 us
-- for int() below. So the acquire and release paths pass integers through int(), constants
-- as strings, and a batch groups per replica the writes that do not depend on order.
local fmt = string.format -- per call (a library's load sees no standard library)
local function int(n) return fmt('%d', n) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Liveness is judged on the time Redis could hear heartbeats, not on wall time. A stall, a
-- SIGSTOP, CLIENT PAUSE, an out-of-memory spell that refuses writes, or a restart from
-- persistence stops every heartbeat at once; the first script after it would find every
-- holder's deadline passed. So heartbeats (and reaps) note when they ran (P.."clock" heard),
-- and a script that finds Redis unheard for longer than half the shortest lease ttl in use
-- records a gap: holders whose deadline fell after its start are on probation for half the
-- longest lease ttl in use, time for their keepers to be heard again (etcd extends every
-- lease after a leader change for the same reason). A holder whose deadline passed before
-- the gap began was dead while Redis listened, and is reaped at once.
-- P.."clock" fields: heard (ms), since (gap start) and till (probation end), short and long
-- (lease ttls in use, ms) with the times they were last seen.
-- Returns the horizon: a holder whose deadline is at most this is dead; the probation's end
-- (ms, 0 = none); and the longest a caller may leave Redis unheard without it counting as a
-- gap (a quarter of the shortest lease ttl in use, ms; 0 when none is known). `ttl` (the caller's lease ttl, ms) makes it write the clock: only
-- scripts that may reap pass it; nil only reads (status, a waiter's check).
local function liveness(now, ttl)
  local c = redis.call('HMGET', P .. 'clock', 'heard', 'since', 'till', 'short', 'short_at',
    'long', 'long_at')
  local heard, since, till = tonumber(c[1]), tonumber(c[2]), tonumber(c[3])
  local short, short_at, long, long_at = tonumber(c[4]), tonumber(c[5]), tonumber(c[6]),
    tonumber(c[7])
  local lim = short or ttl
  local paused = heard and lim and now - heard > lim / 2
  if paused then
    -- Unheard since `heard`: a pause (or nobody was alive). A gap inside a probation still
    -- running extends it and keeps its start.
    if not (till and since and till > heard) then since = heard end
    till = now + math.max(long or 0, ttl or 0, lim) / 2
  end
  if ttl then
    -- A ttl in use is forgotten once Redis heard others for four of its lengths without it
    -- (judged on heard time, so a pause forgets nothing).
    local t = paused and heard or now
    if not short or ttl <= short or t - short_at > 4 * short then short, short_at = ttl, now end
    if not long or ttl >= long or t - long_at > 4 * long then long, long_at = ttl, now end
    redis.call('HSET', P .. 'clock', 'heard', int(now), 'short', int(short), 'short_at',
      int(short_at), 'long', int(long), 'long_at', int(long_at))
    if till and till > now then
      redis.call('HSET', P .. 'clock', 'since', int(since), 'till', int(till))
    end
  end
  local listen = (short or lim or 0) / 4
  if till and till > now then return since, till, listen end
  return now, 0, listen
end

-- The sorted set that holds id's count, or nil when id is not in the pool.
local function pool_of(id)
  if redis.call('ZSCORE', P .. 'load', id) then return P .. 'load' end
  if redis.call('ZSCORE', P .. 'draining', id) then return P .. 'draining' end
  return nil
end

-- HMGET in chunks (Lua's unpack is limited to a few thousand values); nil for a missing field.
local CHUNK = 2000
local function hmget(key, fields, n)
  local out = {}
  for lo = 1, n, CHUNK do
    local hi = math.min(lo + CHUNK - 1, n)
    local got = redis.call('HMGET', key, unpack(fields, lo, hi))
    for j = lo, hi do out[j] = got[j - lo + 1] or nil end
  end
  return out
end

-- cmd key a1 b1 a2 b2 ... in chunks (CHUNK is even, so pairs stay whole), for the writes a
-- batch collects.
local function flat_call(cmd, key, flat)
  for lo = 1, #flat, CHUNK do
    redis.call(cmd, key, unpack(flat, lo, math.min(lo + CHUNK - 1, #flat)))
  end
end

-- The replica of a lease record (id..SEP..request id..SEP..holder...).
local function server_of(rec)
  return string.sub(rec, 1, string.find(rec, SEP, 1, true) - 1)
end
