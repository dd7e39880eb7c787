-- prefix_cache_record.lua: exact mode. A subscriber to a replica's KV-cache events tells the
-- index which blocks that replica now holds (stored) or no longer holds (evicted).
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see prefix_cache_index.lua)
-- ARGV[1]  "record" or "evict"       ARGV[2]  server id
-- ARGV[3]  block hashes, 16 hex characters each, concatenated (at most 1024)
-- ARGV[4]  index ttl (ms)            ARGV[5]  max blocks      ARGV[6]  budget (blocks)
-- Returns  record: how many blocks were recorded (0 when the replica is not in the pool, I6:
--          a removed replica never reenters the index); evict: how many entries went.
-- Keeps    I7 (keys from KEYS[1] only); the index bounds (max blocks, ttl).
-- Uses     lib/base, prefix_cache_index
local mode, id, hs = ARGV[1], ARGV[2], ARGV[3]
local hashes = split_hashes(hs)
local n = #hashes
if mode == 'record' then
  if redis.call('HEXISTS', P .. 'servers', id) == 0 or n == 0 then return 0 end
  local ttl = tonumber(ARGV[4]) * 1000
  local total = record_holders(id, hashes, hmget(P .. 'pc:idx', hashes, n), pc_us - ttl)
  bound_index(pc_us, ttl, tonumber(ARGV[5]), tonumber(ARGV[6]), total)
  return n
end
if n == 0 then return 0 end
return drop_holders(id, hashes, nil)
