-- engine_report.lua: the engines' own load figures (redis-router load), one report per replica.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     quads: server id, running requests, waiting requests, KV-cache usage in
--          thousandths (-1 = unknown); integers, checked by the caller
-- Returns  how many reports were written (ids not in the pool are skipped).
-- Keeps    P.."engine" and P.."engine_at" hold the same ids, all in the pool; stamped with
--          Redis's clock, never the reporter's. I12: with engine-aware scoring pinned, the
--          replica's extra (and its score, while the scores exist) follow the report.
-- Uses     lib/base, lib/engine, lib/scoring
local now = now_ms()
local written = 0
local setting = redis.call('HGET', P .. 'config', 'engine')
local sc = setting and setting ~= '' and scoring()
local cx = {} -- the call's context (lib/base.lua): scoring's caches
if sc then setting = sc.setting(setting) end
for i = 1, #ARGV, 4 do
  local id = ARGV[i]
  if redis.call('HEXISTS', P .. 'servers', id) == 1 then
    engine_store(id, tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), now)
    if sc then
      sc.set_extra(cx, id, sc.extra(redis.call('HGET', P .. 'engine', id), setting, now))
    end
    written = written + 1
  end
end
return written
