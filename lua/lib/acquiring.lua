-- lib/acquiring.lua: the acquire procedure every policy shares: retries, sticky sessions,
-- leases, counts (uses base, holders, picking).
-- A new lease's record; a policy that weighs requests adds the weight to it and to the
-- replica's weighted load at once (a batch's later choices see it), and end_lease takes it off.
local function lease_record(cx, policy, i, id, field)
  local holder = cx.holder
  local w = policy.weight and policy.weight(i, cx)
  if not w or w <= 0 then return field .. SEP .. holder end
  w = int(w)
  redis.call('ZINCRBY', P .. 'weighted', w, id)
  redis.call('ZADD', P .. 'wscore', 'XX', 'INCR', w, id) -- engine-aware tokens (lib/scoring)
  return field .. SEP .. holder .. SEP .. w
end

-- The settings an acquire reads are its config (cx.cfg, lib/base.lua config()):
-- - Affinity tolerance (cfg.margin, cfg.ratio; nil = off): a sticky session whose replica
--   takes new sessions is re-pinned by the policy when that replica's in-flight count exceeds
--   the least loaded one's by more than margin requests and is above ratio times it (taken as
--   at least 1); both when both are set. Counted per replica left in P.."repins".
-- - Eviction-aware stickiness (cfg.min_cached, a share in (0, 1]; nil = off), an option of a
--   policy that reads an index of what the replicas' caches hold: a sticky turn whose replica
--   no longer holds that share of the prompt (policy.evicted(i, old, share)) is placed anew by
--   the policy, as a new session would be, and counted as a re-pin when it leaves.
-- - cfg.hold: ejected_sticky = 'wait' (the pinned ejection settings' last field): a sticky
--   session whose replica is ejected is refused (EJECTED) instead of balanced anew, and waits.

-- True when the sticky replica `old` (in P.."load") is too far above the least loaded.
local function overloaded(cx, old)
  local s = redis.call('ZSCORE', LOAD, old)
  if not s then return false end -- draining: it serves its sticky sessions only
  local m
  if cx.engine then -- scores, not counts, and only off a replica whose engine queues requests
    -- (or is past the KV ceiling): a session whose next turn would run at once keeps its cache
    local sc = scoring()
    if not sc.pressed(cx, old) then return false end
    s, m = tonumber(redis.call('ZSCORE', P .. 'escore', old)), sc.level(cx)
    if not (s and m) then return false end
  else
    s = tonumber(s)
    if not cx.ll.min then load_peek(cx) end
    m = cx.ll.min
  end
  local margin, ratio = cx.cfg.margin, cx.cfg.ratio
  return (not margin or s - m > margin) and (not ratio or s > ratio * math.max(m, 1))
end

-- Group affinity (a request's group id, ARGV[i + 3]; "" = none): a new session of a group
-- goes where the group's last member went while that replica takes new sessions and holds
-- fewer than cx.cfg.cap (nil = no cap) members placed there in a row; else the policy
-- places it and the group follows it there. Entries live in time buckets as sticky ones do.
-- groups(cx) makes the call's group state (cx.groups) on its first group, so a call without
-- one makes none of it: group id -> { id, n (members in a row), b (its bucket) }, read once
-- per call, and the writes go at the end (flush), so a batch and one request at a time end
-- the same.
local function groups(cx)
  if cx.groups then return cx.groups end
  local cfg, cur = cx.cfg, cx.cur
  local span, width, ttl, cap = cfg.span, cfg.width_ms, cfg.sticky_ms, cfg.cap
  local state, dirty = {}, {}
  local function of(g)
    local s = state[g]
    if s then return s end
    s = {}
    for b = cur, cur - span, -1 do
      local e = redis.call('HGET', P .. 'group:' .. int(b), g)
      if e then
        local k = string.find(e, SEP, 1, true)
        s.id, s.n, s.b = string.sub(e, 1, k - 1), tonumber(string.sub(e, k + 1)), b
        break
      end
    end
    state[g] = s
    return s
  end
  cx.groups = {
    -- The replica a new member of group g joins, or nil: the policy decides.
    target = function(g)
      local s = of(g)
      if s.id and (not cap or s.n < cap) and redis.call('ZSCORE', LOAD, s.id) then return s.id end
      return nil
    end,
    joined = function(g, id)
      local s = of(g)
      if s.id == id then
        s.n = s.n + 1
      else
        s.id, s.n = id, 1
      end
      if not s.dirty then
        s.dirty = true
        dirty[#dirty + 1] = g
      end
    end,
    -- The groups joined, to the newest bucket (one HSET), out of older ones; a bucket gets
    -- its expiry when a group first enters it.
    flush = function()
      if #dirty == 0 then return end
      local key, kv, fresh = P .. 'group:' .. int(cur), {}, false
      for _, g in ipairs(dirty) do
        local s = state[g]
        if s.b ~= cur then
          fresh = true
          if s.b then redis.call('HDEL', P .. 'group:' .. int(s.b), g) end
        end
        kv[#kv + 1], kv[#kv + 2] = g, s.id .. SEP .. int(s.n)
      end
      flat_call('HSET', key, kv)
      if fresh then redis.call('PEXPIREAT', key, int((cur + 1) * width + ttl)) end
    end,
  }
  return cx.groups
end

-- One request (the common case): the straight sequential procedure, without the batch's
-- tables. Its arguments start at ARGV[i]; the caller made the context (now, cur, holder).
local function acquire_one(cx, i, policy)
  local cfg, now, cur, seat = cx.cfg, cx.now, cx.cur, cx.seat
  local width, ttl, span = cfg.width_ms, cfg.sticky_ms, cfg.span
  local req, token = ARGV[i], ARGV[i + 1]
  local rec = redis.call('HGET', P .. 'leases', token)
  if rec then
    local id = server_of(rec)
    return { id, redis.call('HGET', P .. 'servers', id), 2 }
  end
  local old, ob
  for b = cur, seat and seat.lo or cur - span, -1 do
    old = redis.call('HGET', P .. 'sticky:' .. int(b), req)
    if old then
      ob = b
      break
    end
  end
  -- A sticky replica is counted where it is (ZADD XX INCR is a no-op outside the set), so a
  -- sticky hit needs no membership lookup; only a new session needs the NOSERVERS check.
  local id, how, stay = old, 1, old
  local moved = old and (cfg.margin or cfg.ratio) and overloaded(cx, old)
  local share = policy.evicted and cfg.min_cached
  if old and not moved and share and policy.evicted(i, old, share, cx) then
    moved = pool_of(old) ~= nil -- (a replica out of the pool loses its sessions anyway)
  end
  if moved then stay = nil end
  if not (stay and redis.call('ZADD', LOAD, 'XX', 'INCR', '1', old)) then
    if not (stay and redis.call('ZADD', P .. 'draining', 'XX', 'INCR', '1', old)) then
      local excl = cx.excl
      local held = cfg.hold and old and not (excl and excl.set[old]) and admit().held(old, now)
      if held then return held end
      -- (engine-aware, the pick reads scores, not counts: no replica to pick is refused below)
      if not (cx.engine or cx.ll.min) and not load_peek(cx) then return admit().refused(cx) end
      local g = not moved and ARGV[i + 3]
      if g == '' then g = nil end
      local grp = g and groups(cx)
      id, how = grp and grp.target(g) or policy.choose(i, cx), 0
      if not id then return admit().refused(cx) end
      redis.call('ZINCRBY', LOAD, '1', id)
      if moved and id ~= old then redis.call('HINCRBY', P .. 'repins', old, '1') end
      if grp then
        grp.joined(g, id)
        grp.flush()
      end
    end
  end
  if cx.engine then redis.call('ZADD', P .. 'escore', 'XX', 'INCR', '1', id) end
  if cx.caps then admit().filled(id) end
  local at = int(now)
  redis.call('ZADD', P .. 'held:' .. id, at, token)
  redis.call('ZADD', P .. 'owned:' .. cx.holder, at, token)
  local field = id .. SEP .. req
  redis.call('HSET', P .. 'leases', token, lease_record(cx, policy, i, id, field))
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
    if seat and old ~= id then -- the replicas' pinned sessions (lib/picking)
      if old then redis.call('HINCRBY', P .. 'pinned', old, '-1') end
      redis.call('HINCRBY', P .. 'pinned', id, '1')
    end
  end
  redis.call('HINCRBY', P .. 'acquires', id, '1')
  if how == 1 then redis.call('HINCRBY', P .. 'sticky_hits', id, '1') end
  if policy.granted then policy.granted(i, id, token, cx) end
  return { id, redis.call('HGET', P .. 'servers', id), how }
end

-- A batch (more than one request in a call) goes in three steps, each a procedure over the
-- call's context and the batch's state B: batch_read reads up front what the requests need
-- (their tokens' leases, their sticky entries), batch_route routes each request in order (its
-- replica and count, at once; the writes that commute, kept in B), batch_write makes those
-- writes, grouped. The
-- result and the final state are those of acquiring the requests one after another; a
-- refusal (batch_refusal) comes before anything is written.

-- Read up front: the leases of the tokens (retries) and the sticky entries of the requests,
-- newest bucket first: B.recs[j] (or nil), B.sid / B.sb: request id -> replica / bucket.
local function batch_read(cx, stride)
  local cur, seat = cx.cur, cx.seat
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
  cx.ll.batch = true
  for b = cur, seat and seat.lo or cur - cx.cfg.span, -1 do
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
  return { n = n, reqs = reqs, toks = toks, recs = recs, sid = sid, sb = sb, member = {} }
end

-- The pool sorted set that holds replica id's count, or false (the pool is fixed during an
-- acquire: each replica is looked up once per batch).
local function batch_pool(B, id)
  local zs = B.member[id]
  if zs == nil then
    zs = pool_of(id) or false
    B.member[id] = zs
  end
  return zs
end

-- The reply that refuses the whole batch, or nil; asked before anything is written.
local function batch_refusal(cx, B)
  local n, reqs, recs, sid = B.n, B.reqs, B.recs, B.sid
  -- A session held by its ejected replica (ejected_sticky = 'wait') refuses the whole batch.
  if cx.cfg.hold then
    local excl = cx.excl
    for j = 1, n do
      local old = not recs[j] and sid[reqs[j]]
      local held = old and not (excl and excl.set[old]) and admit().held(old, cx.now)
      if held then return admit().readmit(cx, held) end
    end
  end

  -- With no replica taking new sessions, refuse the whole batch unless each request is a
  -- retry or sticky to a pool member (a draining one).
  if not load_peek(cx) then
    for j = 1, n do
      if not recs[j] and not (sid[reqs[j]] and batch_pool(B, sid[reqs[j]])) then
        return admit().readmit(cx, admit().refused(cx))
      end
    end
  end
  return nil
end

-- Bucket b's session count of replica id changes by d (written at the end, per bucket).
local function batch_count(B, b, id, d)
  local per = B.sdelta[b]
  if not per then
    per = {}
    B.sdelta[b] = per
    B.skeys[#B.skeys + 1] = b
  end
  per[id] = (per[id] or 0) + d
end

-- Route each request in order: a retry gets its lease's replica, a sticky session its
-- replica (unless affinity moves it), a new one the group's or the policy's choice; counts
-- move at once (later choices see them), the rest is kept in B for batch_write. B.out is the
-- reply: per request, server id, metadata, how.
local function batch_route(cx, B, policy, stride)
  local cfg, cur, now, seat = cx.cfg, cx.cur, cx.now, cx.seat
  local n, reqs, toks, recs, sid, sb = B.n, B.reqs, B.toks, B.recs, B.sid, B.sb
  local share = policy.evicted and cfg.min_cached
  local out, no = {}, 0
  local at = int(now)
  local granted_tok = {} -- tokens granted earlier in this batch -> lease record
  local lease_kv, owned_kv, nl = {}, {}, 0
  local held, held_ids, acquires = {}, {}, {} -- per replica: {acquired at, token, ...}, count
  local byreq, byreq_f = {}, {} -- request index field -> new tokens, in first-seen order
  local hits, hit_ids, meta, meta_ids = {}, {}, {}, {} -- meta: server id -> metadata
  local sticky_kv, ns = {}, 0
  local sticky_del = {} -- bucket -> request ids that left it
  B.sdelta, B.skeys = {}, {} -- bucket -> replica -> change in its session count
  for j = 1, n do
    local i = HEAD + 1 + (j - 1) * stride
    local req, token = reqs[j], toks[j]
    local id, how
    local rec = granted_tok[token] or recs[j]
    if rec then
      id, how = server_of(rec), 2
    else
      local old, ob = sid[req], sb[req]
      local zs = old and batch_pool(B, old)
      local moved = zs == LOAD and (cfg.margin or cfg.ratio) and overloaded(cx, old)
      if zs and not moved and share then moved = policy.evicted(i, old, share, cx) end
      if moved then zs = nil end
      if zs then
        id, how = old, 1
        hits[id] = (hits[id] or 0) + 1
        if hits[id] == 1 then hit_ids[#hit_ids + 1] = id end
      else
        local g = not moved and ARGV[i + 3]
        if g == '' then g = nil end
        local grp = g and groups(cx)
        zs, how, id = LOAD, 0, grp and grp.target(g) or policy.choose(i, cx)
        if moved and id ~= old then redis.call('HINCRBY', P .. 'repins', old, '1') end
        if grp then grp.joined(g, id) end
      end
      local score = redis.call('ZINCRBY', zs, '1', id)
      if zs == LOAD then load_incremented(cx, score, id) end
      if cx.engine then redis.call('ZADD', P .. 'escore', 'XX', 'INCR', '1', id) end
      if cx.caps and admit().filled(id) then B.member[id], cx.ll.min = false, nil end
      local field = id .. SEP .. req
      granted_tok[token] = field
      lease_kv[nl + 1], lease_kv[nl + 2] = token, lease_record(cx, policy, i, id, field)
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
          batch_count(B, ob, old, -1)
        end
        sticky_kv[ns + 1], sticky_kv[ns + 2], ns = req, id, ns + 2
        batch_count(B, cur, id, 1)
        if seat and old ~= id then -- the replicas' pinned sessions, at the end (lib/picking)
          local d = seat.d
          if old then d[old] = (d[old] or 0) - 1 end
          d[id] = (d[id] or 0) + 1
        end
        sid[req], sb[req] = id, cur
      end
      if policy.granted then policy.granted(i, id, token, cx) end
    end
    if meta[id] == nil then
      meta[id] = false
      meta_ids[#meta_ids + 1] = id
    end
    out[no + 1], out[no + 2], out[no + 3], no = id, false, how, no + 3
  end
  -- The replicas' metadata, one HMGET for the batch (a removed replica's is false).
  local got = hmget(P .. 'servers', meta_ids, #meta_ids)
  for k, id in ipairs(meta_ids) do meta[id] = got[k] or false end
  for k = 1, no, 3 do out[k + 1] = meta[out[k]] end
  B.out, B.lease_kv, B.owned_kv, B.nl = out, lease_kv, owned_kv, nl
  B.held, B.held_ids, B.acquires, B.byreq, B.byreq_f = held, held_ids, acquires, byreq, byreq_f
  B.hits, B.hit_ids, B.sticky_kv, B.ns, B.sticky_del = hits, hit_ids, sticky_kv, ns, sticky_del
end

-- The writes that commute, grouped: lease records, the request index, sticky buckets, stats.
local function batch_write(cx, B)
  local holder, cur, seat = cx.holder, cx.cur, cx.seat
  local width, ttl = cx.cfg.width_ms, cx.cfg.sticky_ms
  local lease_kv, owned_kv, nl, held, held_ids = B.lease_kv, B.owned_kv, B.nl, B.held, B.held_ids
  local acquires, byreq, byreq_f, hits, hit_ids = B.acquires, B.byreq, B.byreq_f, B.hits, B.hit_ids
  local sticky_kv, ns, sticky_del, sdelta, skeys = B.sticky_kv, B.ns, B.sticky_del, B.sdelta,
    B.skeys
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
  if cx.groups then cx.groups.flush() end
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
    for id, d in pairs(seat and seat.d or {}) do
      if d ~= 0 then redis.call('HINCRBY', P .. 'pinned', id, int(d)) end
    end
  end
end

-- The acquire procedure every router shares (the core's acquire.lua and plugins' scripts).
-- ARGV[1] the balancer's settings (lib/base.lua config()), ARGV[2] holder (its heartbeat
-- deadline is pushed to now + its lease ttl), ARGV[3] waiting ticket ("" = none), ARGV[4]
-- exclusion (server ids joined by SEP, "" = none: lib/admission exclude());
-- then `stride` arguments per request starting at ARGV[HEAD + 1]: request id, lease token,
-- random integer, group id ("" = none), then the router's own from ARGV[i + OWN].
-- `policy` is the routing policy's Lua side, a table of functions of the ARGV index i where a
-- request's arguments start and of the call's context cx (lib/base.lua; a policy passes it on
-- to the procedures it calls, least_loaded(cx, rand)): choose(i, cx) picks the replica for a
-- new session (nil: none); evicted(i, old, share, cx), if given, says whether replica `old`
-- of a sticky request no longer holds `share` of its prompt (asked only while it is on);
-- weight(i, cx), if given, is the request's weight (a number >= 0) for the replica's weighted
-- load; granted(i, id, token, cx), if given, runs after each new lease is counted (its
-- replica's count is already +1; the lease records themselves are written when the whole
-- batch is routed).
-- Returns a flat array: per request, server id, JSON metadata, and 0 = balanced, 1 = sticky,
-- 2 = retry of a granted token; or the error NOSERVERS or NOCAPACITY (refused; CONFIGMISMATCH:
-- this process's pinned settings are not the pinned ones) before anything is written (a
-- call whose exclusion leaves no replica to go to is refused alike: lib/admission refused()).
-- Capacity: an acquire that fills a replica takes it off (filled), so no later pick, sticky
-- or new, reaches it until a lease there ends; a batch's cached level (cx.ll) and pool lookups
-- forget it at once.
-- The result and the final state are those of acquiring the requests one after another: a
-- lone request by acquire_one, a batch in the steps above (its lookups read up front, one
-- HMGET per key, and the writes that commute grouped per replica at the end, so a batch of K
-- costs a few calls per request, not ~20).
local function acquire_all(stride, policy)
  local cfg, holder = config(ARGV[1]), ARGV[2]
  local width, ttl, span = cfg.width_ms, cfg.sticky_ms, cfg.span
  local now = now_ms()
  local cur = math.floor(now / width)
  -- The call's context (lib/base.lua): everything of this call the procedures read or keep.
  -- Its least-loaded level cache (lib/picking) is made with its fields, so filling them
  -- never grows the table.
  local cx = { cfg = cfg, holder = holder, now = now, cur = cur,
    ll = { min = false, mins = false, first = false, ties = false, level = false } }
  CALL = cx
  -- An acquire is a heartbeat of its holder, and reaps nothing: the holders' keepers do,
  -- in short calls of their own, so no acquire is slowed by another process's crash.
  local mismatch = heartbeat(holder, now, cfg.lease_ms, cfg)
  if mismatch then return mismatch end
  -- spread_sessions (pinned): new sessions' ties go to the fewest pinned sessions
  -- (lib/picking). Lookups then stop at the oldest live sticky bucket (bucket b expires at
  -- (b + 1) * width + ttl), so an entry at its very expiry is neither found nor counted.
  if cfg.spread then
    cx.seat = { lo = math.max(cur - span, math.floor((now - ttl) / width)), d = {} }
  end
  -- Engine-aware scoring (lib/scoring.lua), pinned as the other settings.
  if cfg.engine then
    cx.engine = cfg.engine
    scoring().ready(cx)
  end
  -- Health and admission (lib/admission.lua): free while no ejection is due, no replica declares
  -- a capacity and nobody waits.
  if cfg.ejection then
    if redis.call('ZRANGEBYSCORE', P .. 'ejected', '-inf', int(now), 'LIMIT', '0', '1')[1] then
      admit().restore_due(now)
    end
  end
  if redis.call('EXISTS', P .. 'capacity', P .. 'waiters') > 0 then
    local refusal = admit().admission(cx, stride)
    if refusal then return refusal end
  end
  -- The caller's exclusion (lib/admission exclude()), once admission has put back what
  -- returns; every return from here on puts the excluded replicas back first.
  if ARGV[HEAD] ~= '' then
    if cx.engine then scoring().level(cx) end -- scores are made from the sets: made now, whole
    admit().exclude(cx, ARGV[HEAD])
  end
  local out
  if #ARGV == HEAD + stride then
    out = acquire_one(cx, HEAD + 1, policy)
  else
    local B = batch_read(cx, stride)
    local refusal = batch_refusal(cx, B)
    if refusal then return refusal end
    batch_route(cx, B, policy, stride)
    batch_write(cx, B)
    out = B.out
  end
  if cx.excl then admit().readmit(cx) end
  return cx.ticket and admit().served(cx, out) or out
end
