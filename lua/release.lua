-- release.lua: end one or more leases, in order.
-- KEYS[1]  key prefix "rr:{NAME}:"
-- ARGV     quads: server id, request id or '' (or SEP..request id: see Which), token or '',
--          operation id (client-made,
--          unique per call, the same in a resent copy; "!"/"+" first: see Health). Which
--          lease ends: see Which below.
-- Returns  per quad: the token of the lease it ended, 1 if an earlier copy of this call
--          ended it (a resend after a timeout), 0 if there was none (released twice,
--          reclaimed, unknown or removed replica: a harmless no-op, I6).
-- Keeps    I1 (count -1 with its lease, never below 0), I2, I6, I10, I11. Safe to resend: the
--          operation id is remembered in P.."remembered" (lib/leases.lua; rotated by
--          heartbeat.lua), so a second copy reports the first one's result and never ends
--          another lease.
-- Which    With a token, that lease (the token decides the replica). With a request id, the
--          oldest lease of that request on that replica; with neither, the oldest lease on
--          that replica. "?token" with a request id is a hint: the releasing process's own
--          lease of that request, ended if it is still there (no index lookup), else nothing
--          (it was reclaimed or ended: the request's other leases there are other processes'
--          turns, I10); with SEP..request id, the same (a release by replica only that ends
--          the process's own lease). The fallbacks (oldest) serve only a process that never
--          held the request there: it sends no hint. The client learns the token it ended.
-- Health   "!" first: the request failed, which counts toward ejecting its replica
--          (lib/health.lua), once per lease; "+" first: it succeeded with ejection on, which
--          ends the replica's failure streak.
-- Uses     lib/base, lib/admission, lib/leases, lib/health
-- In a batch, the writes every release makes that commute are grouped for the end of the
-- call: the operation ids remembered (one HMGET and one HSET) and the leases leaving their
-- holders' sets (one ZREM per holder). Nothing between reads them: a copy of the same call is
-- another script call. A single release writes them at once (no tables to make).
local done, unowned = nil, nil
if #ARGV > 4 then done, unowned = {}, {} end
local cx = {} -- the call's context (lib/base.lua): whether a failure streak exists

local function release(id, req, token, op)
  local rec, toks
  -- A request id after SEP: a release by replica only whose hint is the releasing process's
  -- own lease of that request (checked as below).
  local named = req
  if string.byte(req) == 31 then named, req = string.sub(req, 2), '' end
  if token ~= '' then
    local hinted = string.byte(token) == 63 -- "?token": the releasing process's own lease
    if hinted then token = string.sub(token, 2) end
    rec = redis.call('HGET', P .. 'leases', token)
    -- A hint names a lease of that request on that replica (its token may since have been
    -- granted again elsewhere, by a retry after the lease ended).
    local field = hinted and rec and id .. SEP .. named .. SEP
    if field and string.sub(rec, 1, #field) ~= field then rec = nil end
    if not rec then
      -- Not a lease (any more): ended by an earlier copy of this call, or by another
      -- (reclaimed, released). A hint's too: the releasing process held that request there,
      -- so no other lease of it (another process's) is its to end.
      if was_released(op) then return 1 end
      return 0
    end
  else
    if was_released(op) then return 1 end
    if req ~= '' then
      -- Every token listed under a request index field has that field as its record's start.
      toks = redis.call('HGET', P .. 'byreq', id .. SEP .. req)
      token = toks and string.match(toks, '^%S+')
    else
      token = redis.call('ZRANGE', P .. 'held:' .. id, '0', '0')[1]
    end
    if not token then return 0 end
  end
  local sid = end_lease(token, rec, toks, unowned)
  if done then
    done[#done + 1] = op
  else
    remember_release(op)
  end
  released(cx, sid, op)
  return token
end

local out = {}
for i = 1, #ARGV, 4 do
  out[#out + 1] = release(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
end
if done then
  if #done > 0 then remember_releases(done) end
  for holder, toks in pairs(unowned) do flat_call('ZREM', P .. 'owned:' .. holder, toks) end
end
return out
