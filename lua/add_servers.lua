-- add_servers.lua: register replicas (idempotent) and put new ones into rotation at once.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     pairs: server id, JSON metadata
-- Returns  how many ids were new to the pool (they start at 0 in `load` and `weighted`).
-- Keeps    I1 (an existing replica keeps its count and leases, a new one starts at 0), and its
--          draining state, if any.
-- Uses     lib/base
local added = 0
for i = 1, #ARGV, 2 do
  redis.call('HSET', P .. 'servers', ARGV[i], ARGV[i + 1])
  if not pool_of(ARGV[i]) then
    redis.call('ZADD', P .. 'load', 0, ARGV[i])
    redis.call('ZADD', P .. 'weighted', 'NX', 0, ARGV[i])
    added = added + 1
  end
end
return added
