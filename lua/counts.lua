-- counts.lua: in-flight counts, without the rest of the status (cheap reads for callers).
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     server ids to read; none = every replica in the pool
-- Returns  flat array: server id, in-flight, ... for the ids that are in the pool.
-- Keeps    read only.
-- Uses     lib/base
local out = {}
if #ARGV == 0 then
  for _, zs in ipairs({ 'load', 'draining', 'off' }) do
    for _, v in ipairs(redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES')) do out[#out + 1] = v end
  end
  return out
end
for _, id in ipairs(ARGV) do
  local zs = pool_of(id) or (redis.call('ZSCORE', P .. 'off', id) and P .. 'off')
  if zs then
    out[#out + 1] = id
    out[#out + 1] = redis.call('ZSCORE', zs, id)
  end
end
return out
