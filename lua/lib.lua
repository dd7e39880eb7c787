-- lib.lua: helpers shared by every script. The loader prepends this file to each script, so
-- there is one copy of the lease and sticky logic. It reads KEYS[1] only.
--
-- Key schema (P = KEYS[1] = "rr:{NAME}:"; every key shares the hash tag {NAME}, I7):
--   P.."servers"        HASH  server id -> JSON metadata (the pool)
--   P.."load"           ZSET  server id -> in-flight count, replicas that take new sessions
--   P.."draining"       ZSET  server id -> in-flight count, replicas that only serve sticky ones
--   P.."held:"..id      ZSET  lease token -> expiry (ms, Redis clock): the leases on one replica
--   P.."leases"         HASH  lease token -> id.."\31"..request id
--   P.."byreq"          HASH  id.."\31"..request id -> lease tokens, space separated
--   P.."due"            ZSET  server id -> lower bound of its earliest lease expiry
--   P.."sticky:"..b     HASH  request id -> server id, sessions last seen in time bucket b
--   P.."stickyn:"..b    HASH  server id -> sessions in bucket b (expires with it)
--   P.."acquires", P.."sticky_hits", P.."reclaimed"   HASH  server id -> counter
--   P.."config"         HASH  settings pinned by the first process (sticky_ttl_ms)
--   P.."weights"        HASH  lease token -> weight, for routers that weigh requests (tokens)
--   P.."weighted"       ZSET  server id -> sum of the weights of its leases
-- Invariant I1: ZSCORE load|draining id == ZCARD held:id, always, after every script.

local P = KEYS[1]
local SEP = '\31'

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

local function server_of(rec)
  return string.sub(rec, 1, string.find(rec, SEP, 1, true) - 1)
end

-- Remove token from the request index (field = id..SEP..request id).
local function forget_token(field, token)
  local toks = redis.call('HGET', P .. 'byreq', field)
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

-- Delete one lease's records, and its weight if it has one. The caller adjusts the count (I1).
-- Every script that ends leases goes through here, so weighted loads stay exact too.
local function drop_lease(id, token)
  local rec = redis.call('HGET', P .. 'leases', token)
  if rec then
    redis.call('HDEL', P .. 'leases', token)
    forget_token(rec, token)
    local w = redis.call('HGET', P .. 'weights', token)
    if w then
      redis.call('HDEL', P .. 'weights', token)
      redis.call('ZINCRBY', P .. 'weighted', -tonumber(w), id)
    end
  end
  redis.call('ZREM', P .. 'held:' .. id, token)
end

