-- prefix_cache_clear.lua: drop the whole prefix index of one balancer (its leases, sessions
-- and replicas stay; destroy() runs this before the core's destroy.lua).
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see prefix_cache_index.lua)
-- Returns  how many blocks the index held.
-- Keeps    I7: only this balancer's pc: keys are touched.
local n = 0
while true do
  local blocks = redis.call('ZRANGE', P .. 'pc:lru', 0, 4 * CHUNK - 1)
  if #blocks == 0 then break end
  forget_blocks(blocks)
  n = n + #blocks
end
return n
