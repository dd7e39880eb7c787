-- shard_layout.lua: a sharded pool's layout: its shards, fixed by the first process, grown on
-- request.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:" (the pool's name; each shard is a balancer
--          of its own, named in the layout)
-- ARGV[1]  "read", "create" (write the layout if there is none) or "grow" (to more shards)
--          ARGV[2]  the shards' balancer names as a JSON list (create: all; grow: all, the
--          present ones first, unchanged)
-- Returns  { shard count, names (JSON), replica id, "<shard> <capacity>", ... } as stored
--          after the call; an error "UNSHARDED" when an unsharded balancer of this name holds
--          replicas, "LAYOUT" when grow's list does not begin with the present shards.
-- Keeps    a shard, once in the layout, keeps its place (index) and name; the count only
--          grows. Safe to resend: a second copy finds the layout written and returns it.
-- Uses     lib/base
local mode = ARGV[1]
local k = tonumber(redis.call('HGET', P .. 'layout', 'shards') or '0')
if mode ~= 'read' then
  local names = cjson.decode(ARGV[2])
  if k == 0 and mode == 'create' then
    if redis.call('EXISTS', P .. 'servers') == 1 then return redis.error_reply('UNSHARDED') end
    redis.call('HSET', P .. 'layout', 'shards', #names, 'names', ARGV[2])
  elseif mode == 'grow' and #names > k and k > 0 then
    local present = cjson.decode(redis.call('HGET', P .. 'layout', 'names'))
    for i = 1, k do
      if present[i] ~= names[i] then return redis.error_reply('LAYOUT') end
    end
    redis.call('HSET', P .. 'layout', 'shards', #names, 'names', ARGV[2])
  end
end
local out = { redis.call('HGET', P .. 'layout', 'shards') or 0,
  redis.call('HGET', P .. 'layout', 'names') or '[]' }
for _, v in ipairs(redis.call('HGETALL', P .. 'homes')) do out[#out + 1] = v end
return out