-- Reclaim at most `budget` expired leases, each exactly once (I2). Returns how many.
local function reap(now, budget)
  local n = 0
  while n < budget do
    local due = redis.call('ZRANGEBYSCORE', P .. 'due', '-inf', now, 'LIMIT', 0, 1)
    if #due == 0 then break end
    local id = due[1]
    local held = P .. 'held:' .. id
    local gone = redis.call('ZRANGEBYSCORE', held, '-inf', now, 'LIMIT', 0, budget - n)
    if #gone > 0 then
      for _, token in ipairs(gone) do drop_lease(id, token) end
      n = n + #gone
      local zs = pool_of(id)
      if zs then redis.call('ZINCRBY', zs, -#gone, id) end
      redis.call('HINCRBY', P .. 'reclaimed', id, #gone)
    end
    local first = redis.call('ZRANGE', held, 0, 0, 'WITHSCORES')
    if #first == 0 then
      redis.call('ZREM', P .. 'due', id)
    else
      redis.call('ZADD', P .. 'due', first[2], id)
    end
  end
  return n
end

-- Sticky sessions live in time buckets of `width` ms; an entry moves to the newest bucket on
-- each turn and a bucket expires `ttl` ms after its end, so a session outlives its last turn
-- by ttl .. ttl + width (sliding TTL at the memory cost of a plain hash field).
local function sticky_find(req, cur, span)
  for b = cur, cur - span, -1 do
    local id = redis.call('HGET', P .. 'sticky:' .. b, req)
    if id then return id, b end
  end
  return nil, nil
end

local function sticky_put(req, id, cur, width, ttl, old_id, old_b)
  if old_b == cur and old_id == id then return end
  if old_b then
    redis.call('HDEL', P .. 'sticky:' .. old_b, req)
    redis.call('HINCRBY', P .. 'stickyn:' .. old_b, old_id, -1)
  end
  local key, nkey = P .. 'sticky:' .. cur, P .. 'stickyn:' .. cur
  redis.call('HSET', key, req, id)
  if redis.call('HINCRBY', nkey, id, 1) == 1 then
    local expire_at = (cur + 1) * width + ttl
    redis.call('PEXPIREAT', key, expire_at)
    redis.call('PEXPIREAT', nkey, expire_at)
  end
end

-- Least in-flight among the replicas that take new sessions; ties broken uniformly by the
-- client-supplied integer `rand` (I4; never the Lua RNG, see DESIGN.md). O(log N).
local function least_loaded(rand)
  local first = redis.call('ZRANGE', P .. 'load', 0, 0, 'WITHSCORES')
  if #first == 0 then return nil end
  local ties = redis.call('ZCOUNT', P .. 'load', first[2], first[2])
  local r = rand % ties
  if r == 0 then return first[1] end
  return redis.call('ZRANGE', P .. 'load', r, r)[1]
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

-- The acquire procedure every router shares (the core's acquire.lua and plugins' scripts).
-- ARGV[1] lease ttl (ms), ARGV[2] sticky bucket width (ms), ARGV[3] sticky ttl (ms),
-- ARGV[4] buckets to search back, ARGV[5] router flag (core: 1 = full_determinism),
-- ARGV[6] reap budget; then `stride` arguments per request starting at ARGV[7]: request id,
-- lease token, random integer, then the router's own.
-- choose(i) picks the replica for a new session whose arguments start at ARGV[i] (nil: none);
-- granted(i, id, token), if given, runs after each new lease (to weigh it, record blocks...).
-- Returns a flat array: per request, server id, JSON metadata, and 0 = balanced, 1 = sticky,
-- 2 = retry of a granted token; or the error NOSERVERS before anything is written.
local function acquire_all(stride, choose, granted)
  local lease_ms, width, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
  local span, budget = tonumber(ARGV[4]), tonumber(ARGV[6])
  local now = now_ms()
  local cur = math.floor(now / width)
  reap(now, budget)

  -- With no replica taking new sessions, refuse the whole batch unless each request is a
  -- retry or sticky to a pool member (a draining one), before anything is written.
  if redis.call('EXISTS', P .. 'load') == 0 then
    for i = 7, #ARGV, stride do
      if redis.call('HEXISTS', P .. 'leases', ARGV[i + 1]) == 0 then
        local sid = sticky_find(ARGV[i], cur, span)
        if not (sid and pool_of(sid)) then
          return redis.error_reply('NOSERVERS no replica is accepting new sessions')
        end
      end
    end
  end

  local out = {}
  local expires = now + lease_ms
  for i = 7, #ARGV, stride do
    local req, token = ARGV[i], ARGV[i + 1]
    local id, how
    local rec = redis.call('HGET', P .. 'leases', token)
    if rec then
      id, how = server_of(rec), 2
    else
      local sid, sb = sticky_find(req, cur, span)
      local zs = sid and pool_of(sid)
      if zs then
        id, how = sid, 1
        redis.call('HINCRBY', P .. 'sticky_hits', id, 1)
      else
        zs, how, id = P .. 'load', 0, choose(i)
      end
      redis.call('ZINCRBY', zs, 1, id)
      redis.call('ZADD', P .. 'held:' .. id, expires, token)
      redis.call('ZADD', P .. 'due', 'LT', expires, id)
      local field = id .. SEP .. req
      redis.call('HSET', P .. 'leases', token, field)
      local toks = redis.call('HGET', P .. 'byreq', field)
      redis.call('HSET', P .. 'byreq', field, toks and (toks .. ' ' .. token) or token)
      sticky_put(req, id, cur, width, ttl, sid, sb)
      redis.call('HINCRBY', P .. 'acquires', id, 1)
      if granted then granted(i, id, token) end
    end
    out[#out + 1] = id
    out[#out + 1] = redis.call('HGET', P .. 'servers', id)
    out[#out + 1] = how
  end
  return out
end
