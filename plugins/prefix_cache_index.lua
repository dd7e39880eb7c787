-- prefix_cache_index.lua: the prefix index of the prefix-cache router, shared by its scripts
-- (prefix_cache.lua, prefix_cache_record.lua, prefix_cache_clear.lua). The plugin's loader
-- puts it after lib.lua and before the script, so it reads KEYS[1] (P) only.
--
-- Key schema (P = KEYS[1] = "rr:{NAME}:"; the hash tag {NAME} holds for every key, I7):
--   P.."pc:b:"..h   ZSET  replica id -> ms (Redis clock) it last received block h
--   P.."pc:lru"     ZSET  block hash -> last use, as ms * 1024 + rank; of one prompt's blocks
--                         the earlier ones rank higher, so they outlive the later ones
-- A block hash h is 16 hex characters, the chained hash of a prompt's block (block i covers
-- block i-1's hash and its own tokens), so holding block i implies having held blocks < i.
-- Bounds: the index holds at most max_blocks blocks (the oldest go first), a block unseen for
-- ttl ms is dropped (lazily, a few per call), and a block's set has at most one entry per
-- replica, so memory is O(max_blocks * replicas). Entries of removed replicas are ignored
-- (lookups keep only members of P.."load") until their block goes.

local HW = 16            -- characters per block hash
local LRU_SCALE = 1024   -- ranks per ms in pc:lru; a call records at most this many blocks
local CHUNK = 500        -- arguments per variadic call, well under Lua's stack limit

local function block_at(hs, j)
  return string.sub(hs, (j - 1) * HW + 1, j * HW)
end

-- Drop blocks from the index: their replica sets and their LRU entries.
local function forget_blocks(hashes)
  for k = 1, #hashes, CHUNK do
    local last = math.min(#hashes, k + CHUNK - 1)
    local keys = {}
    for j = k, last do keys[#keys + 1] = P .. 'pc:b:' .. hashes[j] end
    redis.call('DEL', unpack(keys))
    redis.call('ZREM', P .. 'pc:lru', unpack(hashes, k, last))
  end
end

-- Keep the index within max_blocks and drop at most `budget` blocks unseen for ttl ms.
local function bound_index(now, ttl, max_blocks, budget)
  local lru = P .. 'pc:lru'
  local over = redis.call('ZCARD', lru) - max_blocks
  if over > 0 then forget_blocks(redis.call('ZRANGE', lru, 0, over - 1)) end
  local stale = string.format('(%d', (now - ttl) * LRU_SCALE)
  local old = redis.call('ZRANGEBYSCORE', lru, '-inf', stale, 'LIMIT', 0, budget)
  if #old > 0 then forget_blocks(old) end
end

-- Note that replica id received blocks first..n of hs (n in all) at `now`.
local function record_blocks(id, hs, first, n, now)
  local lru, args = P .. 'pc:lru', {}
  for j = first, n do
    local h = block_at(hs, j)
    redis.call('ZADD', P .. 'pc:b:' .. h, now, id)
    args[#args + 1] = string.format('%d', now * LRU_SCALE + (n - j))
    args[#args + 1] = h
    if #args >= CHUNK then
      redis.call('ZADD', lru, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', lru, unpack(args)) end
end

-- How many leading blocks of hs replica id received since `since` (ms): a binary search over
-- the chain, so re-sending a prefix refreshes only what is stale (O(log n) reads, no writes).
local function fresh_depth(id, hs, n, since)
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local seen = redis.call('ZSCORE', P .. 'pc:b:' .. block_at(hs, mid), id)
    if seen and tonumber(seen) >= since then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

-- Replicas taking new sessions that received block h since `since` (ms), with their loads.
local function live_holders(h, since)
  local ids, loads = {}, {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'pc:b:' .. h, since, '+inf')) do
    local load = redis.call('ZSCORE', P .. 'load', id)
    if load then
      ids[#ids + 1] = id
      loads[#loads + 1] = tonumber(load)
    end
  end
  return ids, loads
end
