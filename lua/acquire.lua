-- acquire.lua: route one or more requests and take a lease for each, atomically.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  lease ttl (ms)            ARGV[2]  sticky bucket width (ms)
-- ARGV[3]  sticky ttl (ms)           ARGV[4]  buckets to search back
-- ARGV[5]  1 = full_determinism      ARGV[6]  reap budget (expired leases reclaimed first)
-- ARGV[7..] triples: request id, lease token (client-made, unique), random integer (tie-break)
-- Returns  flat array: per request, server id, its JSON metadata (or false), and
--          0 = balanced, 1 = sticky hit, 2 = retry of a token already granted (not counted twice).
-- Error    "NOSERVERS ..." when some request has no replica to go to; nothing is written then.
-- Keeps    I1 (count +1 with lease), I3 (sticky first while in pool), I4 (least loaded, client
--          entropy), I5 (rendezvous), I6 (only pool members chosen), I7 (keys from KEYS[1]).
local lease_ms, width, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local span, deterministic, budget = tonumber(ARGV[4]), ARGV[5] == '1', tonumber(ARGV[6])
local now = now_ms()
local cur = math.floor(now / width)
reap(now, budget)

-- With no replica taking new sessions, refuse the whole batch unless each request is a retry
-- or sticky to a pool member (a draining one), before anything is written.
if redis.call('EXISTS', P .. 'load') == 0 then
  for i = 7, #ARGV, 3 do
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
for i = 7, #ARGV, 3 do
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
      zs, how = P .. 'load', 0
      if deterministic then id = rendezvous(req) else id = least_loaded(tonumber(ARGV[i + 2])) end
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
  end
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', P .. 'servers', id)
  out[#out + 1] = how
end
return out
