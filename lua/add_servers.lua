-- add_servers.lua: register replicas (idempotent) and put new ones into rotation at once.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     triples: server id, JSON metadata, capacity (requests it can hold; "" = no limit)
-- Returns  how many ids were new to the pool (they start at 0 in `load` and `weighted`).
-- Keeps    I1 (an existing replica keeps its count and leases, a new one starts at 0), and its
--          draining state, if any; I10: a replica at or above its (new) capacity is taken off,
--          one below it returns (unless ejected), and a waiter is woken when one can go.
-- Uses     lib/base, lib/admission, lib/leases
local added = 0
for i = 1, #ARGV, 3 do
  local id, cap = ARGV[i], ARGV[i + 2]
  redis.call('HSET', P .. 'servers', id, ARGV[i + 1])
  if cap == '' then
    redis.call('HDEL', P .. 'capacity', id)
  else
    redis.call('HSET', P .. 'capacity', id, cap)
  end
  if not pool_of(id) and not redis.call('ZSCORE', P .. 'off', id) then
    redis.call('ZADD', P .. 'load', 0, id)
    redis.call('ZADD', P .. 'weighted', 'NX', 0, id)
    for _, zs in ipairs({ 'escore', 'wscore' }) do -- engine-aware scores, while they exist
      if redis.call('EXISTS', P .. zs) == 1 then redis.call('ZADD', P .. zs, 0, id) end
    end
    added = added + 1
    admit().wake_first()
  end
  if not admit().filled(id) then admit().put_back(id) end
end
return added
