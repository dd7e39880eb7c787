-- kv_index_drop.lua: forget the index of replicas that left the pool: their streams' state
-- goes at once, their maps are set aside and dropped a share per call (here and in later
-- apply and heartbeat calls).
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see kv_index_lib.lua)
-- ARGV[1]  drop budget (entries)   ARGV[2..] server ids
-- Returns  {streams forgotten, maps still waiting to be dropped}
-- Keeps    I6 (a replica back in the pool is left alone: it was re-added since), I7; no entry
--          of a forgotten stream outlives its drop.
-- Uses     lib/base, kv_index_lib, kv_index_write
local gone = {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', P .. 'servers', ARGV[i]) == 0 then gone[ARGV[i]] = true end
end
local forgotten = 0
if next(gone) then
  for _, skey in ipairs(redis.call('HKEYS', KV_STREAMS)) do
    local rank, id = string.match(skey, '^(%d+):(.*)$')
    if gone[id] then
      local st = kv_load(skey)
      kv_reset(rank, id, st)
      redis.call('HDEL', KV_STREAMS, skey)
      forgotten = forgotten + 1
    end
  end
  for id in pairs(gone) do redis.call('HDEL', P .. 'kv:exact', id) end
end
return { forgotten, kv_drain(tonumber(ARGV[1])) }
