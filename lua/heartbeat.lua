-- heartbeat.lua: one balancer instance's periodic keep-alive, sent from the background.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  the balancer's settings, as acquire.lua's (lib/base.lua config()): the holder is
--          alive until now + its lease ttl; its pinned settings are checked against the
--          pinned ones
-- ARGV[2]  holder    ARGV[5]  budget (entries)
-- ARGV[3]  max lease age (ms): this holder's leases acquired (or renewed) longer ago end now
-- ARGV[4]  how long resent releases are recognised (ms)
-- Returns  { 1 if the holder was registered anew (it had been declared dead: its leases were
--          reclaimed), leases of dead holders reclaimed, entries examined for that (the caller
--          goes on with reap.lua while it is the budget), tokens of this holder's leases that
--          outlived max lease age and were ended }; CONFIGMISMATCH as acquire.
-- Keeps    I1, I2: one call keeps every lease of the holder alive however long its requests
--          run; a lease its holder forgot still ends after max lease age; the leases of
--          holders that stopped sending heartbeats while Redis could hear them are
--          reclaimed, at most `budget` per call; after a pause of Redis (a gap in what it
--          heard) the holders unheard during it are on probation, not dead (lib/base.lua).
--          I10, I11: ejections whose time is up end; a dead waiter passes its turn on.
-- Uses     lib/base, lib/holders, lib/admission, lib/leases
local cfg, holder, now = config(ARGV[1]), ARGV[2], now_ms()
local budget = tonumber(ARGV[5])
-- First note that Redis hears heartbeats again (after a pause: every holder unheard during it
-- is on probation, lib/base.lua liveness()).
local horizon = liveness(now, cfg.lease_ms)
local known = redis.call('ZSCORE', P .. 'holders', holder)
local refused = heartbeat(holder, now, cfg.lease_ms, cfg)
if refused then return refused end
-- Ejections whose time is up end even while nobody acquires, and a waiter whose process died
-- passes its turn on (lib/leases.lua).
if cfg.ejection then admit().restore_due(now) end
admit().wake_first()
local owned = P .. 'owned:' .. holder
local overdue = redis.call('ZRANGEBYSCORE', owned, '-inf', int(now - tonumber(ARGV[3])),
  'LIMIT', '0', int(budget))
for _, token in ipairs(overdue) do
  local id = end_lease(token)
  if id then
    redis.call('HINCRBY', P .. 'reclaimed', id, '1')
  else
    redis.call('ZREM', owned, token)
  end
end
rotate_released(now, tonumber(ARGV[4]))
local reclaimed, examined = reap(horizon, budget)
return { known and 0 or 1, reclaimed, examined, overdue }
