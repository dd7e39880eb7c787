-- prefix_cache_index.lua: the prefix index of the prefix-cache router, shared by its scripts
-- (prefix_cache.lua, prefix_cache_record.lua, prefix_cache_clear.lua), which name it on their
-- "-- Uses" line after lib/base; it reads KEYS[1] (P) only.
--
-- Key schema (P = KEYS[1] = "rr:{NAME}:"; the hash tag {NAME} holds for every key, I7):
--   P.."pc:idx"  HASH    block hash -> its holders, "id\31us\31" per replica: us = when
--                        that replica last received the block (one entry each)
--   P.."pc:lru"  ZSET    write -> us it was made. A write (the member) is "id\31" followed
--                        by the block hashes recorded for replica id by one call, concatenated
--   P.."pc:n"    STRING  how many block hashes the writes in pc:lru name, in all
-- A block hash is 16 hex characters naming a whole prompt prefix (the hash of the prompt's
-- tokens up to that block), so holding a deep block implies having held the shallower ones.
-- One hash field per block (not a key per block) keeps a never-seen prompt's ~21 new blocks
-- one HSET, and one lru member per write (not per block) keeps its LRU bookkeeping one ZADD.
-- Times (us) are microseconds of the Redis clock, made unique per write (see pc_now), so the
-- LRU order of writes is their order even within one millisecond.
-- Bounds: pc:n <= max_blocks (oldest writes go first); a write older than ttl is dropped
-- (lazily, a few blocks' worth per call). Dropping a write removes its replica from each of
-- its blocks unless the replica received the block again since; a block with no holder left
-- goes. Each holder entry was made by a write still in pc:lru, so HLEN pc:idx <= pc:n and
-- memory is O(max_blocks * replicas). Entries of removed replicas are ignored (lookups keep
-- only members of P.."load") until their write goes.

local HW = 16            -- characters per block hash
local FIELD = '\31'      -- separates id and time in a holder list (control characters are
                         -- refused in server ids)
local function us_str(x) return string.format('%d', x) end

-- The Redis clock in microseconds (exact in a double until year 2255). Scripts run one at a
-- time and each takes well over a microsecond, so times of different scripts differ; writes
-- within one script add 1 us each (pc_write).
local pc_us
do
  local t = redis.call('TIME')
  pc_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local pc_writes = 0

-- Chunked HMGET / variadic writes: lib.lua's hmget and flat_call.

local function block_at(hs, j)
  return string.sub(hs, (j - 1) * HW + 1, j * HW)
end

-- The blocks of hs as a list of hashes.
local function split_hashes(hs)
  local out = {}
  for j = 1, #hs / HW do out[j] = string.sub(hs, (j - 1) * HW + 1, j * HW) end
  return out
end

-- The holders list v (or nil) with id's entry replaced by `stamp` and entries older than
-- `stale` dropped (times in us).
local function with_holder(v, id, stamp, stale)
  local parts = {}
  if v then
    for h, us in string.gmatch(v, '([^\31]+)\31(%d+)\31') do
      if h ~= id and tonumber(us) >= stale then
        parts[#parts + 1] = h .. FIELD .. us .. FIELD
      end
    end
  end
  parts[#parts + 1] = id .. FIELD .. stamp .. FIELD
  return table.concat(parts)
end

-- The holders list v without id's entry if that entry is at most `upto` us (nil: any), and
-- whether it changed.
local function without_holder(v, id, upto)
  local head = id .. FIELD
  if string.sub(v, 1, #head) == head then -- the common case: id is the only holder
    local us = string.match(v, '^(%d+)\31$', #head + 1)
    if us then
      if not upto or tonumber(us) <= upto then return '', true end
      return v, false
    end
  end
  local parts, gone = {}, false
  for h, us in string.gmatch(v, '([^\31]+)\31(%d+)\31') do
    if h == id and (not upto or tonumber(us) <= upto) then
      gone = true
    else
      parts[#parts + 1] = h .. FIELD .. us .. FIELD
    end
  end
  return table.concat(parts), gone
end

-- When (us) replica id last received a block, per its holders list v (nil: never, as far as
-- the index knows).
local function stamp_of(v, id)
  if not v then return nil end
  for h, us in string.gmatch(v, '([^\31]+)\31(%d+)\31') do
    if h == id then return tonumber(us) end
  end
  return nil
end

-- Remove id from blocks hashes[1..] where its entry is at most `upto` us (nil: any); a block
-- left without holders goes. Returns how many entries went.
local function drop_holders(id, hashes, upto)
  local idx = P .. 'pc:idx'
  local vals = hmget(idx, hashes, #hashes)
  local set, del, gone = {}, {}, 0
  for j = 1, #hashes do
    local v = vals[j]
    if v then
      local rest, changed = without_holder(v, id, upto)
      if changed then
        gone = gone + 1
        if rest == '' then
          del[#del + 1] = hashes[j]
        else
          set[#set + 1] = hashes[j]
          set[#set + 1] = rest
        end
      end
    end
  end
  if #del > 0 then flat_call('HDEL', idx, del) end
  if #set > 0 then flat_call('HSET', idx, set) end
  return gone
end

-- Drop one write of pc:lru (member w, made at us): its replica's entries not renewed since.
local function forget_write(w, us)
  local cut = string.find(w, FIELD, 1, true)
  local hashes = split_hashes(string.sub(w, cut + 1))
  drop_holders(string.sub(w, 1, cut - 1), hashes, us)
  redis.call('ZREM', P .. 'pc:lru', w)
  return redis.call('DECRBY', P .. 'pc:n', #hashes)
end

-- Keep pc:n within max_blocks (oldest writes first) and drop writes older than ttl (us),
-- about `budget` blocks' worth per call. `total` is pc:n after this call's writes (nil: it
-- wrote nothing, so the size bound holds already).
local function bound_index(now, ttl, max_blocks, budget, total)
  local lru = P .. 'pc:lru'
  while total and total > max_blocks do
    local oldest = redis.call('ZRANGE', lru, 0, 0, 'WITHSCORES')
    if #oldest == 0 then
      redis.call('DEL', P .. 'pc:n')
      break
    end
    total = forget_write(oldest[1], tonumber(oldest[2]))
  end
  local stale = us_str(now - ttl)
  local spent = 0
  while spent < budget do
    local old = redis.call('ZRANGEBYSCORE', lru, '-inf', '(' .. stale, 'WITHSCORES', 'LIMIT', 0, 1)
    if #old == 0 then break end
    spent = spent + (#old[1] - string.find(old[1], FIELD, 1, true)) / HW
    forget_write(old[1], tonumber(old[2]))
  end
end

-- Note that replica id received blocks hashes[1..] now (vals[j]: block j's holders list as
-- read, or nil), as one write; holders older than `stale` (us) are dropped on the way.
-- Returns pc:n afterwards, or nil when there was nothing to write.
local function record_holders(id, hashes, vals, stale)
  local n = #hashes
  if n == 0 then return nil end
  local stamp = us_str(pc_us + pc_writes)
  pc_writes = pc_writes + 1
  local only = id .. FIELD .. stamp .. FIELD -- the holders list of a block new to the index
  local set = {}
  for j = 1, n do
    local v = vals[j]
    set[2 * j - 1] = hashes[j]
    set[2 * j] = v and with_holder(v, id, stamp, stale) or only
  end
  flat_call('HSET', P .. 'pc:idx', set)
  if redis.call('ZADD', P .. 'pc:lru', stamp, id .. FIELD .. table.concat(hashes)) == 0 then
    return tonumber(redis.call('GET', P .. 'pc:n') or '0') -- the same write again: renewed
  end
  return redis.call('INCRBY', P .. 'pc:n', n)
end
