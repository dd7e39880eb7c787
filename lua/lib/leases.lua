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

-- Release keys (client-made operation ids) are remembered in two generations of sets,
-- P.."released" and P.."released:old": a release adds one member (no clock read, no
-- sorted-set insert, no value: a member costs less than a hash field), and a heartbeat retires
-- the current generation once it is `remember` ms old (rotate_released), so a key is
-- recognised for at least `remember` ms and at most about twice that (plus a heartbeat
-- period), and an idle balancer's generations are gone within two windows. The generation's
-- start is the P.."clock" field "released".
local function was_released(op)
  return redis.call('SISMEMBER', P .. 'released', op) == 1
    or redis.call('SISMEMBER', P .. 'released:old', op) == 1
end

-- Clients before the sets kept release keys in hashes, P.."ended" (its start in field
-- "@since") and P.."ended:old", and rotate them the same way. Nothing else reads them: once
-- no such client writes them, they are dropped here a generation after their last use
-- ("@idle" marks when the old generation was first seen alone). Called once per rotation.
local function retire_ended(now, remember)
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
  local since = redis.call('HGET', P .. 'clock', 'released')
  if since and now - tonumber(since) < remember then return end
  if since then
    redis.call('UNLINK', P .. 'released:old') -- freed in the background: it may be large
    if redis.call('EXISTS', P .. 'released') == 1 then
      redis.call('RENAME', P .. 'released', P .. 'released:old')
    end
    retire_ended(now, remember)
  end
  redis.call('HSET', P .. 'clock', 'released', int(now))
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
