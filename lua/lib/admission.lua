-- lib/admission.lua: capacity, ejected replicas set aside, and waiting acquires (uses base).
-- Capacity, ejection and waiting (docs/design.md I10, I11). A replica that is full (its count
-- reached P.."capacity"[id]) or ejected (in P.."ejected") takes no acquire at all: it waits in
-- P.."off" with its count, P.."back"[id] naming the set it returns to ('load' or 'draining').
-- Acquires never look there, so every policy skips it and a sticky session on it is balanced
-- anew, as for a removed replica. Waiting acquires (FIFO across processes): P.."waiters" ZSET
-- ticket -> arrival number, P.."waiting" HASH ticket -> holder..SEP..give-up time..SEP..arrived
-- at (ms); a waiter blocks on P.."wake:"..ticket (BLPOP) and is woken when a replica may take
-- new sessions again.
-- An acquire's context (lib/base.lua) holds cx.caps, set (one EXISTS per call) while some
-- replica declares a capacity, cx.ticket, the waiting ticket that acquire serves (ARGV[3])
-- while someone waits, and cx.excl, the replicas it leaves out.
local ADMIT = nil -- once per library: the procedures below, which hold no state of a call

-- The procedures, made on first use: each local function costs its making on every script
-- call, so a script that needs none (a release, or an acquire in a pool with no capacity, no
-- ejection due and nobody waiting) makes none; lib/leases.lua's end_lease reaches them only
-- for a replica in neither `load` nor `draining`. A Functions library makes them once.
local function admit()
  if ADMIT then return ADMIT end
  local M = {}

  function M.capacity_of(id)
    local c = redis.call('HGET', P .. 'capacity', id)
    return c and tonumber(c)
  end

  -- The first live waiter, after dropping those whose time is up or whose holder is dead (a
  -- crashed process leaves nothing behind for longer than its lease ttl).
  function M.first_waiter(now)
    local horizon = nil
    while true do
      local head = redis.call('ZRANGE', P .. 'waiters', '0', '0')[1]
      if not head then return nil end
      local w = redis.call('HGET', P .. 'waiting', head)
      local holder, til
      if w then
        local a = string.find(w, SEP, 1, true)
        local b = string.find(w, SEP, a + 1, true)
        holder, til = string.sub(w, 1, a - 1), tonumber(string.sub(w, a + 1, b - 1))
      end
      local alive = false
      if holder then
        horizon = horizon or liveness(now)
        alive = tonumber(redis.call('ZSCORE', P .. 'holders', holder) or 0) > horizon
      end
      if w and til > now and alive then return head end
      redis.call('ZREM', P .. 'waiters', head)
      redis.call('HDEL', P .. 'waiting', head)
      redis.call('DEL', P .. 'wake:' .. head)
      redis.call('HINCRBY', P .. 'waitstats', 'abandoned', '1')
    end
  end

  -- Wake the first waiter when a replica takes new sessions (one wake pending at most; a
  -- spurious one only makes the waiter try again). The wake key expires with the waiter.
  function M.wake_first()
    if redis.call('EXISTS', P .. 'waiters') == 0 then return end
    local head = M.first_waiter(now_ms())
    if not head or redis.call('ZCARD', LOAD) == 0 then return end
    local key = P .. 'wake:' .. head
    if redis.call('LLEN', key) == 0 then
      redis.call('LPUSH', key, '1')
      redis.call('PEXPIRE', key, '60000')
    end
  end

  -- Move id from `load` or `draining` into `off` with its count. True if it moved.
  function M.take_off(id)
    for _, name in ipairs({ 'load', 'draining' }) do
      local c = redis.call('ZSCORE', P .. name, id)
      if c then
        redis.call('ZREM', P .. name, id)
        redis.call('ZADD', P .. 'off', c, id)
        redis.call('HSET', P .. 'back', id, name)
        return true
      end
    end
    return false
  end

  -- Return id from `off` to where it came from when it is neither full nor ejected (waking
  -- the first waiter if it takes new sessions again). True if it returned.
  function M.put_back(id)
    local c = redis.call('ZSCORE', P .. 'off', id)
    if not c then return false end
    local cap = M.capacity_of(id)
    if (cap and tonumber(c) >= cap) or redis.call('ZSCORE', P .. 'ejected', id) then
      return false
    end
    local back = redis.call('HGET', P .. 'back', id) or 'load'
    redis.call('ZREM', P .. 'off', id)
    redis.call('HDEL', P .. 'back', id)
    redis.call('ZADD', P .. back, c, id)
    if back == 'load' then M.wake_first() end
    return true
  end

  -- After an acquire counted +1 on id: take it off when that filled it. True if it did.
  function M.filled(id)
    local cap = M.capacity_of(id)
    if not cap then return false end
    local c = redis.call('ZSCORE', LOAD, id) or redis.call('ZSCORE', P .. 'draining', id)
    if c and tonumber(c) >= cap then return M.take_off(id) end
    return false
  end

  -- Ejections whose time is up end (the replica returns unless it is full).
  function M.restore_due(now)
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'ejected', '-inf', int(now))) do
      redis.call('ZREM', P .. 'ejected', id)
      redis.call('HDEL', P .. 'eject_why', id)
      M.put_back(id)
    end
  end

  -- An acquire that finds no replica for a request is refused with NOCAPACITY while some
  -- replica is full or ejected or a request waits (the caller may wait for one), or a batch
  -- needs more places than are free (`full`), else NOSERVERS; nothing of it is written.
  -- With an exclusion (cx.excl), a replica that is off counts only if it is not excluded
  -- (waiting for an excluded one would never end in a place), and NOSERVERS says when
  -- excluded replicas were all that took new sessions.
  function M.refused(cx, full)
    local excl = cx.excl
    local wait = full or redis.call('EXISTS', P .. 'off', P .. 'waiters') > 0
    if wait and excl and not full and redis.call('EXISTS', P .. 'waiters') == 0 then
      wait = false
      for _, id in ipairs(redis.call('ZRANGE', P .. 'off', '0', '-1')) do
        if not excl.set[id] then
          wait = true
          break
        end
      end
    end
    if wait then
      return redis.error_reply('NOCAPACITY every replica that could take the request is full '
        .. 'or ejected, or earlier requests are waiting for one')
    end
    if excl then
      for _, b in ipairs(excl.back) do
        if b[1] == LOAD then
          return redis.error_reply('NOSERVERS every replica accepting new sessions is excluded')
        end
      end
    end
    return redis.error_reply('NOSERVERS no replica is accepting new sessions')
  end

  -- With ejected_sticky = 'wait': the refusal of a sticky session whose replica `old` is
  -- ejected (it keeps its entry and waits for the replica), or nil.
  function M.held(old, now)
    local til = redis.call('ZSCORE', P .. 'ejected', old)
    if not til or not redis.call('ZSCORE', P .. 'off', old) then return nil end
    return redis.error_reply('EJECTED ' .. int(math.max(0, tonumber(til) - now)) .. ' ' .. old)
  end

  -- Free places in `load` (math.huge when a replica there has no capacity).
  function M.room()
    local flat = redis.call('ZRANGE', LOAD, '0', '-1', 'WITHSCORES')
    local n = #flat / 2
    local ids = {}
    for j = 1, n do ids[j] = flat[2 * j - 1] end
    local caps = hmget(P .. 'capacity', ids, n)
    local free = 0
    for j = 1, n do
      if not caps[j] then return math.huge end
      free = free + tonumber(caps[j]) - tonumber(flat[2 * j])
    end
    return free
  end

  -- lib/picking.lua's least_loaded while cx.caps: least count / capacity, compared exactly
  -- (a * d < c * b); a replica without a declared capacity counts as large as the largest
  -- declared among them. Ties broken by the client's integer, as least_loaded's. O(N).
  function M.least_relative(rand)
    local flat = redis.call('ZRANGE', LOAD, '0', '-1', 'WITHSCORES')
    local n = #flat / 2
    if n == 0 then return nil end
    local ids = {}
    for j = 1, n do ids[j] = flat[2 * j - 1] end
    local caps = hmget(P .. 'capacity', ids, n)
    local top = 1
    for j = 1, n do
      local c = tonumber(caps[j] or 0)
      if c > top then top = c end
    end
    local ties, bn, bd = {}, nil, nil
    for j = 1, n do
      local num, den = tonumber(flat[2 * j]), tonumber(caps[j] or top)
      if not bn or num * bd < bn * den then
        ties, bn, bd = { ids[j] }, num, den
      elseif num * bd == bn * den then
        ties[#ties + 1] = ids[j]
      end
    end
    return ties[rand % #ties + 1]
  end

  -- Run by an acquire (lib/acquiring.lua) before anything of its requests is written, while
  -- some replica declares a capacity or someone waits. An acquire never overtakes an earlier
  -- waiter (FIFO across processes): while one waits, only the first waiter's call, or a
  -- resent one whose leases were all granted, passes. A batch is granted whole or refused:
  -- with capacities it passes only if the free places in `load` cover its requests not
  -- granted yet (conservative: a sticky one may not need one). Returns the refusal, or nil.
  function M.admission(cx, stride)
    local caps = redis.call('EXISTS', P .. 'capacity') == 1
    cx.caps = caps
    if ARGV[3] ~= '' then cx.ticket = ARGV[3] end
    local head = M.first_waiter(cx.now)
    local queued = head and head ~= cx.ticket
    local n = (#ARGV - HEAD) / stride
    if not queued and not (caps and n > 1) then return nil end
    local toks = {}
    for j = 1, n do toks[j] = ARGV[HEAD + 2 + (j - 1) * stride] end
    local recs, fresh = hmget(P .. 'leases', toks, n), 0
    for j = 1, n do
      if not recs[j] then fresh = fresh + 1 end
    end
    if fresh == 0 then return nil end
    if queued or (caps and M.room() < fresh) then return M.refused(cx, true) end
    return nil
  end

  -- Exclusion (an acquire's ARGV[HEAD]: server ids joined by SEP; "" = none, the default,
  -- which costs the acquire one comparison): replicas the call must not route to, new and
  -- sticky requests alike (a caller's retry leaves out every replica that already failed the
  -- request). They are set aside for the call: out of `load` and `draining` with their counts,
  -- after admission and before any pick (cx.excl), and put back unchanged by readmit() before
  -- the script returns. Every policy's pick reads those sets, so none reaches them; a sticky
  -- session on one is placed anew and pinned where it goes, as on an ejected replica under
  -- ejected_sticky = 'move' (never held by 'wait': the caller asked for another replica). A
  -- token already granted still returns its lease, wherever it is. I1 holds at every step.
  function M.exclude(cx, list)
    local set, back = {}, {}
    for id in string.gmatch(list, '[^\31]+') do
      if not set[id] then
        set[id] = true
        for _, zs in ipairs({ LOAD, P .. 'draining' }) do
          local c = redis.call('ZSCORE', zs, id)
          if c then
            redis.call('ZREM', zs, id)
            back[#back + 1] = { zs, c, id }
            break
          end
        end
      end
    end
    cx.excl = { set = set, back = back }
  end

  -- The excluded replicas back where they were, with their counts; returns `reply` (a
  -- refusal made while they were aside).
  function M.readmit(cx, reply)
    for _, b in ipairs(cx.excl and cx.excl.back or {}) do redis.call('ZADD', b[1], b[2], b[3]) end
    return reply
  end

  -- The reply of a successful acquire that served the first waiter (cx.ticket): it leaves the
  -- queue (its wait counted in P.."waitstats") and the next one is woken if a replica takes
  -- new sessions.
  function M.served(cx, out)
    if out.err then return out end
    local ticket = cx.ticket
    local w = redis.call('HGET', P .. 'waiting', ticket)
    if w then
      local waited = cx.now - tonumber(string.match(w, '(%d+)$'))
      redis.call('ZREM', P .. 'waiters', ticket)
      redis.call('HDEL', P .. 'waiting', ticket)
      redis.call('DEL', P .. 'wake:' .. ticket)
      redis.call('HINCRBY', P .. 'waitstats', 'served', '1')
      redis.call('HINCRBY', P .. 'waitstats', 'waited_ms', int(waited))
      if waited > tonumber(redis.call('HGET', P .. 'waitstats', 'max_ms') or 0) then
        redis.call('HSET', P .. 'waitstats', 'max_ms', int(waited))
      end
      M.wake_first()
    end
    return out
  end

  ADMIT = M
  return M
end

