-- shard_unassign.lua: replicas left the pool: their homes go, and their shards' counts.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- ARGV     replica ids
-- Returns  how many had a home.
-- Keeps    D1. Safe to resend: a second copy finds no home and changes nothing.
-- Uses     lib/base
local gone = 0
for _, id in ipairs(ARGV) do
  local home = redis.call('HGET', P .. 'homes', id)
  if home then
    local s, c = string.match(home, '^(%d+) (%d+)$')
    redis.call('HDEL', P .. 'homes', id)
    redis.call('HINCRBY', P .. 'shards', 'n:' .. s, -1)
    if tonumber(c) > 0 then redis.call('HINCRBY', P .. 'shards', 'cap:' .. s, -tonumber(c)) end
    gone = gone + 1
  end
end
return gone
