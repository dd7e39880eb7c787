-- kv_index_write.lua: what the index's writing scripts share (kv_index_apply, _heartbeat,
-- _drop): a stream's state, holder entries, resets and the bounded dropping of old maps. Keys:
-- see kv_index_lib.lua.

local KV_STREAMS = P .. 'kv:stream'
local KV_IDX = P .. 'kv:idx'

local kv_now
do
  local t = redis.call('TIME')
  kv_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function kv_map_key(rank, id) return P .. 'kv:map:' .. rank .. ':' .. id end

-- A stream's state (see kv:stream in kv_index_lib.lua) as a table, nil if never written.
local function kv_parse(v)
  if not v then return nil end
  local seq, ts, epoch, blocks, trash, seen, link, status =
    string.match(v, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+)$')
  return { seq = tonumber(seq), ts = ts, epoch = tonumber(epoch), blocks = tonumber(blocks),
           trash = tonumber(trash), seen = tonumber(seen), link = link, status = status }
end

local function kv_load(skey) return kv_parse(redis.call('HGET', KV_STREAMS, skey)) end

local function kv_save(skey, st)
  redis.call('HSET', KV_STREAMS, skey, string.format('%d %s %d %d %d %d %s %s', st.seq, st.ts,
    st.epoch, st.blocks, st.trash, st.seen, st.link, st.status))
end

-- Epochs come from one counter, so a stream never reuses one, even after its replica left the
-- pool and came back while its old map was still being dropped.
local function kv_new_epoch() return redis.call('INCR', P .. 'kv:epochs') end

-- A fresh stream: nothing applied yet.
local function kv_fresh(status)
  return { seq = -1, ts = '0', epoch = kv_new_epoch(), blocks = 0, trash = 0, seen = kv_now,
           link = '1', status = status }
end

-- The holders list v (or nil) with the entry of stream `tag` ("ID\31RANK\31") set to epoch.
local function kv_with(v, tag, epoch)
  local entry = tag .. epoch .. '\31'
  if not v then return entry end
  local parts = {}
  for h, r, e in string.gmatch(v, '([^\31]+)\31(%d+)\31(%d+)\31') do
    local t = h .. '\31' .. r .. '\31'
    if t ~= tag then parts[#parts + 1] = t .. e .. '\31' end
  end
  parts[#parts + 1] = entry
  return table.concat(parts)
end

-- Remove stream `tag`'s entry of epoch `epoch` from block h; a block left without holders goes.
local function kv_unhold(h, tag, epoch)
  local v = redis.call('HGET', KV_IDX, h)
  if not v then return end
  local entry = tag .. epoch .. '\31'
  if v == entry then
    redis.call('HDEL', KV_IDX, h)
    return
  end
  local parts, gone = {}, false
  for hid, r, e in string.gmatch(v, '([^\31]+)\31(%d+)\31(%d+)\31') do
    local this = hid .. '\31' .. r .. '\31' .. e .. '\31'
    if this == entry then gone = true else parts[#parts + 1] = this end
  end
  if gone then
    if #parts == 0 then redis.call('HDEL', KV_IDX, h) else
      redis.call('HSET', KV_IDX, h, table.concat(parts))
    end
  end
end

-- Set the stream's map aside (its entries are dropped a few at a time by kv_drain, which
-- removes only holder entries of the old epoch, so blocks stored again since are kept) and
-- start a new epoch with nothing mapped. O(1).
local function kv_reset(rank, id, st)
  local map = kv_map_key(rank, id)
  if redis.call('EXISTS', map) == 1 then
    local name = st.epoch .. ':' .. rank .. ':' .. id
    redis.call('RENAME', map, P .. 'kv:trash:' .. name)
    redis.call('RPUSH', P .. 'kv:trash', name)
    st.trash = st.trash + 1
  end
  st.epoch = kv_new_epoch()
  st.blocks = 0
end

-- Drop up to about `budget` entries of maps set aside, oldest first. Returns how many maps are
-- still waiting.
local function kv_drain(budget)
  local list = P .. 'kv:trash'
  local spent = 0
  while spent < budget do
    local name = redis.call('LINDEX', list, 0)
    if not name then return 0 end
    local epoch, rank, id = string.match(name, '^(%d+):(%d+):(.*)$')
    local key = P .. 'kv:trash:' .. name
    local got = redis.call('HSCAN', key, '0', 'COUNT', budget - spent)[2]
    local tag = id .. '\31' .. rank .. '\31'
    local fields = {}
    for k = 1, #got, 2 do
      kv_unhold(got[k + 1], tag, epoch)
      fields[#fields + 1] = got[k]
    end
    if #fields > 0 then flat_call('HDEL', key, fields) end
    spent = spent + #fields + 1
    if redis.call('EXISTS', key) == 0 then
      redis.call('LPOP', list)
      local skey = rank .. ':' .. id
      local st = kv_load(skey)
      if st and st.trash > 0 then
        st.trash = st.trash - 1
        kv_save(skey, st)
      end
    end
  end
  return redis.call('LLEN', list)
end

-- Recompute whether replica id's index may be trusted: every one of its `ranks` streams exact,
-- reachable, with no old map waiting, and vouched for within stale_ms.
local function kv_judge(id, ranks, stale_ms)
  local fields = {}
  for r = 0, ranks - 1 do fields[r + 1] = r .. ':' .. id end
  local vals = redis.call('HMGET', KV_STREAMS, unpack(fields))
  local deadline = nil
  for r = 1, ranks do
    local st = kv_parse(vals[r] or nil)
    if not st or st.status ~= 'exact' or st.trash > 0 or st.link ~= '1' then
      redis.call('HDEL', P .. 'kv:exact', id)
      return false
    end
    local d = st.seen + stale_ms
    if not deadline or d < deadline then deadline = d end
  end
  redis.call('HSET', P .. 'kv:exact', id, string.format('%d', deadline))
  return true
end
