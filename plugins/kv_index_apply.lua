-- kv_index_apply.lua: apply one batch of a replica's KV-cache events to the exact index, in
-- stream order, exactly once, whichever subscriber sends it and however often.
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see kv_index_lib.lua)
-- ARGV[1]  server id   ARGV[2] dp rank   ARGV[3] the replica's dp ranks (streams)
-- ARGV[4]  sequence number   ARGV[5] batch time (the publisher's ts, a decimal)
-- ARGV[6]  "1": the sender could not get the batches between the last applied and this one
--          (not replayable): accept a gap. "0": it could. "2": no batch; the publisher has
--          none from 0 on, so it restarted and published nothing: reset the stream if its last
--          applied batch is still ARGV[4] at ARGV[5] (what the sender saw).
-- ARGV[7]  stale window (ms)   ARGV[8] max blocks per stream   ARGV[9] drop budget (entries)
-- ARGV[10..] events: "S", parent engine hash (or ""), block size, n, n engine hashes, the
--          blocks' token ids (n * block size uint32 little-endian) | "R", n, n engine hashes | "C"
-- Returns  {"ok", stored, removed, unchained} | {"dup"} (applied before, or older than the
--          stream's last batch: a no-op) | {"need", seq} (apply that sequence number first;
--          nothing written) | {"removed"} (the replica is not in the pool; nothing written)
-- Order    a batch applies when its number follows the last applied one. A number at or below
--          it with a later batch time means the replica restarted (numbers start again at 0):
--          the stream is reset and wants 0, keeping the old stream's last time (so the new
--          stream's batches below that number apply, and the old stream's stay no-ops). A gap
--          the sender cannot fill (ARGV[6] = "1") resets the stream too, and it stays "gap"
--          (not exact) until AllBlocksCleared or a restart;
--          a stream first seen past 0 with its history gone is "history" likewise.
-- Keeps    I6 (no entry for a replica outside the pool), I7; each stream's map, its entries in
--          kv:idx and its BLOCKS agree (a reset moves the map aside, drained by epoch); BLOCKS
--          <= max blocks; kv:exact lists a replica only while every stream of it is exact.
-- Uses     lib/base, kv_index_lib, kv_index_write
local id, rank, ranks = ARGV[1], ARGV[2], tonumber(ARGV[3])
local seq, ts, gap_ok, restarted = tonumber(ARGV[4]), ARGV[5], ARGV[6] == '1', ARGV[6] == '2'
local stale_ms, max_blocks, budget = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])

-- The events are checked before anything is written (a script is not rolled back).
do
  local i = 10
  while i <= #ARGV do
    local kind = ARGV[i]
    if kind == 'S' then i = i + 5 + tonumber(ARGV[i + 3])
    elseif kind == 'R' then i = i + 2 + tonumber(ARGV[i + 1])
    elseif kind == 'C' then i = i + 1
    else return redis.error_reply('ERR kv_index_apply: unknown event kind ' .. kind) end
  end
  if i ~= #ARGV + 1 then return redis.error_reply('ERR kv_index_apply: truncated events') end
end
if redis.call('HEXISTS', P .. 'servers', id) == 0 then return { 'removed' } end
kv_drain(budget)
local skey = rank .. ':' .. id
local st = kv_load(skey)
local t = tonumber(ts)

if restarted then
  if not st or st.seq ~= seq or st.ts ~= ts then return { 'dup' } end -- moved on meanwhile
  kv_reset(rank, id, st)
  st.seq, st.status, st.seen, st.link = -1, 'exact', kv_now, '1'
  kv_save(skey, st)
  kv_judge(id, ranks, stale_ms)
  return { 'ok', 0, 0, 0 }
end

if not st then
  if seq ~= 0 and not gap_ok then return { 'need', 0 } end
  st = kv_fresh(seq == 0 and 'exact' or 'history')
elseif seq <= st.seq then
  if t <= tonumber(st.ts) then
    st.seen = kv_now
    kv_save(skey, st)
    return { 'dup' }
  end
  -- The same number, later: a new stream. Everything the old one stored is gone with it.
  kv_reset(rank, id, st)
  st.seq, st.status = -1, 'exact'
  if seq ~= 0 then
    if not gap_ok then
      -- st.ts stays the old stream's last time: the new stream's batches from 0 on are later
      st.seen = kv_now
      kv_save(skey, st)
      kv_judge(id, ranks, stale_ms)
      return { 'need', 0 }
    end
    st.status = 'history'
  end
elseif t < tonumber(st.ts) or (st.seq == -1 and t == tonumber(st.ts)) then
  -- A later number from an older stream (what a lagging sender still holds); after a reset,
  -- the old stream's last batch too.
  return { 'dup' }
elseif seq > st.seq + 1 then
  if not gap_ok then return { 'need', st.seq + 1 } end
  kv_reset(rank, id, st)
  st.status = 'gap'
end

local map = kv_map_key(rank, id)
local tag = id .. '\31' .. rank .. '\31'
local stored, removed, unchained = 0, 0, 0
local i = 10
while i <= #ARGV do
  local kind = ARGV[i]
  if kind == 'S' then
    local parent, bs, n = ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    local tokens = ARGV[i + 4 + n]
    local prev = parent == '' and ('kv' .. bs .. ':') or redis.call('HGET', map, parent)
    if not prev then unchained = unchained + n end
    local width = bs * 4
    for j = 1, n do
      if not prev then break end
      if st.blocks >= max_blocks then
        st.status = 'full'
        break
      end
      local key = ARGV[i + 3 + j]
      local h = string.sub(redis.sha1hex(prev .. string.sub(tokens, (j - 1) * width + 1,
        j * width)), 1, KV_HW)
      local old = redis.call('HGET', map, key)
      if old ~= h then
        if old then kv_unhold(old, tag, st.epoch) else st.blocks = st.blocks + 1 end
        redis.call('HSET', map, key, h)
        redis.call('HSET', KV_IDX, h, kv_with(redis.call('HGET', KV_IDX, h) or nil, tag,
          st.epoch))
        stored = stored + 1
      end
      prev = h
    end
    i = i + 5 + n
  elseif kind == 'R' then
    local n = tonumber(ARGV[i + 1])
    for j = 1, n do
      local key = ARGV[i + 1 + j]
      local h = redis.call('HGET', map, key)
      if h then
        redis.call('HDEL', map, key)
        kv_unhold(h, tag, st.epoch)
        st.blocks = st.blocks - 1
        removed = removed + 1
      end
    end
    i = i + 2 + n
  else -- 'C'
    kv_reset(rank, id, st)
    st.status = 'exact' -- the cache is empty, and so is the stream's map: they agree again
    i = i + 1
  end
end

st.seq, st.ts, st.seen, st.link = seq, ts, kv_now, '1'
kv_save(skey, st)
kv_judge(id, ranks, stale_ms)
return { 'ok', stored, removed, unchained }
