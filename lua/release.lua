-- release.lua: end one or more leases, in order.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     triples: server id, request id or '', token or ''
--          With a token, that lease ends (the token decides the replica). With a request id,
--          the oldest lease of that request on that replica ends. With neither, the lease on
--          that replica closest to expiry (normally the oldest) ends.
-- Returns  per triple, 1 if a lease ended, 0 if there was none (released twice, reaped,
--          unknown or removed replica: a harmless no-op, I6).
-- Keeps    I1 (count -1 with its lease, never below 0), I2, I6. It does not reap: acquires
--          do (they need exact counts), so a release, half of every request's cost, stays
--          at five commands and reads no clock.
local function release(id, req, token)
  local rec, toks
  if token ~= '' then
    rec = redis.call('HGET', P .. 'leases', token)
    if not rec then return 0 end
    id = server_of(rec)
  elseif req ~= '' then
    -- Every token listed under a request index field has that field as its lease record.
    rec = id .. SEP .. req
    toks = redis.call('HGET', P .. 'byreq', rec)
    if not toks then return 0 end
    token = string.match(toks, '^%S+')
  else
    local first = redis.call('ZRANGE', P .. 'held:' .. id, '0', '0')
    if #first == 0 then return 0 end
    token = first[1]
  end
  drop_lease(id, token, rec, toks)
  -- ZADD XX INCR changes the count only where the replica is (load, else draining).
  if not redis.call('ZADD', LOAD, 'XX', 'INCR', '-1', id) then
    redis.call('ZADD', P .. 'draining', 'XX', 'INCR', '-1', id)
  end
  return 1
end

local out = {}
for i = 1, #ARGV, 3 do
  out[#out + 1] = release(ARGV[i], ARGV[i + 1], ARGV[i + 2])
end
return out
