-- shard_totals.lua: publish shards' in-flight totals, and claim the shards due for one.
-- KEYS[1]  the directory's key prefix "rr:{NAME}:"
-- ARGV[1]  publishing period (ms)    ARGV[2..] pairs: shard, its in-flight total as the
--          caller just read it
-- Returns  the shards whose total is older than the period, now claimed by the caller (it
--          reads and publishes them next); no other process claims them for a period.
-- Keeps    D1. in:<s> is the total as read, new:<s> (sessions placed since) starts again
--          from 0. Safe to resend: a second copy writes the same totals.
-- Why      One process per period reads a shard, however many processes place sessions.
-- Uses     lib/base
local period = tonumber(ARGV[1])
local k = tonumber(redis.call('HGET', P .. 'layout', 'shards') or '0')
local now = now_ms()
for i = 2, #ARGV, 2 do
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
