-- prefix_cache_record.lua: exact mode. A subscriber to a replica's KV-cache events tells the
-- index which blocks that replica now holds (stored) or no longer holds (evicted).
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see prefix_cache_index.lua)
-- ARGV[1]  "record" or "evict"       ARGV[2]  server id
-- ARGV[3]  block hashes, 16 hex characters each, concatenated (at most 1024)
-- ARGV[4]  index ttl (ms)            ARGV[5]  max blocks      ARGV[6]  reap budget
-- Returns  record: how many blocks were recorded (0 when the replica is not in the pool, I6:
--          a removed replica never reenters the index); evict: how many entries went.
-- Keeps    I7 (keys from KEYS[1] only); the index bounds (max blocks, ttl).
local mode, id, hs = ARGV[1], ARGV[2], ARGV[3]
local n = #hs / HW
local now = now_ms()
if mode == 'record' then
  if redis.call('HEXISTS', P .. 'servers', id) == 0 then return 0 end
  record_blocks(id, hs, 1, n, now)
  bound_index(now, tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
  return n
end
local gone = 0
for j = 1, n do
  local h = block_at(hs, j)
  local key = P .. 'pc:b:' .. h
  if redis.call('ZREM', key, id) == 1 then
    gone = gone + 1
    if redis.call('EXISTS', key) == 0 then redis.call('ZREM', P .. 'pc:lru', h) end
  end
end
return gone
