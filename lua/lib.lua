-- lib.lua: helpers shared by every script. The loader prepends this file to each script, so
-- there is one copy of the lease and sticky logic. It reads KEYS[1] only.
--
-- Key schema (P = KEYS[1] = "rr:{NAME}:"; every key shares the hash tag {NAME}, I7):
--   P.."servers"        HASH  server id -> JSON metadata (the pool)
--   P.."load"           ZSET  server id -> in-flight count, replicas that take new sessions
--   P.."draining"       ZSET  server id -> in-flight count, replicas that only serve sticky ones
--   P.."held:"..id      ZSET  lease token -> acquired at (ms, Redis clock): leases on one replica
--   P.."leases"         HASH  lease token -> id.."\31"..request id.."\31"..holder
--   P.."byreq"          HASH  id.."\31"..request id -> lease tokens, space separated
--   P.."holders"        ZSET  holder -> deadline (ms): a holder (one balancer instance in one
--                             process) is alive while its heartbeats keep the deadline ahead
--   P.."owned:"..h      ZSET  lease token -> acquired or renewed at (ms): the leases of holder h
--   P.."ended"          ZSET  release key (a token or a client-made operation id) -> ended at
--                             (ms): a resent release finds its first copy's result here
--   P.."sticky:"..b     HASH  request id -> server id, sessions last seen in time bucket b
--   P.."stickyn:"..b    HASH  server id -> sessions in bucket b (expires with it)
--   P.."acquires", P.."sticky_hits", P.."reclaimed"   HASH  server id -> counter
--   P.."config"         HASH  settings every process must share (sticky_ttl_ms)
--   P.."weights"        HASH  lease token -> weight, for routers that weigh requests (tokens)
--   P.."weighted"       ZSET  server id -> sum of the weights of its leases
-- Invariants (docs/design.md): I1 ZSCORE load|draining id == ZCARD held:id after every script;
-- every lease is in its holder's owned set and every owned token is a lease; a holder leaves
-- P.."holders" only once it owns nothing, so no lease is ever out of reach of reaping (I2).

