-- renew.lua: restart a lease's age, for a request that may run longer than max_lease_age, and
-- optionally set its weight to what remains of its work (a weighing policy's progress report).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  lease token
-- ARGV[2]  optional: the lease's new weight, an integer >= 0 (absent: the weight is kept).
--          An absolute value, not a change, so a resent renew sets the same weight again.
-- Returns  1 if renewed, 0 if the lease is gone (released or reclaimed): nothing is written.
-- Keeps    I1 (no count changes), and P.."weighted" == the sum of each replica's lease weights:
--          the record, P.."weighted" and P.."wscore" (while it exists, as end_lease) change by
--          the same amount in this one script. Liveness is the holder's heartbeat
--          (heartbeat.lua), not this.
-- Uses     lib/base, lib/admission, lib/leases
local rec = redis.call('HGET', P .. 'leases', ARGV[1])
if not rec then return 0 end
local id, field, holder, w = split_record(rec)
redis.call('ZADD', P .. 'owned:' .. holder, 'XX', int(now_ms()), ARGV[1])
if ARGV[2] then
  local old, new = tonumber(w or 0), tonumber(ARGV[2])
  if new ~= old then
    local nrec = field .. SEP .. holder
    if new > 0 then nrec = nrec .. SEP .. ARGV[2] end
    redis.call('HSET', P .. 'leases', ARGV[1], nrec)
    redis.call('ZINCRBY', P .. 'weighted', int(new - old), id)
    redis.call('ZADD', P .. 'wscore', 'XX', 'INCR', int(new - old), id) -- I12, while it exists
  end
end
return 1
