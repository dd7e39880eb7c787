-- lib/leases.lua: ending leases, reaping dead holders, remembering releases (uses base,
-- admission).
-- A lease record is id..SEP..request id..SEP..holder (..SEP..weight); its first two parts
-- name its request index field.
-- (replica, request index field, holder, weight or nil) of a lease record.
local function split_record(rec)
  local a = string.find(rec, SEP, 1, true)
  local b = string.find(rec, SEP, a + 1, true)
  local c = string.find(rec, SEP, b + 1, true)
  if not c then return string.sub(rec, 1, a - 1), string.sub(rec, 1, b - 1), string.sub(rec, b + 1) end
  return string.sub(rec, 1, a - 1), string.sub(rec, 1, b - 1), string.sub(rec, b + 1, c - 1),
    string.sub(rec, c + 1)
end

-- Remove token from the request index entry `field`; `toks`: the entry when the caller has
-- already read it.
local function forget_token(field, token, toks)
  toks = toks or redis.call('HGET', P .. 'byreq', field)
  if not toks then return end
  if toks == token then
    redis.call('HDEL', P .. 'byreq', field)
    return
  end
  local rest = {}
  for t in string.gmatch(toks, '%S+') do
    if t ~= token then rest[#rest + 1] = t end
  end
  if #rest == 0 then
    redis.call('HDEL', P .. 'byreq', field)
  else
    redis.call('HSET', P .. 'byreq', field, table.concat(rest, ' '))
  end
end

-- End one lease: its record, index entries, holder entry, weight and count (I1). Every script
-- that ends leases goes through here, whichever policy took them (a weight travels in the
-- record, so an unweighed lease costs no lookup). `rec` (the lease's record) and `toks` (its
-- request index entry) when the caller has already read them: each saves one HGET.
-- `unowned`: a table holder -> tokens that collects the holder-set removals for the caller
-- to make at its end, one ZREM per holder (a batch of releases is mostly one holder's).
-- Returns the replica, or nil when there was no such lease.
local function end_lease(token, rec, toks, unowned)
  rec = rec or redis.call('HGET', P .. 'leases', token)
  if not rec then return nil end
  local id, field, holder, w = split_record(rec)
  redis.call('HDEL', P .. 'leases', token)
  forget_token(field, token, toks)
  if unowned then
    local t = unowned[holder]
    if t then
      t[#t + 1] = token
    else
      unowned[holder] = { token }
    end
  else
    redis.call('ZREM', P .. 'owned:' .. holder, token)
  end
  if w then
    redis.call('ZINCRBY', P .. 'weighted', '-' .. w, id)
    redis.call('ZADD', P .. 'wscore', 'XX', 'INCR', '-' .. w, id) -- I12, while it exists
  end
  redis.call('ZREM', P .. 'held:' .. id, token)
  -- The engine-aware score follows the count while it exists (lib/scoring.lua, I12).
  redis.call('ZADD', P .. 'escore', 'XX', 'INCR', '-1', id)
  -- ZADD XX INCR changes the count only where the replica is (load, else draining, else off).
  if not redis.call('ZADD', LOAD, 'XX', 'INCR', '-1', id) then
    if not redis.call('ZADD', P .. 'draining', 'XX', 'INCR', '-1', id) then
      if redis.call('ZADD', P .. 'off', 'XX', 'INCR', '-1', id) then admit().put_back(id) end
    end
  end
  return id
end

-- Release keys (client-made operation ids) are remembered in two generations of hashes,
-- P.."remembered" and P.."remembered:old", packed: an id's last three characters name a field
-- (262,144 of them for base64url ids) and the field's value holds the rest of each of its
-- ids, each followed by SEP, after a leading SEP. An id costs its own characters and a share
-- of its field's entry: a few times less than a set member, which takes a table entry and
-- slot of its own (benchmarks/release_records.py). A heartbeat retires the current
-- generation once it is `remember` ms old (rotate_released), so a key is recognised for at
-- least `remember` ms and at most about twice that (plus a heartbeat period). The generation's
-- start is the P.."clock" field "remembered". Both generations expire by themselves, so they
-- are gone within two windows of the last heartbeat (the last process closed or died): the
-- rotation makes the new one, marked by its field "@" (never an id's: ids are base64url), to
-- expire two windows on (a release's HSET keeps that), and gives the old one a window more
-- from then, which its last id is due. Releases pay nothing for it. Operation ids never hold
-- SEP.

-- An operation id as packed: its field (the last three characters) and the rest.
local function packed(op)
  return string.sub(op, -3), string.sub(op, 1, -4)
end

local function was_released(op)
  local field, rest = packed(op)
  rest = SEP .. rest .. SEP
  local ids = redis.call('HGET', P .. 'remembered', field)
  if ids and string.find(ids, rest, 1, true) then return true end
  ids = redis.call('HGET', P .. 'remembered:old', field)
  return ids and string.find(ids, rest, 1, true) ~= nil or false
end

-- Remember one release's key: its field's value gains the rest of the id.
local function remember_release(op)
  local field, rest = packed(op)
  local ids = redis.call('HGET', P .. 'remembered', field)
  redis.call('HSET', P .. 'remembered', field, (ids or SEP) .. rest .. SEP)
end

-- Remember a batch's release keys: one HMGET and one HSET (per CHUNK fields) for all of them.
local function remember_releases(ops)
  local key, fields, adds = P .. 'remembered', {}, {}
  for _, op in ipairs(ops) do
    local field, rest = packed(op)
    local add = adds[field]
    if not add then
      fields[#fields + 1] = field
      add = ''
    end
    adds[field] = add .. rest .. SEP
  end
  local flat = {}
  for lo = 1, #fields, CHUNK do
    local hi = math.min(lo + CHUNK - 1, #fields)
    local ids = redis.call('HMGET', key, unpack(fields, lo, hi))
    for i = lo, hi do
      local field = fields[i]
      flat[#flat + 1] = field
      flat[#flat + 1] = (ids[i - lo + 1] or SEP) .. adds[field]
    end
  end
  flat_call('HSET', key, flat)
end

-- Clients of two kinds before the packed hashes kept release keys elsewhere, and rotate them
-- themselves; nothing else reads them, and here they are dropped once no such client is left.
-- Called once per rotation. Sets, P.."released" and P.."released:old", their start in the
-- P.."clock" field "released": dropped once their clients have not rotated them for two
-- windows (a live one rotates a window after the start). Hashes before those, P.."ended"
-- (its start in field "@since") and P.."ended:old", rotated here the same way: dropped a
-- generation after their last use ("@idle" marks when the old one was first seen alone).
local function retire_earlier(now, remember)
  local sets = redis.call('HGET', P .. 'clock', 'released')
  if sets and now - tonumber(sets) >= 2 * remember then
    redis.call('UNLINK', P .. 'released', P .. 'released:old')
    redis.call('HDEL', P .. 'clock', 'released')
  end
  local ended, old = P .. 'ended', P .. 'ended:old'
  local since = redis.call('HGET', ended, '@since')
  if since then
    if now - tonumber(since) >= remember then
      redis.call('UNLINK', old)
      redis.call('RENAME', ended, old)
    end
  elseif redis.call('EXISTS', ended) == 1 then
    redis.call('HSET', ended, '@since', int(now))
  else
    local idle = redis.call('HGET', old, '@idle')
    if not idle then
      if redis.call('EXISTS', old) == 1 then redis.call('HSET', old, '@idle', int(now)) end
    elseif now - tonumber(idle) >= remember then
      redis.call('UNLINK', old)
    end
  end
end

local function rotate_released(now, remember)
  local since = redis.call('HGET', P .. 'clock', 'remembered')
  if since and now - tonumber(since) < remember then return end
  local key, old = P .. 'remembered', P .. 'remembered:old'
  if since then
    redis.call('UNLINK', old) -- freed in the background: it may be large
    if redis.call('EXISTS', key) == 1 then
      redis.call('RENAME', key, old)
      redis.call('PEXPIRE', old, int(remember))
    end
    retire_earlier(now, remember)
  end
  redis.call('HSET', key, '@', int(now))
  redis.call('PEXPIRE', key, int(2 * remember))
  redis.call('HSET', P .. 'clock', 'remembered', int(now))
end

-- A generation that releases made where no rotation timed it (before the balancer's first
-- heartbeat, or after the last rotation's expiry passed) expires two windows from now, as a
-- rotation's would (retire.lua: a process may close before its first heartbeat).
local function expire_remembered(remember)
  local since = redis.call('HGET', P .. 'clock', 'remembered')
  if not since or now_ms() - tonumber(since) >= 2 * remember then
    redis.call('PEXPIRE', P .. 'remembered', int(2 * remember))
  end
end

-- Reclaim the leases of dead holders (deadline at most `horizon`, liveness() in lib/base: the
-- process stopped sending heartbeats while Redis could hear them), each exactly once (I2). At
-- most `budget` entries are examined (a lease or a holder each), so one call stays short
-- however many leases a crash left. Returns how many leases ended and how many entries were
-- examined.
local function reap(horizon, budget)
  local n, seen, now_s = 0, 0, int(horizon)
  while seen < budget do
    local dead = redis.call('ZRANGEBYSCORE', P .. 'holders', '-inf', now_s, 'LIMIT', '0', '1')
    if #dead == 0 then break end
    local owned = P .. 'owned:' .. dead[1]
    seen = seen + 1
    local toks = {}
    if seen < budget then toks = redis.call('ZRANGE', owned, '0', int(budget - seen - 1)) end
    seen = seen + #toks
    for _, token in ipairs(toks) do
      local id = end_lease(token)
      if id then
        n = n + 1
        redis.call('HINCRBY', P .. 'reclaimed', id, '1')
      else
        redis.call('ZREM', owned, token)
      end
    end
    if redis.call('EXISTS', owned) == 0 then redis.call('ZREM', P .. 'holders', dead[1]) end
  end
  return n, seen
end
