-- report.lua: outcomes of health probes (redis-router health), fed to passive health.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     triples: server id, 1 = healthy / 0 = failed, why (a short text)
-- Returns  flat array: per replica in the pool, server id and "ok" | "failing" | "ejected
--          until <ms>"; replicas not in the pool are skipped.
-- Keeps    I10, I11: the same streaks, last errors and ejections as failed requests
--          (lib/health.lua; streaks and last errors with ejection off too); ejections whose
--          time is up end first.
-- Uses     lib/base, lib/admission, lib/leases, lib/health
local now = now_ms()
local cx = {} -- the call's context (lib/base.lua): whether a streak exists
admit().restore_due(now)
local out = {}
for i = 1, #ARGV, 3 do
  local id = ARGV[i]
  if redis.call('HEXISTS', P .. 'servers', id) == 1 then
    if ARGV[i + 1] == '1' then
      health().succeeded(cx, id)
    else
      health().failed(cx, id, 'failed health checks (' .. ARGV[i + 2] .. ')', now, 0,
        'health check: ' .. ARGV[i + 2])
    end
    local til = redis.call('ZSCORE', P .. 'ejected', id)
    out[#out + 1] = id
    out[#out + 1] = til and ('ejected until ' .. til) or (ARGV[i + 1] == '1' and 'ok' or 'failing')
  end
end
return out
