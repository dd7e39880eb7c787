-- prefix_cache.lua: route requests to the replica holding the longest prefix of their prompt,
-- and take a lease for each, atomically. Built on lib.lua's acquire_all, so retries, sticky
-- sessions, leases, draining and removal behave exactly as in the core's acquire.lua.
-- KEYS[1]  key prefix "rr:{NAME}:" (index keys: see prefix_cache_index.lua)
-- ARGV[1..6] as acquire.lua (ARGV[5] = 1: full_determinism, rendezvous hashing, no prefix)
-- ARGV[7..] six per request: request id, lease token, random integer (tie-break), settings,
--          block hashes, depths. settings = "abs rel min_match ttl_ms max_blocks budget record
--          refresh_ms" (space separated, the same for every request of a call); block hashes =
--          the chained hashes of the prompt at its sampled depths, 16 hex characters each,
--          concatenated (or empty); depths = those depths in blocks, space separated (the last
--          is the prompt's length in full blocks).
-- Choice   for a new session: least loaded (random tie-break) if the pool is imbalanced
--          (max - min > abs and max > rel * min, in-flight counts of the replicas taking new
--          sessions), if the prompt has no full block, or if the longest live prefix covers
--          fewer than min_match of its blocks; else the least loaded of the replicas holding
--          that longest prefix (random tie-break). The deepest held hash is found by binary
--          search over the chain (a replica holding depth i holds every depth < i).
-- Then     each new lease (balanced or sticky) records the prompt's blocks for its replica
--          (when record = 1; blocks it received less than refresh_ms ago are left as they
--          are, so a hot prefix costs reads, not writes), and the index is trimmed to its bounds.
-- Returns  as acquire.lua. Error NOSERVERS as acquire.lua, with nothing written.
-- Keeps    I1, I3, I6 (via acquire_all; holders outside P.."load" are never chosen), I4 (ties
--          broken by client entropy, never Lua's RNG), I5 (under full_determinism), I7.
local deterministic = ARGV[5] == '1'
local now = now_ms()
local cfg = nil

local function settings(s)
  if not cfg then
    local v = {}
    for x in string.gmatch(s, '%S+') do v[#v + 1] = tonumber(x) end
    cfg = { abs = v[1], rel = v[2], min_match = v[3], ttl = v[4], max_blocks = v[5],
            budget = v[6], record = v[7] == 1, refresh = v[8] }
  end
  return cfg
end

-- SGLang's cache-aware test: both the absolute and the relative spread exceed their limits.
local function imbalanced(c)
  local lo = redis.call('ZRANGE', P .. 'load', 0, 0, 'WITHSCORES')
  local hi = redis.call('ZRANGE', P .. 'load', -1, -1, 'WITHSCORES')
  if #lo == 0 then return false end
  local mn, mx = tonumber(lo[2]), tonumber(hi[2])
  return mx - mn > c.abs and mx > c.rel * mn
end

-- The deepest block of hs some live replica holds (0: none), and those replicas' loads.
local function longest_prefix(hs, n, since)
  local lo, hi, ids, loads = 0, n, {}, {}
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local i2, l2 = live_holders(block_at(hs, mid), since)
    if #i2 > 0 then
      lo, ids, loads = mid, i2, l2
    else
      hi = mid - 1
    end
  end
  return lo, ids, loads
end

local function choose(i)
  if deterministic then return rendezvous(ARGV[i]) end
  local rand = tonumber(ARGV[i + 2])
  local c = settings(ARGV[i + 3])
  local hs = ARGV[i + 4]
  local n = #hs / HW
  if n == 0 or imbalanced(c) then return least_loaded(rand) end
  local k, ids, loads = longest_prefix(hs, n, now - c.ttl)
  if k == 0 then return least_loaded(rand) end
  local depths = {}
  for d in string.gmatch(ARGV[i + 5], '%d+') do depths[#depths + 1] = tonumber(d) end
  if depths[k] < c.min_match * depths[n] then return least_loaded(rand) end
  local best, ties = nil, {}
  for k = 1, #ids do
    if not best or loads[k] < best then
      best, ties = loads[k], { ids[k] }
    elseif loads[k] == best then
      ties[#ties + 1] = ids[k]
    end
  end
  return ties[rand % #ties + 1]
end

local function granted(i, id, token)
  local c, hs = settings(ARGV[i + 3]), ARGV[i + 4]
  local n = #hs / HW
  if c.record and n > 0 then
    record_blocks(id, hs, fresh_depth(id, hs, n, now - c.refresh) + 1, n, now)
  end
end

local out = acquire_all(6, choose, granted)
if out.err or #ARGV < 7 then return out end
local c = settings(ARGV[10])
bound_index(now, c.ttl, c.max_blocks, c.budget)
return out
