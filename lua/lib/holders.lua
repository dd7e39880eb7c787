-- lib/holders.lua: a holder's liveness and the settings it must share (uses base). Apart
-- from lib/leases so that an acquire, which keeps its holder alive but ends no lease, does
-- not define (on every call) the functions that end and reap leases.

-- Mark a holder alive until now + ttl (never moving its deadline back). The first time it is
-- seen (or again after it was declared dead, or the keys were lost) its process's pinned
-- settings (c = config(ARGV[1]), lib/base.lua) are checked against the pinned ones, and a
-- setting not pinned yet is pinned: every process that acquires checks them, not only at
-- start-up. Returns an error reply "CONFIGMISMATCH <field> <pinned value>" on a mismatch,
-- with nothing pinned.
local function heartbeat(holder, now, ttl, c)
  if redis.call('ZADD', P .. 'holders', 'GT', int(now + ttl), holder) == 0 then return nil end
  -- A holder new to Redis is heard now: a pause before its keeper's first beat is a gap too.
  liveness(now, ttl)
  local pinned = redis.call('HMGET', P .. 'config', unpack(c.fields))
  local fresh = {}
  for k, field in ipairs(c.fields) do
    local v, mine = pinned[k], c.values[k]
    if not v then
      fresh[#fresh + 1], fresh[#fresh + 2] = field, mine
    elseif v ~= mine then
      redis.call('ZREM', P .. 'holders', holder)
      return redis.error_reply('CONFIGMISMATCH ' .. field .. ' ' .. v)
    end
  end
  if #fresh > 0 then redis.call('HSET', P .. 'config', unpack(fresh)) end
  return nil
end