local P = KEYS[1]
local SEP = '\31'
local LOAD = P .. 'load'
-- ARGV[1..HEAD] of every acquire: lease ttl (ms), sticky bucket width (ms), sticky ttl (ms),
-- buckets to search back, router flag, holder. Requests start at ARGV[HEAD + 1].
local HEAD = 6
-- Hot path: a redis.call costs ~0.2 us, and turning a number into a string ~0.3 us (Lua's
-- tostring and the server's "%.17g" both go through printf for doubles), against ~0.03 us
-- for int() below. So the acquire and release paths pass integers through int(), constants
-- as strings, and a batch groups per replica the writes that do not depend on order.
local fmt = string.format
local function int(n) return fmt('%d', n) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The sorted set that holds id's count, or nil when id is not in the pool.
local function pool_of(id)
  if redis.call('ZSCORE', P .. 'load', id) then return P .. 'load' end
  if redis.call('ZSCORE', P .. 'draining', id) then return P .. 'draining' end
  return nil
end

-- A lease record is id..SEP..request id..SEP..holder; its first two parts name its request
-- index field.
local function server_of(rec)
  return string.sub(rec, 1, string.find(rec, SEP, 1, true) - 1)
end

local function split_record(rec)
  local a = string.find(rec, SEP, 1, true)
  local b = string.find(rec, SEP, a + 1, true)
  return string.sub(rec, 1, a - 1), string.sub(rec, 1, b - 1), string.sub(rec, b + 1)
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
-- that ends leases goes through here. `rec` (the lease's record) and `toks` (its request index
-- entry) when the caller has already read them: each saves one HGET on the release path.
-- Returns the replica, or nil when there was no such lease.
local function end_lease(token, rec, toks)
  rec = rec or redis.call('HGET', P .. 'leases', token)
  if not rec then return nil end
  local id, field, holder = split_record(rec)
  redis.call('HDEL', P .. 'leases', token)
  forget_token(field, token, toks)
  redis.call('ZREM', P .. 'owned:' .. holder, token)
  local w = redis.call('HGET', P .. 'weights', token)
  if w then
    redis.call('HDEL', P .. 'weights', token)
    redis.call('ZINCRBY', P .. 'weighted', -tonumber(w), id)
  end
  redis.call('ZREM', P .. 'held:' .. id, token)
  -- ZADD XX INCR changes the count only where the replica is (load, else draining).
  if not redis.call('ZADD', LOAD, 'XX', 'INCR', '-1', id) then
    redis.call('ZADD', P .. 'draining', 'XX', 'INCR', '-1', id)
  end
  return id
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
-- are checked against the pinned ones, and pinned if there are none: every process that
-- acquires checks them, not only at start-up. Returns an error reply on a mismatch.
local function heartbeat(holder, now, ttl, sticky_ms)
  if redis.call('ZADD', P .. 'holders', 'GT', int(now + ttl), holder) == 0 then return nil end
  local pinned = redis.call('HGET', P .. 'config', 'sticky_ttl_ms')
  if not pinned then
    redis.call('HSET', P .. 'config', 'sticky_ttl_ms', sticky_ms)
  elseif pinned ~= sticky_ms then
    redis.call('ZREM', P .. 'holders', holder)
    return redis.error_reply('CONFIGMISMATCH ' .. pinned)
  end
  return nil
end

-- Least in-flight among the replicas that take new sessions; ties broken uniformly by the
-- client-supplied integer `rand` (I4; never the Lua RNG, see DESIGN.md). O(log N).
-- The minimum and how many replicas share it are kept in `LL` for the rest of the script:
-- after each +1 on `load` (reported through load_incremented) the ties shrink by one, so a
-- batch reads the sorted set once per level instead of twice per request. In a batch
-- (LL.batch) a level of at most LEVEL_MAX replicas is also read whole, in rank order, and
-- picks index it instead of asking ZRANGE for each rank. Only acquire_all changes `load`
-- during an acquire, so the cache stays exact.
local LL = {}
local LEVEL_MAX = 128

local PEEK = 8

-- Read the minimum and the replicas at the lowest ranks, in one call. When the lowest level
-- ends within them (or they are the whole pool) its size and members are known, so the pick
-- needs no ZCOUNT and no ZRANGE: a small pool, or a busy one, routes with this call alone.
-- False when no replica takes new sessions.
local function load_peek()
  local top = redis.call('ZRANGE', LOAD, 0, PEEK - 1, 'WITHSCORES')
  local n = #top / 2
  if n == 0 then return false end
  local mins = top[2] -- Redis formats equal scores identically, so strings compare as numbers
  local level, k = { top[1] }, 1
  while k < n and top[2 * k + 2] == mins do
    k = k + 1
    level[k] = top[2 * k - 1]
  end
  LL.min, LL.mins, LL.first = tonumber(mins), mins, top[1]
  if k < n or n < PEEK then
    LL.ties, LL.level = k, level
  else
    LL.ties, LL.level = nil, nil
  end
  return true
end

-- `id`'s count in `load` is now `score` (it was score - 1).
local function load_incremented(score, id)
  if LL.min and tonumber(score) == LL.min + 1 then
    if LL.ties and LL.ties > 1 then
      LL.ties, LL.first = LL.ties - 1, nil
      local level = LL.level
      if level then
        for k = 1, #level do
          if level[k] == id then
            table.remove(level, k)
            break
          end
        end
      end
    else
      LL.min = nil -- the level emptied (or its size is unknown): read it again when needed
    end
  end
end

local function least_loaded(rand)
  if not LL.min and not load_peek() then return nil end
  if not LL.ties then LL.ties = redis.call('ZCOUNT', LOAD, LL.mins, LL.mins) end
  local r = rand % LL.ties
  if LL.level then return LL.level[r + 1] end
  if r == 0 and LL.first then return LL.first end
  if LL.batch and LL.ties <= LEVEL_MAX then
    LL.level = redis.call('ZRANGE', LOAD, '0', int(LL.ties - 1))
    return LL.level[r + 1]
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

-- One request (the common case): the straight sequential procedure, without the batch's
-- tables. Its arguments start at ARGV[i]; the caller has reaped and knows `now` and `cur`.
local function acquire_one(i, choose, granted, now, cur, holder, width, ttl, span)
  local req, token = ARGV[i], ARGV[i + 1]
  local rec = redis.call('HGET', P .. 'leases', token)
  if rec then
    local id = server_of(rec)
    return { id, redis.call('HGET', P .. 'servers', id), 2 }
  end
  local old, ob
  for b = cur, cur - span, -1 do
    old = redis.call('HGET', P .. 'sticky:' .. int(b), req)
    if old then
      ob = b
      break
    end
  end
  -- A sticky replica is counted where it is (ZADD XX INCR is a no-op outside the set), so a
  -- sticky hit needs no membership lookup; only a new session needs the NOSERVERS check.
  local id, how = old, 1
  if not (old and redis.call('ZADD', LOAD, 'XX', 'INCR', '1', old)) then
    if not (old and redis.call('ZADD', P .. 'draining', 'XX', 'INCR', '1', old)) then
      if not load_peek() then
        return redis.error_reply('NOSERVERS no replica is accepting new sessions')
      end
      id, how = choose(i), 0
      redis.call('ZINCRBY', LOAD, '1', id)
    end
  end
  local at = int(now)
  redis.call('ZADD', P .. 'held:' .. id, at, token)
  redis.call('ZADD', P .. 'owned:' .. holder, at, token)
  local field = id .. SEP .. req
  redis.call('HSET', P .. 'leases', token, field .. SEP .. holder)
  if redis.call('HSETNX', P .. 'byreq', field, token) == 0 then
    redis.call('HSET', P .. 'byreq', field, redis.call('HGET', P .. 'byreq', field) .. ' ' .. token)
  end
  if not (ob == cur and old == id) then
    if ob then
      local obs = int(ob)
      redis.call('HDEL', P .. 'sticky:' .. obs, req)
      redis.call('HINCRBY', P .. 'stickyn:' .. obs, old, '-1')
    end
    local curs = int(cur)
    local key, nkey = P .. 'sticky:' .. curs, P .. 'stickyn:' .. curs
    redis.call('HSET', key, req, id)
    if redis.call('HINCRBY', nkey, id, '1') == 1 then
      local expire_at = int((cur + 1) * width + ttl)
      redis.call('PEXPIREAT', key, expire_at)
      redis.call('PEXPIREAT', nkey, expire_at)
    end
  end
  redis.call('HINCRBY', P .. 'acquires', id, '1')
  if how == 1 then redis.call('HINCRBY', P .. 'sticky_hits', id, '1') end
  if granted then granted(i, id, token) end
  return { id, redis.call('HGET', P .. 'servers', id), how }
end

-- The acquire procedure every router shares (the core's acquire.lua and plugins' scripts).
-- ARGV[1] holder's lease ttl (ms: its heartbeat deadline is pushed to now + this),
-- ARGV[2] sticky bucket width (ms), ARGV[3] sticky ttl (ms), ARGV[4] buckets to search back,
-- ARGV[5] router flag (core: 1 = full_determinism), ARGV[6] holder;
-- then `stride` arguments per request starting at ARGV[HEAD + 1]: request id, lease token,
-- random integer, then the router's own.
-- choose(i) picks the replica for a new session whose arguments start at ARGV[i] (nil: none);
-- granted(i, id, token), if given, runs after each new lease is counted (its replica's count
-- is already +1; the lease records themselves are written when the whole batch is routed).
-- Returns a flat array: per request, server id, JSON metadata, and 0 = balanced, 1 = sticky,
-- 2 = retry of a granted token; or the error NOSERVERS (CONFIGMISMATCH: this process's
-- sticky ttl is not the pinned one) before anything is written.
-- The result and the final state are those of acquiring the requests one after another; the
-- lookups are read up front (one HMGET per key) and the writes that commute are grouped per
-- replica at the end, so a batch of K costs a few calls per request, not ~20.
local function acquire_all(stride, choose, granted)
  local lease_ms, width, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
  local span, holder = tonumber(ARGV[4]), ARGV[6]
  local now = now_ms()
  local cur = math.floor(now / width)
  -- An acquire is a heartbeat of its holder, and reaps nothing: the holders' keepers do,
  -- in short calls of their own, so no acquire is slowed by another process's crash.
  local refused = heartbeat(holder, now, lease_ms, ARGV[3])
  if refused then return refused end
  if #ARGV == HEAD + stride then
    return acquire_one(HEAD + 1, choose, granted, now, cur, holder, width, ttl, span)
  end

  -- Read up front: the leases of the tokens (retries) and the sticky entries of the requests.
  local n, reqs, toks = 0, {}, {}
  for i = HEAD + 1, #ARGV, stride do
    n = n + 1
    reqs[n], toks[n] = ARGV[i], ARGV[i + 1]
  end
  local recs = hmget(P .. 'leases', toks, n)
  local sid, sb = {}, {}
  local pending, np = {}, 0
  for j = 1, n do
    if not recs[j] then
      np = np + 1
      pending[np] = reqs[j]
    end
  end
  LL.batch = true
  for b = cur, cur - span, -1 do
    if np == 0 then break end
    local key = P .. 'sticky:' .. int(b)
    -- A bucket that has expired (or never was) is skipped with one EXISTS, not K lookups.
    if redis.call('EXISTS', key) == 1 then
      local got = hmget(key, pending, np)
      local left, nl = {}, 0
      for j = 1, np do
        local r = pending[j]
        if got[j] then
          sid[r], sb[r] = got[j], b
        elseif sid[r] == nil then
          nl = nl + 1
          left[nl] = r
        end
      end
      pending, np = left, nl
    end
  end
  local member = {} -- server id -> its pool sorted set, or false (pool is fixed during acquire)
  local function pool(id)
    local zs = member[id]
    if zs == nil then
      zs = pool_of(id) or false
      member[id] = zs
    end
    return zs
  end

  -- With no replica taking new sessions, refuse the whole batch unless each request is a
  -- retry or sticky to a pool member (a draining one), before anything is written.
  if not load_peek() then
    for j = 1, n do
      if not recs[j] and not (sid[reqs[j]] and pool(sid[reqs[j]])) then
        return redis.error_reply('NOSERVERS no replica is accepting new sessions')
      end
    end
  end

  local out, no = {}, 0
  local at = int(now)
  local granted_tok = {} -- tokens granted earlier in this batch -> lease record
  local lease_kv, owned_kv, nl = {}, {}, 0
  local held, held_ids, acquires = {}, {}, {} -- per replica: {expiry, token, ...}, count
  local byreq, byreq_f = {}, {} -- request index field -> new tokens, in first-seen order
  local hits, hit_ids, meta = {}, {}, {}
  local sticky_kv, ns = {}, 0
  local sticky_del = {} -- bucket -> request ids that left it
  local sdelta, skeys = {}, {} -- bucket -> replica -> change in its session count
  local function sticky_count(b, id, d)
    local per = sdelta[b]
    if not per then
      per = {}
      sdelta[b] = per
      skeys[#skeys + 1] = b
    end
    per[id] = (per[id] or 0) + d
  end
  for j = 1, n do
    local i = HEAD + 1 + (j - 1) * stride
    local req, token = reqs[j], toks[j]
    local id, how
    local rec = granted_tok[token] or recs[j]
    if rec then
      id, how = server_of(rec), 2
    else
      local old, ob = sid[req], sb[req]
      local zs = old and pool(old)
      if zs then
        id, how = old, 1
        hits[id] = (hits[id] or 0) + 1
        if hits[id] == 1 then hit_ids[#hit_ids + 1] = id end
      else
        zs, how, id = LOAD, 0, choose(i)
      end
      local score = redis.call('ZINCRBY', zs, '1', id)
      if zs == LOAD then load_incremented(score, id) end
      local field = id .. SEP .. req
      granted_tok[token] = field
      lease_kv[nl + 1], lease_kv[nl + 2] = token, field .. SEP .. holder
      owned_kv[nl + 1], owned_kv[nl + 2], nl = at, token, nl + 2
      local h = held[id]
      if not h then
        h = {}
        held[id], acquires[id] = h, 0
        held_ids[#held_ids + 1] = id
      end
      local c = acquires[id]
      h[2 * c + 1], h[2 * c + 2], acquires[id] = at, token, c + 1
      local t = byreq[field]
      if t then
        byreq[field] = t .. ' ' .. token
      else
        byreq[field] = token
        byreq_f[#byreq_f + 1] = field
      end
      -- Sticky sessions live in time buckets of `width` ms; an entry moves to the newest bucket
      -- on each turn and a bucket expires `ttl` ms after its end, so a session outlives its
      -- last turn by ttl .. ttl + width (sliding TTL at the memory cost of a plain hash field).
      if not (ob == cur and old == id) then
        if ob then
          if ob ~= cur then
            local d = sticky_del[ob]
            if not d then
              d = {}
              sticky_del[ob] = d
            end
            d[#d + 1] = req
          end
          sticky_count(ob, old, -1)
        end
        sticky_kv[ns + 1], sticky_kv[ns + 2], ns = req, id, ns + 2
        sticky_count(cur, id, 1)
        sid[req], sb[req] = id, cur
      end
      if granted then granted(i, id, token) end
    end
    local m = meta[id]
    if m == nil then
      m = redis.call('HGET', P .. 'servers', id)
      meta[id] = m
    end
    out[no + 1], out[no + 2], out[no + 3], no = id, m, how, no + 3
  end

  -- The writes that commute, grouped: lease records, the request index, sticky buckets, stats.
  if nl > 0 then
    flat_call('HSET', P .. 'leases', lease_kv)
    flat_call('ZADD', P .. 'owned:' .. holder, owned_kv)
    for _, id in ipairs(held_ids) do
      flat_call('ZADD', P .. 'held:' .. id, held[id])
      redis.call('HINCRBY', P .. 'acquires', id, int(acquires[id]))
    end
    local prev = hmget(P .. 'byreq', byreq_f, #byreq_f)
    local kv = {}
    for k, field in ipairs(byreq_f) do
      kv[2 * k - 1] = field
      kv[2 * k] = prev[k] and (prev[k] .. ' ' .. byreq[field]) or byreq[field]
    end
    flat_call('HSET', P .. 'byreq', kv)
  end
  for _, id in ipairs(hit_ids) do redis.call('HINCRBY', P .. 'sticky_hits', id, int(hits[id])) end
  for b, gone in pairs(sticky_del) do flat_call('HDEL', P .. 'sticky:' .. int(b), gone) end
  if ns > 0 then
    local curs = int(cur)
    local key, nkey = P .. 'sticky:' .. curs, P .. 'stickyn:' .. curs
    flat_call('HSET', key, sticky_kv)
    local fresh = false
    for _, b in ipairs(skeys) do
      local nb = P .. 'stickyn:' .. int(b)
      for id, d in pairs(sdelta[b]) do
        local v = redis.call('HINCRBY', nb, id, int(d))
        if b == cur and d > 0 and v == d then fresh = true end
      end
    end
    if fresh then
      local expire_at = int((cur + 1) * width + ttl)
      redis.call('PEXPIREAT', key, expire_at)
      redis.call('PEXPIREAT', nkey, expire_at)
    end
  end
  return out
end
