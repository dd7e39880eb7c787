-- acquire.lua: route one or more requests and take a lease for each, atomically.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  lease ttl (ms): the holder's heartbeat deadline moves to now + this
-- ARGV[2]  sticky bucket width (ms)  ARGV[3]  sticky ttl (ms), checked against the pinned one
-- ARGV[4]  buckets to search back    ARGV[5]  1 = full_determinism    ARGV[6]  holder (its
--          heartbeat)   ARGV[7..15]  affinity margin, ratio, group cap, group_by, ejection,
--          ticket, engine scoring, spread_sessions, exclusion: server ids no request of the
--          call may go to (lib/acquiring)   ARGV[16..] quads: request id, lease token
--          (client-made, unique), random integer, group id
-- Returns  flat array: per request, server id, its JSON metadata (or false), and 0 = balanced,
--          1 = sticky hit, 2 = retry of a token already granted (not counted twice).
-- Keeps    I1 (count +1 with lease), I3 (sticky first while in pool), I4 (least loaded, client
--          entropy), I5 (rendezvous), I6 (only pool members chosen, never an excluded one,
--          sticky or new), I7 (keys from KEYS[1]).
--          The procedure itself is acquire_all in lib/acquiring.lua, shared with every
--          routing policy's script; this one is the default policy, least loaded.
-- Error    "NOSERVERS ..." when some request has no replica to go to, "CONFIGMISMATCH <field>
--          <pinned>" when another process pinned other settings; nothing of the requests is
--          written then (the holder's heartbeat is: it came first).
-- Uses     lib/base, lib/holders, lib/admission, lib/picking, lib/acquiring
local deterministic = ARGV[5] == '1'
return acquire_all(OWN, {
  choose = function(i)
    if deterministic then return rendezvous(ARGV[i]) end
    return least_loaded(tonumber(ARGV[i + 2]))
  end,
})
