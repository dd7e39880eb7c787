-- lib/base.lua: the key prefix, the key schema and small helpers every script uses. The loader
-- prepends the lib/ parts a script names on its "-- uses:" line (this one always first); they
-- read KEYS[1] only.
--
-- Keys: P = KEYS[1] = "rr:{NAME}:" and a suffix, every key sharing the hash tag {NAME} (I7).
-- Every suffix is listed once, with its type and content, in redis_router/keys.py (the key
-- schema in docs/design.md and destroy.lua's list are generated from it; a test fails when a
-- script names a key it lacks).
-- Invariants (docs/design.md): I1 ZSCORE load|draining|off id == ZCARD held:id after every script,
-- and ZSCORE weighted id == the sum of its leases' weights; I2 every lease is in its holder's
-- owned set, every owned token is a lease, and a holder leaves P.."holders" only once it owns
-- nothing, so no lease is ever out of reach of reaping.

local P = KEYS[1] -- per call
local SEP = '\31'
local LOAD = P .. 'load' -- per call
-- ARGV[1..HEAD] of every acquire: the balancer's settings (config() below), holder, waiting
-- ticket ("" = none), exclusion (server ids joined by SEP, "" = none: lib/acquiring.lua).
-- Requests start at ARGV[HEAD + 1]; each has OWN core arguments (request id, lease token,
-- random integer, group id or "") before a policy's own, which start at ARGV[i + OWN].
local HEAD = 4
local OWN = 4
-- A call's own state lives in one table, its context `cx`, which the script makes (an
-- acquire's in acquire_all, lib/acquiring.lua; others pass `{}`) and hands as the first
-- argument to every procedure that reads or keeps it. The procedures keep nothing of a call
-- anywhere else, so a Functions library makes them once and a call starts from what a fresh
-- EVAL would see. An acquire's context: cfg (config()), now, cur (the newest sticky bucket),
-- ll (lib/picking's level cache), seat (spread_sessions), engine (engine-aware scoring's
-- setting), caps and ticket (lib/admission), excl (the replicas the call leaves out:
-- { set = id -> true, back = { {sorted set, count, id}, ... } }; nil, the default, costs a
-- comparison), groups (lib/acquiring), and engine-aware scoring's caches (lib/scoring).
-- Hot path: a redis.call costs ~0.2 us, and turning a number into a string ~0.3 us (Lua's
-- tostring and the server's "%.17g" both go through printf for doubles), against ~0.03 us
-- for int() below. So the acquire and release paths pass integers through int(), constants
-- as strings, and a batch groups per replica the writes that do not depend on order.
local fmt = string.format -- per call (a library's load sees no standard library)
local function int(n) return fmt('%d', n) end

-- Engine-aware scoring's pinned setting "<ttl_ms> <kv_weight> <ceiling permille or ->" as
-- { ttl, w, ceil }, nil when off ("").
local function engine_setting(s)
  if not s or s == '' then return nil end
  local ttl, w, ceil = string.match(s, '^(%d+) (%S+) (%S+)$')
  return { ttl = tonumber(ttl), w = tonumber(w), ceil = tonumber(ceil) }
end

-- The balancer's settings, by name: ARGV[1] of acquire (every routing policy's script) and of
-- heartbeat, one JSON object a process makes once (redis_router.core, BalancerCore.config):
-- lease_ms (the holder's lease ttl), width_ms (a sticky bucket's width), span (buckets to
-- search back), deterministic (full_determinism), and pinned: { field = value } for the
-- settings every process must share (P.."config"; "" = off; the fields are listed once, in
-- redis_router.core.PINNED_SETTINGS). config(text) decodes a text once per library (a
-- balancer's processes send one or two) with what the scripts derive from it: numbers parsed,
-- the pinned fields sorted. The table is never written after that, so it carries nothing from
-- one call to the next; under EVALSHA (no library) every call decodes.
local CONFIGS = nil -- once per library: decoded settings by their text ([0]: how many)
local function config(text)
  local c = CONFIGS and CONFIGS[text]
  if c then return c end
  if not CONFIGS or CONFIGS[0] >= 8 then CONFIGS = { [0] = 0 } end
  c = cjson.decode(text)
  local p = c.pinned
  c.fields, c.values = {}, {}
  for field in pairs(p) do c.fields[#c.fields + 1] = field end
  table.sort(c.fields)
  for k, field in ipairs(c.fields) do c.values[k] = p[field] end
  c.sticky_ms = tonumber(p.sticky_ttl_ms)
  -- Affinity tolerance and group cap (lib/acquiring.lua; nil = off).
  c.margin, c.ratio = tonumber(p.affinity_margin), tonumber(p.affinity_ratio)
  c.cap = tonumber(p.group_cap)
  c.min_cached = tonumber(p.sticky_min_cached) -- eviction-aware stickiness, nil = off
  -- Passive health (lib/health.lua), and ejected_sticky = 'wait' (its last field).
  c.ejection = p.ejection ~= ''
  c.hold = string.sub(p.ejection, -5) == ' wait'
  c.engine = engine_setting(p.engine)
  c.spread = p.spread == '1'
  CONFIGS[text], CONFIGS[0] = c, CONFIGS[0] + 1
  return c
end

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
