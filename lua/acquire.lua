-- acquire.lua: route one or more requests and take a lease for each, atomically.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1]  the balancer's settings, one JSON object by name (lib/base.lua config()): lease
--          ttl, sticky buckets, full_determinism, and the pinned settings, checked against
--          the pinned ones
-- ARGV[2]  holder (its heartbeat)   ARGV[3]  waiting ticket ("" = none)   ARGV[4]  exclusion:
--          server ids no request of the call may go to (lib/acquiring)   ARGV[5..] quads:
--          request id, lease token (client-made, unique), random integer, group id
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
local deterministic = config(ARGV[1]).deterministic
return acquire_all(OWN, {
  choose = function(i, cx)
    if deterministic then return rendezvous(ARGV[i]) end
    return least_loaded(cx, tonumber(ARGV[i + 2]))
  end,
})
