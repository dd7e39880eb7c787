-- shard_totals.lua: publish shards' in-flight totals, and claim the shards due for one.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- ARGV[1]  publishing period (ms)    ARGV[2]  a generation of sessions' records (ms: the
--          sticky ttl)    ARGV[3..] pairs: shard, its in-flight total as the caller just read
--          it
-- Returns  the shards whose total is older than the period, now claimed by the caller (it
--          reads and publishes them next); no other process claims them for a period.
-- Keeps    D1; D2: the sessions' records rotate here, a generation after they last did
--          (`layout`'s `gen`): `placed` becomes `placed:old`, the older one is dropped, so a
--          record lives at least a generation after its last lookup. in:<s> is the total as
--          read, new:<s> (sessions placed since) starts again from 0. Safe to resend: a
--          second copy writes the same totals, and a rotation happens once per generation.
-- Why      One process per period reads a shard, however many processes place sessions.
-- Uses     lib/base
local period, gen_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local head = redis.call('HMGET', P .. 'layout', 'shards', 'gen')
local k, gen = tonumber(head[1] or '0'), tonumber(head[2] or '0')
local now = now_ms()
if k > 0 and now - gen >= gen_ms then
  if redis.call('EXISTS', P .. 'placed') == 1 then
    redis.call('RENAME', P .. 'placed', P .. 'placed:old')
  else
    redis.call('DEL', P .. 'placed:old')
  end
  redis.call('HSET', P .. 'layout', 'gen', now)
end
for i = 3, #ARGV, 2 do
  redis.call('HSET', P .. 'shards', 'in:' .. ARGV[i], ARGV[i + 1], 'new:' .. ARGV[i], 0)
end
local due = {}
local at = {}
for s = 0, k - 1 do at[#at + 1] = 'at:' .. s end
local seen = redis.call('HMGET', P .. 'shards', unpack(at))
for s = 0, k - 1 do
  if now - tonumber(seen[s + 1] or '0') >= period then
    redis.call('HSET', P .. 'shards', 'at:' .. s, now)
    due[#due + 1] = s
  end
end
return due
