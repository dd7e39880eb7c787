-- kv_index_lib.lua: reading the exact KV-block index that `redis-router kv-events` keeps from
-- the replicas' own KV-cache events (redis_router/kv_events). A routing script names it on its
-- "-- Uses" line (after lib/base) and calls kv_holders / kv_exact_of / kv_deepest.
--
-- Keys (P = KEYS[1] = "rr:{NAME}:"; every key shares the hash tag {NAME}, I7). A *stream* is one
-- data-parallel rank of one replica, named "RANK:ID" (rank first: ids may hold ':').
--   P.."kv:idx"       HASH  router block hash (16 hex, names the whole token prefix up to and
--                           including the block) -> holders, "ID\31RANK\31EPOCH\31" per stream
--                           that holds it (control characters are refused in server ids)
--   P.."kv:exact"     HASH  replica id -> deadline (ms, Redis clock): every stream of the replica
--                           is exact, and a subscriber vouched for it less than the stale window
--                           ago. Routing trusts kv:idx for a replica only while now <= deadline.
--   P.."kv:stream"    HASH  "RANK:ID" -> "SEQ TS EPOCH BLOCKS TRASH SEEN LINK STATUS": last
--                           applied sequence number and its batch time, the stream's epoch (new
--                           on every reset, from the counter P.."kv:epochs"), blocks mapped, old
--                           maps still being dropped, last subscriber contact (ms), publisher
--                           reachable (1/0), and exact | gap | history | full
--   P.."kv:map:"..RANK..":"..ID   HASH  engine block hash (8 bytes big-endian for an int hash,
--                           else its bytes) -> router block hash: for BlockRemoved and for
--                           chaining a BlockStored to its parent
--   P.."kv:trash"     LIST  "EPOCH:RANK:ID" of maps set aside by a reset, dropped a few hundred
--                           entries per call; P.."kv:trash:EPOCH:RANK:ID" is such a map
-- Router block hash of depth d (in the replica's blocks of B tokens): the first 16 hex characters
-- of SHA-1(prev .. tokens), tokens the block's ids as uint32 little-endian, prev the hash of
-- depth d - 1, or "kvB:" for d = 1 (redis_router.kv_events.hashing computes the same).

local KV_HW = 16

-- Holders of each of hashes[1..n]: out[j] = {replica id = true, ...}, or false when no stream
-- holds block j. Entries of replicas no longer exact are included: filter with kv_exact_of.
local function kv_holders(hashes, n)
  local vals = hmget(P .. 'kv:idx', hashes, n)
  local out = {}
  for j = 1, n do
    local v = vals[j]
    if v then
      local ids = {}
      for id in string.gmatch(v, '([^\31]+)\31%d+\31%d+\31') do ids[id] = true end
      out[j] = ids
    else
      out[j] = false
    end
  end
  return out
end

-- Of the replica ids in list ids, those whose exact index may be trusted at now_ms, as a set.
local function kv_exact_of(ids, now_ms)
  local out = {}
  if #ids == 0 then return out end
  local until_ms = redis.call('HMGET', P .. 'kv:exact', unpack(ids))
  for k = 1, #ids do
    local d = until_ms[k]
    if d and tonumber(d) >= now_ms then out[ids[k]] = true end
  end
  return out
end

-- The deepest of hashes[first..n] that some exact replica holds, scanning from the deepest:
-- returns its index and the list of those replicas, or nil. One HMGET for the blocks and one
-- for the replicas' deadlines.
local function kv_deepest(hashes, n, first, now_ms)
  local held = kv_holders(hashes, n)
  local seen, ids = {}, {}
  for j = first, n do
    if held[j] then
      for id in pairs(held[j]) do
        if not seen[id] then seen[id] = true; ids[#ids + 1] = id end
      end
    end
  end
  local exact = kv_exact_of(ids, now_ms)
  for j = n, first, -1 do
    if held[j] then
      local got = {}
      for id in pairs(held[j]) do
        if exact[id] then got[#got + 1] = id end
      end
      if #got > 0 then
        table.sort(got) -- pairs() order varies; callers break ties with client entropy
        return j, got
      end
    end
  end
  return nil
end
