-- kv_index_heartbeat.lua: a subscriber vouches for the streams it follows (they stay trusted
-- for the stale window), records whether each publisher is reachable, and drops a share of
-- the maps that resets set aside.
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see kv_index_lib.lua)
-- ARGV[1]  stale window (ms)   ARGV[2] drop budget (entries)
-- ARGV[3..] four per stream: server id, dp rank, the replica's dp ranks, link: "1" reachable,
--          "0" not, "e" reachable and it has published nothing yet (its cache is empty: a
--          stream never written starts exact)
-- Returns  {maps still waiting to be dropped, replicas trusted now among those named}
-- Keeps    I6 (replicas outside the pool are skipped), I7; kv:exact as kv_index_apply.
-- Uses     lib/base, kv_index_lib, kv_index_write
local stale_ms = tonumber(ARGV[1])
local waiting = kv_drain(tonumber(ARGV[2]))
local judged, trusted = {}, 0
for i = 3, #ARGV, 4 do
  local id, rank, ranks, link = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  if redis.call('HEXISTS', P .. 'servers', id) == 1 then
    local skey = rank .. ':' .. id
    local st = kv_load(skey)
    if not st and link == 'e' then st = kv_fresh('exact') end
    if st then
      st.seen, st.link = kv_now, link == '0' and '0' or '1'
      kv_save(skey, st)
    end
    if not judged[id] then
      judged[id] = true
      if kv_judge(id, ranks, stale_ms) then trusted = trusted + 1 end
    end
  end
end
return { waiting, trusted }
