-- heal.lua: repair what an evicting maxmemory-policy (or a key deleted by hand) breaks, a few
-- entries per call.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  budget: most entries to examine in each of the three parts below
-- ARGV[2]  the calling holder, whose own lease set is checked
-- Returns  { entries dropped (pointing at a lease record that is gone), counts set right }.
-- Keeps    I1, I2: with `noeviction` (the documented policy) nothing here changes anything.
--          An evicting policy (allkeys-*) may drop P.."leases" while P.."load", the replicas'
--          P.."held:"..id, P.."byreq" and the holders' P.."owned:"..h survive, leaving counts
--          and index entries that no lease backs, which neither a release nor a reap can end.
--          Every lease changes in one script, its record with its entries, so an entry
--          without a record seen here is never a lease in the making: it is dropped, and a
--          replica's count is set to the leases it holds. Parts: a few replicas (HSCAN of
--          P.."servers"), a few request index entries (HSCAN of P.."byreq"), both from
--          cursors shared by every process in P.."heal"; and the caller's own lease set.
-- Uses     lib/base, lib/admission
local budget, holder = tonumber(ARGV[1]), ARGV[2]
local dropped, fixed = 0, 0
local cursors = redis.call('HMGET', P .. 'heal', 'servers', 'byreq')

-- Replicas: their entries whose record is gone, and their counts.
local scan = redis.call('HSCAN', P .. 'servers', cursors[1] or '0', 'COUNT', '8')
local seen = 0
for k = 1, #scan[2], 2 do
  local id = scan[2][k]
  local held = P .. 'held:' .. id
  local toks = redis.call('ZRANGE', held, '0', int(math.max(budget - seen, 1) - 1))
  seen = seen + #toks + 1
  if #toks > 0 then
    local recs = redis.call('HMGET', P .. 'leases', unpack(toks))
    for j = 1, #toks do
      if not recs[j] or server_of(recs[j]) ~= id then
        redis.call('ZREM', held, toks[j])
        dropped = dropped + 1
      end
    end
  end
  local n = redis.call('ZCARD', held)
  for _, zs in ipairs({ 'load', 'draining', 'off' }) do
    local c = redis.call('ZSCORE', P .. zs, id)
    if c then
      if tonumber(c) ~= n then
        redis.call('ZADD', P .. zs, n, id)
        local e = tonumber(redis.call('HGET', P .. 'eextra', id)) or 0
        redis.call('ZADD', P .. 'escore', 'XX', tostring(n + e), id) -- I12, while it exists
        fixed = fixed + 1
        if zs == 'off' then admit().put_back(id) end
      end
      break
    end
  end
end

-- Request index entries: tokens whose record is gone leave them.
local req = redis.call('HSCAN', P .. 'byreq', cursors[2] or '0', 'COUNT', int(math.min(budget, 64)))
for k = 1, #req[2], 2 do
  local field, kept, lost = req[2][k], {}, 0
  for t in string.gmatch(req[2][k + 1], '%S+') do
    if redis.call('HEXISTS', P .. 'leases', t) == 1 then kept[#kept + 1] = t else lost = lost + 1 end
  end
  if lost > 0 then
    dropped = dropped + lost
    if #kept == 0 then
      redis.call('HDEL', P .. 'byreq', field)
    else
      redis.call('HSET', P .. 'byreq', field, table.concat(kept, ' '))
    end
  end
end
redis.call('HSET', P .. 'heal', 'servers', scan[1], 'byreq', req[1])

-- The caller's own lease set.
local owned = P .. 'owned:' .. holder
local mine = redis.call('ZRANGE', owned, '0', int(budget - 1))
if #mine > 0 then
  local recs = redis.call('HMGET', P .. 'leases', unpack(mine))
  for j = 1, #mine do
    if not recs[j] then
      redis.call('ZREM', owned, mine[j])
      dropped = dropped + 1
    end
  end
end
return { dropped, fixed }
