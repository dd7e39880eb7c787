-- shard_assign.lua: give replicas a home shard, balanced by count, then by capacity.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- ARGV     pairs: replica id, its capacity (0: none declared)
-- Returns  each replica's shard (0-based), in order; a replica with a home keeps it.
-- Keeps    D1 (docs/design.md): shards' n:<s> == replicas whose home is s, cap:<s> == the sum
--          of their capacities. Safe to resend: a second copy finds the homes written.
-- Why      In the script, so that processes adding replicas at once never both count the
--          same shard as the emptiest.
-- Uses     lib/base
local k = tonumber(redis.call('HGET', P .. 'layout', 'shards') or '0')
if k == 0 then return redis.error_reply('NOLAYOUT') end
local n, cap = {}, {}
local stats = redis.call('HGETALL', P .. 'shards')
local got = {}
for i = 1, #stats, 2 do got[stats[i]] = tonumber(stats[i + 1]) end
for s = 0, k - 1 do
  n[s], cap[s] = got['n:' .. s] or 0, got['cap:' .. s] or 0
end
local out = {}
for i = 1, #ARGV, 2 do
  local id, c = ARGV[i], tonumber(ARGV[i + 1])
  local home = redis.call('HGET', P .. 'homes', id)
  if home then
    out[#out + 1] = tonumber(string.match(home, '^(%d+)'))
  else
    local best = 0
    for s = 1, k - 1 do
      if n[s] < n[best] or (n[s] == n[best] and cap[s] < cap[best]) then best = s end
    end
    n[best], cap[best] = n[best] + 1, cap[best] + c
    redis.call('HSET', P .. 'homes', id, best .. ' ' .. c)
    redis.call('HINCRBY', P .. 'shards', 'n:' .. best, 1)
    if c > 0 then redis.call('HINCRBY', P .. 'shards', 'cap:' .. best, c) end
    out[#out + 1] = best
  end
end
return out
