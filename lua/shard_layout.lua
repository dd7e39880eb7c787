-- shard_layout.lua: a sharded pool's directory: its shards, fixed by the first process.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:" (the pool's name; each shard is a balancer
--          of its own, named in the layout)
-- ARGV[1]  the shard count this process asks for (0: read only)    ARGV[2]  the shards'
--          balancer names as a JSON list (one per shard, used when the layout is new)
-- Returns  { shard count, names (JSON), replica id, "<shard> <capacity>", ... } as stored;
--          an error "SHARDS <count>" when the pool has another count (grow() changes it) and
--          "UNSHARDED" when an unsharded balancer of this name holds replicas.
-- Keeps    the layout is written once: every process that joins the pool reads the same.
--          Safe to resend: a second copy finds the layout written and returns it.
-- Uses     lib/base
local want = tonumber(ARGV[1])
local k = tonumber(redis.call('HGET', P .. 'layout', 'shards') or '0')
if k == 0 and want > 0 then
  if redis.call('EXISTS', P .. 'servers') == 1 then return redis.error_reply('UNSHARDED') end
  redis.call('HSET', P .. 'layout', 'shards', want, 'names', ARGV[2])
  k = want
elseif want > 0 and want ~= k then
  return redis.error_reply('SHARDS ' .. k)
end
local out = { k, redis.call('HGET', P .. 'layout', 'names') or '[]' }
for _, v in ipairs(redis.call('HGETALL', P .. 'homes')) do out[#out + 1] = v end
return out
