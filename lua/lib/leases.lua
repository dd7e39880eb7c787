-- lib/leases.lua: ending leases, reaping dead holders, heartbeats (uses base).
-- A lease record is id..SEP..request id..SEP..holder; its first two parts name its request
-- index field.
local function server_of(rec)
  return string.sub(rec, 1, string.find(rec, SEP, 1, true) - 1)
end

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
-- Returns the replica, or nil when there was no such lease.
local function end_lease(token, rec, toks)
  rec = rec or redis.call('HGET', P .. 'leases', token)
  if not rec then return nil end
  local id, field, holder, w = split_record(rec)
  redis.call('HDEL', P .. 'leases', token)
  forget_token(field, token, toks)
  redis.call('ZREM', P .. 'owned:' .. holder, token)
  if w then redis.call('ZINCRBY', P .. 'weighted', '-' .. w, id) end
  redis.call('ZREM', P .. 'held:' .. id, token)
  -- ZADD XX INCR changes the count only where the replica is (load, else draining).
  if not redis.call('ZADD', LOAD, 'XX', 'INCR', '-1', id) then
    redis.call('ZADD', P .. 'draining', 'XX', 'INCR', '-1', id)
  end
  return id
end

-- Release keys (client-made operation ids) are remembered in two generations of hashes,
-- P.."ended" and P.."ended:old": a release writes one HSET (no clock read, no sorted-set
-- insert), and a heartbeat retires the current generation once it is `remember` ms old
-- (rotate_ended), so a key is recognised for at least `remember` ms and at most about twice
-- that. The generation's start is its field "@since" (operation ids are hex).
local function was_ended(op)
  return redis.call('HEXISTS', P .. 'ended', op) == 1
    or redis.call('HEXISTS', P .. 'ended:old', op) == 1
end

local function rotate_ended(now, remember)
  local ended = P .. 'ended'
  local since = redis.call('HGET', ended, '@since')
  if not since then
    if redis.call('EXISTS', ended) == 1 then redis.call('HSET', ended, '@since', int(now)) end
  elseif now - tonumber(since) >= remember then
    redis.call('UNLINK', P .. 'ended:old') -- freed in the background: it may be large
    redis.call('RENAME', ended, P .. 'ended:old')
  end
end

-- Reclaim the leases of dead holders (deadline passed: the process stopped sending heartbeats),
-- each exactly once (I2). At most `budget` entries are examined (a lease or a holder each), so
-- one call stays short however many leases a crash left. Returns how many leases ended and
-- how many entries were examined.
local function reap(now, budget)
  local n, seen, now_s = 0, 0, int(now)
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

-- Mark a holder alive until now + ttl (never moving its deadline back). The first time it is
-- seen (or again after it was declared dead, or the keys were lost) its process's settings
-- (`...`, in PINNED's order) are checked against the pinned ones, and a setting not pinned yet
-- is pinned: every process that acquires checks them, not only at start-up. Returns an error
-- reply "CONFIGMISMATCH <field> <pinned value>" on a mismatch, with nothing pinned.
local function heartbeat(holder, now, ttl, ...)
  if redis.call('ZADD', P .. 'holders', 'GT', int(now + ttl), holder) == 0 then return nil end
  -- The settings every process of a balancer must share, as fields of P.."config" ("" = off)
  -- (a table made only here: most calls of the scripts that load this part never get here).
  local PINNED = { 'sticky_ttl_ms', 'affinity_margin', 'affinity_ratio', 'group_cap', 'group_by' }
  local mine = { ... }
  local pinned = redis.call('HMGET', P .. 'config', unpack(PINNED))
  local fresh = {}
  for k, field in ipairs(PINNED) do
    local v = pinned[k]
    if not v then
      fresh[#fresh + 1], fresh[#fresh + 2] = field, mine[k]
    elseif v ~= mine[k] then
      redis.call('ZREM', P .. 'holders', holder)
      return redis.error_reply('CONFIGMISMATCH ' .. field .. ' ' .. v)
    end
  end
  if #fresh > 0 then redis.call('HSET', P .. 'config', unpack(fresh)) end
  return nil
end
