-- prefix_cache.lua: route requests to the replica holding the longest prefix of their prompt,
-- and take a lease for each, atomically. Built on lib/acquiring.lua's acquire_all, so retries,
-- sticky sessions, leases, draining and removal behave exactly as in the core's acquire.lua.
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see prefix_cache_index.lua, kv_index_lib.lua)
-- ARGV[1..HEAD] as acquire.lua (full_determinism: rendezvous hashing, no prefix)
-- ARGV[HEAD + 1..] per request: the core's OWN (request id, lease token, random integer, group
--          id), then settings, block hashes, first, exact hashes, exact info. settings = "abs
--          rel ttl_ms max_blocks budget record refresh_ms lag_ms block_size kv_block_size
--          min_cached" (space separated, the same for every request of a call; min_cached =
--          sticky_min_cached as pinned, "-" = off); block hashes = the
--          prompt's prefix hashes at its sampled depths, 16 hex characters each, concatenated
--          (or empty); first = the first of them deep enough to count (min_match of the
--          prompt: the client knows the depths, the script needs only this). Exact hashes =
--          the exact index's hashes of the prompt (engine blocks of kv_block_size tokens) at
--          the same grid of depths, concatenated, and exact info = "first engine_blocks
--          blocks" (the first exact hash deep enough to count, the prompt's engine blocks and
--          its blocks of block_size); both empty when exact routing is off.
-- Choice   for a new session: least loaded (random tie-break) if the prompt has no full
--          block, or if no live replica holds one of the hashes first..n; else the least
--          loaded of the replicas holding the deepest such hash (random tie-break), unless one
--          more request would make it a hot spot: its in-flight count, this request included,
--          exceeds the median count m of the replicas taking new sessions by more than abs and
--          is more than rel * m, or exceeds the least loaded count by more than 4 * abs and
--          is more than rel times it (then least loaded; ZCARD, two ZRANGE by rank, one
--          ZSCORE, only when a prefix would decide); when the replica holds the whole prompt
--          (its deepest hash, or exact depth within a block of it) only the second test, by
--          more than 2 * abs.
--          The deepest and the first hash are read first (a repeated prompt, or a
--          never-seen one, costs one HMGET of two), else all of them with one more HMGET,
--          scanned from the deepest. With exact hashes: a replica whose exact index is trusted now
--          (kv:exact) is judged by kv:idx, and by its approximate records only while younger
--          than lag_ms (blocks sent whose events have not arrived); the deepest prefix in
--          tokens wins, depths less than max(block_size, kv_block_size) apart pool their
--          holders. One more HMGET of kv:idx, one of kv:exact and one ZMSCORE; when
--          kv:exact is empty (no healthy stream) one HLEN, and the choice is as without them.
--          The hot-spot test then applies to the replica chosen.
-- Sticky   with sticky_min_cached (min_cached, pinned; needs exact hashes), a sticky turn whose
--          replica's exact index no longer holds that share of the prompt (the first depth
--          of the grid covering it; nor does an approximate record younger than lag_ms) is
--          chosen as above instead, and counted as a re-pin when it leaves (evicted below).
-- Then     each new lease (balanced or sticky) records the prompt's blocks for its replica
--          (when record = 1) as one write: blocks it received less than refresh_ms ago are
--          left as they are, so a hot prefix costs reads, not writes; and the index is kept
--          within its bounds. The exact index is never written here.
-- Returns  as acquire.lua. Error NOSERVERS as acquire.lua, with nothing written.
-- Keeps    I1, I3, I6 (via acquire_all; holders outside P.."load" are never chosen), I4 (ties
--          broken by client entropy, never Lua's RNG), I5 (under full_determinism), I7.
-- Uses     lib/base, lib/holders, lib/admission, lib/picking, lib/acquiring, prefix_cache_index, kv_index_lib
local deterministic = config(ARGV[1]).deterministic
local now = pc_us -- us, Redis clock (prefix_cache_index.lua)
local cfg = nil
local total = nil -- pc:n after this call's last write
local seen = {}   -- ARGV index of a request -> its blocks' holder lists, once read
local ends = {}   -- ARGV index of a request -> its deepest and first blocks' holders

local function settings(s)
  if not cfg then
    local abs, rel, ttl, max_blocks, budget, record, refresh, lag, bs, kbs, mc =
      string.match(s, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+)$')
    cfg = { abs = tonumber(abs), rel = tonumber(rel), ttl = tonumber(ttl) * 1000,
            max_blocks = tonumber(max_blocks), budget = tonumber(budget),
            record = record == '1', refresh = tonumber(refresh) * 1000,
            lag = tonumber(lag) * 1000, bs = tonumber(bs), kbs = tonumber(kbs),
            min_cached = (mc == '-' or deterministic) and '' or mc }
  end
  return cfg
end

-- Whether one more request would make replica `id` (taking new sessions) a hot spot: its
-- count, the request included, above the median by more than abs and more than rel times it,
-- or above the least loaded count by more than FAR * abs and more than rel times it. A request
-- whose whole prompt the replica holds (`whole`: a GRPO group's samples, a repeat) is judged
-- by the second test alone, with WHOLE * abs.
local FAR, WHOLE = 4, 2
-- Judged on the replica the prefix picks, not on the pool's spread: one busy replica
-- elsewhere (long sticky sessions) does not turn the index off for every prompt, and a GRPO
-- group stays together until its own replica stands out. A request sent elsewhere loses what
-- the replica holds of its prompt: a share of it where requests share a system prompt, all of
-- it for a repeat. While fewer groups than replicas are in flight the median is 0, so the
-- first test would split every group of more than abs samples; against the least loaded,
-- with 2 * abs, a group of 2 * abs + 1 stays whole on an idle pool, and a replica holding
-- groups more than 2 * abs above the least loaded one passes the next samples on. O(log N).
local function hot(c, id, whole)
  local n = redis.call('ZCARD', P .. 'load')
  if n == 0 then return false end
  local l = tonumber(redis.call('ZSCORE', P .. 'load', id)) + 1
  if not whole then
    local r = math.floor((n - 1) / 2)
    local med = tonumber(redis.call('ZRANGE', P .. 'load', r, r, 'WITHSCORES')[2])
    if l - med > c.abs and l > c.rel * med then return true end
  end
  -- Far above the least loaded: replicas that never received a shared prefix may be a
  -- minority below the median, and would otherwise wait forever.
  local mn = tonumber(redis.call('ZRANGE', P .. 'load', 0, 0, 'WITHSCORES')[2])
  return l - mn > (whole and WHOLE or FAR) * c.abs and l > c.rel * mn
end

-- The holders lists of the deepest and the first block of request i's prompt (read once,
-- by one HMGET): a repeated prompt needs only the deepest, and when no replica holds even the
-- first block no replica holds any later one, so a never-seen prompt costs one read.
local function ends_of(i, hs, n)
  local e = ends[i]
  if not e then
    e = redis.call('HMGET', P .. 'pc:idx', block_at(hs, n), block_at(hs, 1))
    ends[i] = e
  end
  return e[1], e[2]
end

-- The block hashes of request i's prompt and their holders lists (read once).
local function holder_lists(i, hs, n)
  local got = seen[i]
  if not got then
    local hashes = split_hashes(hs)
    local _, first = ends_of(i, hs, n)
    got = { hashes, first and hmget(P .. 'pc:idx', hashes, n) or {} }
    seen[i] = got
  end
  return got[1], got[2]
end

-- Of the holders in list v that received the block since `since`, those taking new sessions
-- and the least loaded of them (nil: none).
local function best_holders(v, since)
  local ids = {}
  for id, us in string.gmatch(v, '([^\31]+)\31(%d+)\31') do
    if tonumber(us) >= since then ids[#ids + 1] = id end
  end
  if #ids == 0 then return nil end
  local loads = redis.call('ZMSCORE', P .. 'load', unpack(ids))
  local best, ties = nil, nil
  for k = 1, #ids do
    local l = loads[k] and tonumber(loads[k])
    if l and (not best or l < best) then
      best, ties = l, { ids[k] }
    elseif l and l == best then
      ties[#ties + 1] = ids[k]
    end
  end
  return ties
end

-- The k-th depth (in blocks) of the grid of a prompt of `blocks` blocks: every depth up to 8,
-- then four per doubling, then the prompt's own length (prefix_cache.py's sample_depths).
local function grid_depth(blocks, k)
  local j, c = 1, 0
  while j <= blocks do
    c = c + 1
    if c == k then return j end
    local b, x = 0, j
    while x > 0 do b, x = b + 1, math.floor(x / 2) end
    j = j + 2 ^ math.max(0, b - 3)
  end
  return blocks
end

-- Of the replicas in list ids (with their loads), the least loaded ones, sorted (pairs() and
-- holder order vary; ties are broken by client entropy).
local function least_of(ids, load)
  local best, ties = nil, {}
  for _, id in ipairs(ids) do
    local l = load[id]
    if not best or l < best then best, ties = l, { id } elseif l == best then ties[#ties + 1] = id end
  end
  table.sort(ties)
  return ties
end

-- Exact routing for request i (exact hashes given): the holders of the deepest prefix, in
-- tokens, per the exact index for exact replicas and the approximate one for the rest (and
-- for exact replicas' records younger than lag), least loaded first; nil when none.
local function exact_choice(i, c, hs, n)
  local kh = ARGV[i + OWN + 3]
  local kfirst, kblocks, ablocks = string.match(ARGV[i + OWN + 4], '^(%d+) (%d+) (%d+)$')
  kfirst, kblocks, ablocks = tonumber(kfirst), tonumber(kblocks), tonumber(ablocks)
  local kn = #kh / HW
  local kheld = kn > 0 and kv_holders(split_hashes(kh), kn) or {}
  local avals, afirst = {}, tonumber(ARGV[i + OWN + 2])
  if n > 0 then
    local _, v = holder_lists(i, hs, n)
    avals = v
  end
  local ids, known = {}, {}
  for j = kfirst, kn do
    for id in pairs(kheld[j] or {}) do
      if not known[id] then known[id] = true; ids[#ids + 1] = id end
    end
  end
  for k = afirst, n do
    for id in string.gmatch(avals[k] or '', '([^\31]+)\31%d+\31') do
      if not known[id] then known[id] = true; ids[#ids + 1] = id end
    end
  end
  if #ids == 0 then return nil end
  local exact = kv_exact_of(ids, math.floor(now / 1000))
  local scores = redis.call('ZMSCORE', P .. 'load', unpack(ids))
  local load = {}
  for k = 1, #ids do load[ids[k]] = scores[k] and tonumber(scores[k]) end
  local etok, eset = 0, nil
  for j = kn, kfirst, -1 do
    local got = {}
    for id in pairs(kheld[j] or {}) do
      if exact[id] and load[id] then got[#got + 1] = id end
    end
    if #got > 0 then
      etok, eset = grid_depth(kblocks, j) * c.kbs, got
      break
    end
  end
  local since, pending = now - c.ttl, now - c.lag
  local atok, aset = 0, nil
  for k = n, afirst, -1 do
    local got = {}
    for id, us in string.gmatch(avals[k] or '', '([^\31]+)\31(%d+)\31') do
      if load[id] and tonumber(us) >= (exact[id] and pending or since) then got[#got + 1] = id end
    end
    if #got > 0 then
      atok, aset = grid_depth(ablocks, k) * c.bs, got
      break
    end
  end
  if not eset and not aset then return nil end
  -- Depths less than a block of the coarser grid apart name the same prefix (each index
  -- drops its own partial last block): pooled.
  local tol = math.max(c.bs, c.kbs)
  local pool, depth = eset, etok
  if not eset or atok >= etok + tol then
    pool, depth = aset, atok
  elseif aset and atok > etok - tol then
    depth = math.max(etok, atok)
    local have = {}
    for _, id in ipairs(eset) do have[id] = true end
    for _, id in ipairs(aset) do
      if not have[id] then pool[#pool + 1] = id end
    end
  end
  -- The whole prompt: its deepest depth on either grid, within a block of the coarser one.
  return least_of(pool, load), depth > math.max(kblocks * c.kbs, ablocks * c.bs) - tol
end

-- Whether any replica's exact index may be trusted (a deadline, perhaps past: exact_choice
-- checks): one HLEN per call, so a pool without healthy streams routes as without exact hashes.
local has_exact = nil
local function any_exact()
  if has_exact == nil then has_exact = redis.call('HLEN', P .. 'kv:exact') > 0 end
  return has_exact
end

local function choose(i, cx)
  if deterministic then return rendezvous(ARGV[i]) end
  local rand = tonumber(ARGV[i + 2])
  local c = settings(ARGV[i + OWN])
  local hs = ARGV[i + OWN + 1]
  local n = #hs / HW
  if ARGV[i + OWN + 4] ~= '' and any_exact() then
    local ties, whole = exact_choice(i, c, hs, n)
    if not ties then return least_loaded(cx, rand) end
    local id = ties[rand % #ties + 1]
    if hot(c, id, whole) then return least_loaded(cx, rand) end
    return id
  end
  if n == 0 then return least_loaded(cx, rand) end
  local since = now - c.ttl
  local top = ends_of(i, hs, n)
  local ties = top and best_holders(top, since)
  local whole = ties and true or false -- (a missing field reads as false, not nil)
  if not ties then
    local _, vals = holder_lists(i, hs, n)
    for k = n - 1, tonumber(ARGV[i + OWN + 2]), -1 do
      ties = vals[k] and best_holders(vals[k], since)
      if ties then break end
    end
  end
  -- Checked only when a prefix would decide: without one the answer is least-loaded anyway.
  if not ties then return least_loaded(cx, rand) end
  local id = ties[rand % #ties + 1]
  if hot(c, id, whole) then return least_loaded(cx, rand) end
  return id
end

local function granted(i, id, token)
  local c, hs = settings(ARGV[i + OWN]), ARGV[i + OWN + 1]
  local n = #hs / HW
  if not c.record or n == 0 then return end
  local fresh = now - c.refresh
  if not seen[i] then
    -- The deepest block renewed lately for this replica: the whole prefix is (a replica that
    -- received block n received every block before it). No write.
    local t = stamp_of(ends_of(i, hs, n), id)
    if t and t >= fresh then return end
  end
  local all, vals = holder_lists(i, hs, n)
  local hashes, old = {}, {}
  for j = 1, n do
    local v = vals[j]
    local t = v and stamp_of(v, id)
    if not t or t < fresh then
      hashes[#hashes + 1] = all[j]
      old[#hashes] = v
    end
  end
  total = record_holders(id, hashes, old, now - c.ttl) or total
  seen[i], ends[i] = nil, nil
end

-- The index of the first depth of the grid of a prompt of `blocks` blocks that is at least
-- `need` blocks deep (the last, the prompt's own length, when none on the grid is).
local function grid_index(blocks, need)
  local j, c = 1, 0
  while j <= blocks do
    c = c + 1
    if j >= need then return c end
    local b, x = 0, j
    while x > 0 do b, x = b + 1, math.floor(x / 2) end
    j = j + 2 ^ math.max(0, b - 3)
  end
  return c + 1
end

-- Eviction-aware stickiness (sticky_min_cached = share): whether replica `old`, the sticky
-- replica of request i, no longer holds `share` of its prompt's engine blocks. Judged only
-- when old's exact index is trusted now and the request came with exact hashes: the depth of
-- the grid covering `share` of the prompt must be in old's blocks in kv:idx, or in its
-- approximate record younger than lag (blocks sent whose events have not arrived yet). Else
-- (no exact index for old) the session stays, as without the option. Two HGETs; a third
-- (pc:idx) only when the exact index says evicted.
local function evicted(i, old, share)
  local info = ARGV[i + OWN + 4]
  if info == '' then return false end
  local kblocks, ablocks = string.match(info, '^%d+ (%d+) (%d+)$')
  kblocks, ablocks = tonumber(kblocks), tonumber(ablocks)
  local kh = ARGV[i + OWN + 3]
  if kblocks == 0 or #kh == 0 then return false end
  local d = redis.call('HGET', P .. 'kv:exact', old)
  if not (d and tonumber(d) >= math.floor(now / 1000)) then return false end
  local k = math.min(grid_index(kblocks, share * kblocks), #kh / HW)
  local v = redis.call('HGET', P .. 'kv:idx', block_at(kh, k))
  if v then
    for id in string.gmatch(v, '([^\31]+)\31%d+\31%d+\31') do
      if id == old then return false end
    end
  end
  local c, hs = settings(ARGV[i + OWN]), ARGV[i + OWN + 1]
  local n = #hs / HW
  if n > 0 and c.lag > 0 then
    local a = math.min(grid_index(ablocks, share * ablocks), n)
    local t = stamp_of(redis.call('HGET', P .. 'pc:idx', block_at(hs, a)), old)
    if t and t >= now - c.lag then return false end
  end
  return true
end

-- A call of no request has no settings to pin (min_cached): it does nothing.
if #ARGV <= HEAD then return {} end
local c = settings(ARGV[HEAD + 1 + OWN])
local out = acquire_all(OWN + 5, {
  choose = choose, granted = granted, evicted = evicted,
})
if out.err then return out end
bound_index(now, c.ttl, c.max_blocks, c.budget, total)
return out
