-- remove_servers.lua: take replicas out of the pool, atomically, with their leases.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     server ids
-- Returns  how many ids were in the pool.
-- Keeps    I6: no later acquire reaches them (their sticky sessions are re-balanced on their
--          next turn) and a late release for them finds no lease: a no-op. I1: their leases
--          and counts go together. Their engine reports (lib/engine.lua) go too.
-- Uses     lib/base, lib/admission, lib/leases
local removed = 0
for _, id in ipairs(ARGV) do
  local held = P .. 'held:' .. id
  for _, token in ipairs(redis.call('ZRANGE', held, 0, -1)) do end_lease(token) end
  redis.call('DEL', held)
  redis.call('ZREM', P .. 'weighted', id)
  redis.call('ZREM', P .. 'escore', id)
  redis.call('HDEL', P .. 'eextra', id)
  redis.call('ZREM', P .. 'wscore', id)
  redis.call('HDEL', P .. 'wextra', id)
  removed = removed + redis.call('ZREM', P .. 'load', id) + redis.call('ZREM', P .. 'draining', id)
    + redis.call('ZREM', P .. 'off', id)
  redis.call('ZREM', P .. 'ejected', id)
  for _, h in ipairs({ 'back', 'capacity', 'eject_why', 'fails', 'failures', 'last_error' }) do
    redis.call('HDEL', P .. h, id)
  end
  redis.call('HDEL', P .. 'ejections', id, id .. SEP .. 't')
  redis.call('HDEL', P .. 'servers', id)
  redis.call('HDEL', P .. 'acquires', id)
  redis.call('HDEL', P .. 'sticky_hits', id)
  redis.call('HDEL', P .. 'reclaimed', id)
  redis.call('HDEL', P .. 'repins', id)
  redis.call('HDEL', P .. 'engine', id)
  redis.call('ZREM', P .. 'engine_at', id)
end
return removed
