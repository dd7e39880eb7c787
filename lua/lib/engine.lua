-- lib/engine.lua: what the engines report of their own load (redis-router load), stored per
-- replica beside the leases this library counts (uses base).
--   P.."engine"     HASH  id -> "<at_ms> <running> <waiting> <kv_permille> <leases_at>":
--                         when Redis stored it (ms), the engine's running and waiting
--                         requests, its KV-cache usage in thousandths (-1: unknown), and the
--                         replica's lease count (its score in load, draining or off) then
--   P.."engine_at"  ZSET  id -> at_ms of its report: the oldest report in O(log N)
-- A report is never expired here: a reader judges its age (a reporter that died leaves it).

-- Store id's report (id a pool member; the figures integers, checked by the caller).
local function engine_store(id, running, waiting, kv, now)
  local leases = redis.call('ZSCORE', P .. 'load', id) or redis.call('ZSCORE', P .. 'draining', id)
    or redis.call('ZSCORE', P .. 'off', id) or 0
  redis.call('HSET', P .. 'engine', id, fmt('%d %d %d %d %d', now, running, waiting, kv, leases))
  redis.call('ZADD', P .. 'engine_at', int(now), id)
end
