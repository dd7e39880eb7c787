-- least_tokens.lua: route new sessions to the replica with the fewest in-flight prompt tokens.
-- The lib/ parts on the Uses line are prepended: leases, stickiness and reaping are the core's.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV[1..HEAD] as acquire.lua (the balancer's settings, holder, waiting ticket, exclusion)
-- ARGV[HEAD + 1..] per request: the core's OWN (request id, lease token, random integer, group
--          id), then the weight (prompt tokens, an integer >= 0)
-- Returns  as acquire.lua: per request, server id, JSON metadata, 0 balanced / 1 sticky / 2 retry.
-- Keeps    I1-I7 as acquire.lua (acquire_all), plus: P.."weighted" holds, per replica, the sum
--          of the weights of its live leases; each weighed lease carries its weight in its
--          record, and every path that ends a lease (release, reap, remove, max age) goes
--          through lib/leases.lua's end_lease, which subtracts it, so the sums stay exact.
-- Choice   least in-flight tokens among the replicas taking new sessions (in P.."load"; a
--          draining replica gets only its sticky sessions); ties uniformly at random from the
--          client's integer (never Lua's RNG, DESIGN.md). O(log N) while no replica drains;
--          O(N) while one does (the draining ones must be skipped). full_determinism routes by
--          rendezvous hashing, as the core does (I5). With engine scoring pinned: fewest
--          tokens in flight plus what the engine's fresh report adds, valued in tokens
--          (P.."wscore", lib/scoring.lua); O(log N) while nothing drains or is off.
-- Uses     lib/base, lib/holders, lib/admission, lib/picking, lib/acquiring
local deterministic = config(ARGV[1]).deterministic
local W, L = P .. 'weighted', P .. 'load'

local function least_weighted(cx, rand)
  local n = redis.call('ZCARD', L)
  if n == 0 then return nil end
  if not cx.excl and redis.call('ZCARD', P .. 'draining') == 0 and redis.call('ZCARD', W) == n then
    -- `weighted` holds exactly the pool, and the pool is `load`: rank it directly.
    local first = redis.call('ZRANGE', W, 0, 0, 'WITHSCORES')
    local ties = redis.call('ZCOUNT', W, first[2], first[2])
    local r = rand % ties
    if r == 0 then return first[1] end
    return redis.call('ZRANGE', W, r, r)[1]
  end
  local best, ties = nil, {}
  for _, id in ipairs(redis.call('ZRANGE', L, 0, -1)) do
    local w = tonumber(redis.call('ZSCORE', W, id) or 0)
    if best == nil or w < best then
      best, ties = w, { id }
    elseif w == best then
      ties[#ties + 1] = id
    end
  end
  return ties[rand % #ties + 1]
end

return acquire_all(OWN + 1, {
  choose = function(i, cx)
    if deterministic then return rendezvous(ARGV[i]) end
    if cx.engine then return scoring().least_tokens(cx, tonumber(ARGV[i + 2])) end -- lib/scoring
    return least_weighted(cx, tonumber(ARGV[i + 2]))
  end,
  weight = function(i) return tonumber(ARGV[i + OWN]) end,
})
