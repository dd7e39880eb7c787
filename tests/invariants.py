"""Checks of docs/design.md's invariants on the raw keys, as an operator would read them."""

from __future__ import annotations

from typing import Any

import redis

from redis_router import outbox
from redis_router.core import STICKY_BUCKETS

SEP = "\x1f"


def prefix(name: str) -> str:
    return f"rr:{{{name}}}:"


# One atomic read of every key the invariants relate: checks made while other processes act
# (e.g. verl's fire-and-forget releases) must never see half of a script's writes.
_SNAPSHOT = """
local P = KEYS[1]
local pool = {}
for _, zs in ipairs({'load', 'draining', 'off'}) do
  local ids = redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES')
  for i = 1, #ids, 2 do pool[#pool + 1] = {zs, ids[i], ids[i + 1]} end
end
local held = {}
for _, row in ipairs(pool) do
  held[#held + 1] = redis.call('ZRANGE', P .. 'held:' .. row[2], 0, -1)
end
local holders = redis.call('ZRANGE', P .. 'holders', 0, -1)
local owned = {}
for _, key in ipairs(redis.call('KEYS', P .. 'owned:*')) do
  owned[#owned + 1] = {key, redis.call('ZRANGE', key, 0, -1)}
end
local sticky = {}
for _, key in ipairs(redis.call('KEYS', P .. 'sticky*:*')) do
  sticky[#sticky + 1] = {key, redis.call('HGETALL', key)}
end
return {pool, held, redis.call('HKEYS', P .. 'servers'), redis.call('HGETALL', P .. 'leases'),
        redis.call('HGETALL', P .. 'byreq'), redis.call('KEYS', P .. 'held:*'), holders, owned,
        redis.call('ZRANGE', P .. 'weighted', 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', P .. 'capacity'), redis.call('ZRANGE', P .. 'ejected', 0, -1),
        redis.call('ZRANGE', P .. 'escore', 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', P .. 'eextra'),
        redis.call('EXISTS', P .. 'escore'),
        redis.call('ZRANGE', P .. 'wscore', 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', P .. 'wextra'), redis.call('EXISTS', P .. 'wscore'),
        sticky, redis.call('HGETALL', P .. 'pinned'), redis.call('TIME'),
        redis.call('HGET', P .. 'config', 'sticky_ttl_ms') or ''}
"""


def _pairs(flat: list) -> dict:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def check(r: redis.Redis, name: str) -> dict[str, int]:
    """Assert I1 (count == leases, never negative), I2's reachability (every lease is owned
    by a registered holder, every owned token is a lease) and index consistency on one atomic
    snapshot of the balancer's keys; return the counts."""
    p = prefix(name)
    snap = r.eval(_SNAPSHOT, 1, p)
    pool, held_lists, servers, flat_leases, flat_byreq, held_keys, holders, owned_rows, wflat = (
        snap[:9]
    )
    caps = {sid: int(c) for sid, c in _pairs(snap[9]).items()}
    ejected = set(snap[10])
    counts: dict[str, int] = {}
    for zs, sid, score in pool:
        assert sid not in counts, f"{sid!r} is in two of load, draining, off"
        counts[sid] = int(float(score))
        # I10: a replica is off exactly while it is full or ejected (so no acquire reaches
        # it; a count above capacity only follows a capacity lowered below it).
        full = sid in caps and counts[sid] >= caps[sid]
        assert (zs == "off") == (full or sid in ejected), f"{sid!r} in {zs}: full {full}"
    assert set(caps) <= set(counts), "capacity of a replica not in the pool"
    assert ejected <= set(counts), "ejection of a replica not in the pool"
    assert set(counts) == set(servers), "pool sorted sets disagree with servers"
    held = {sid: set(tokens) for (_zs, sid, _s), tokens in zip(pool, held_lists, strict=True)}
    leases, byreq = _pairs(flat_leases), _pairs(flat_byreq)
    per_server: dict[str, int] = dict.fromkeys(counts, 0)
    owned = {key[len(p) + 6 :]: set(tokens) for key, tokens in owned_rows}
    assert set(owned) <= set(holders), f"leases of unregistered holders {set(owned) - set(holders)}"
    weighed: dict[str, int] = {}
    for token, record in leases.items():
        sid, rid, holder, *weight = record.split(SEP)
        field = sid + SEP + rid
        weighed[sid] = weighed.get(sid, 0) + sum(int(w) for w in weight)
        assert sid in counts, f"lease {token} on {sid!r}, which is not in the pool (I6)"
        assert token in held[sid], f"lease {token} not held"
        assert token in byreq.get(field, "").split(), f"lease {token} not indexed"
        assert token in owned.get(holder, ()), f"lease {token} not owned by its holder {holder}"
        per_server[sid] += 1
    weighted = {sid: int(float(w)) for sid, w in _pairs(wflat).items() if float(w) != 0}
    assert weighted == {s: w for s, w in weighed.items() if w}, "weighted load != lease weights"
    for holder, tokens in owned.items():
        for t in tokens:
            assert t in leases, f"holder {holder} owns {t}, which is no lease"
    for sid, n in counts.items():
        assert n >= 0, f"negative count on {sid!r} (I1)"
        assert n == len(held[sid]) == per_server[sid], (
            f"{sid!r}: count {n}, held {len(held[sid])}, leases {per_server[sid]} (I1)"
        )
    for field, tokens in byreq.items():
        for t in tokens.split():
            assert SEP.join(leases.get(t, "").split(SEP)[:2]) == field, f"byreq {field!r}: {t}"
    for key in held_keys:
        assert key[len(p) + 5 :] in counts, f"leftover {key!r} of a removed replica"
    # I12: while engine-aware scores exist, each replica's is its count plus its extra.
    extra = {sid: float(e) for sid, e in _pairs(snap[12]).items()}
    assert set(extra) <= set(counts), "engine extra of a replica not in the pool"
    if snap[13]:
        scores = {sid: float(s) for sid, s in _pairs(snap[11]).items()}
        assert set(scores) == set(counts), "engine scores disagree with the pool (I12)"
        for sid, n in counts.items():
            assert abs(scores[sid] - n - extra.get(sid, 0.0)) < 1e-6, (
                f"{sid!r}: engine score {scores[sid]}, count {n}, extra {extra.get(sid)} (I12)"
            )
    # ... and least_tokens' engine-aware scores are its tokens in flight plus its extra.
    wextra = {sid: float(e) for sid, e in _pairs(snap[15]).items()}
    assert set(wextra) <= set(counts), "engine extra (tokens) of a replica not in the pool"
    if snap[16]:
        wscores = {sid: float(s) for sid, s in _pairs(snap[14]).items()}
        assert set(wscores) == set(counts), "least_tokens' engine scores disagree with the pool"
        for sid in counts:
            tokens = weighted.get(sid, 0)
            assert abs(wscores[sid] - tokens - wextra.get(sid, 0.0)) < 1e-6, (
                f"{sid!r}: tokens score {wscores[sid]}, tokens {tokens}, extra "
                f"{wextra.get(sid)} (I12)"
            )
    _pinned(p, snap[17], _pairs(snap[18]), snap[19], snap[20])
    return counts


def _pinned(p: str, buckets: list, pinned: dict, time: list, ttl: str) -> None:
    """I13: each sticky bucket's per-replica counts (stickyn:<b>) are its entries naming each
    replica; while P pinned is current (its "@" is the oldest live bucket), each replica's
    pinned sessions are its entries in the live buckets."""
    entries: dict[int, dict[str, int]] = {}
    counted: dict[int, dict[str, int]] = {}
    for key, flat in buckets:
        family, b = key[len(p) :].split(":")
        if family == "sticky":
            per = entries.setdefault(int(b), {})
            for sid in _pairs(flat).values():
                per[sid] = per.get(sid, 0) + 1
        elif family == "stickyn":
            counted[int(b)] = {sid: int(n) for sid, n in _pairs(flat).items() if int(n)}
    for b in set(entries) | set(counted):
        assert entries.get(b, {}) == counted.get(b, {}), (
            f"sticky bucket {b}: entries per replica {entries.get(b)}, counts {counted.get(b)}"
        )
    if "@" not in pinned or not ttl:
        return  # not made yet (or spread_sessions off): the next tie makes it
    sticky_ms = int(ttl)
    width = -(-sticky_ms // STICKY_BUCKETS)
    now = int(time[0]) * 1000 + int(time[1]) // 1000
    cur = now // width
    lo = max(cur - -(-sticky_ms // width), (now - sticky_ms) // width)
    if int(pinned["@"]) != lo:
        return  # a bucket expired since: the next tie makes it again from the live ones
    want: dict[str, int] = {}
    for b, per in counted.items():
        if b >= lo:
            for sid, n in per.items():
                want[sid] = want.get(sid, 0) + n
    got = {sid: int(n) for sid, n in pinned.items() if sid != "@" and int(n)}
    assert got == {sid: n for sid, n in want.items() if n}, (
        f"pinned sessions {got}, live sticky entries per replica {want} (I13)"
    )


def silence(lb: Any) -> None:
    """Stop a balancer's heartbeats, as if its process had died (SIGKILL): its leases are
    reclaimable lease_ttl after its last heartbeat."""
    lb._keeper.stop()


def fair(counts: dict[str, int], total: int, replicas: int, sds: float = 5.0) -> bool:
    """Every replica's share of `total` uniform picks is within `sds` binomial standard
    deviations of the mean (a fair balancer fails this with probability < 1e-5)."""
    mean = total / replicas
    sd = (total * (1 / replicas) * (1 - 1 / replicas)) ** 0.5
    return len(counts) == replicas and all(abs(c - mean) <= sds * sd for c in counts.values())


def listen(lb: Any, seconds: float, ttl_ms: int = 500) -> None:
    """For ``seconds``, heartbeats of a holder that owns and reaps nothing (budget 0), every
    20 ms: Redis hears a living process meanwhile, as when other workers' keepers beat, so a
    silenced holder whose deadline passes is dead rather than on probation (a stretch in which
    nobody is heard looks to Redis like a pause of its own)."""
    import time

    from redis_router.core import Call
    from redis_router.scripts import load

    args = lb._core.heartbeat_args(f"{lb._core.holder}-listener", lease_ms=ttl_ms, budget=0)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        lb._exec(Call(load("heartbeat"), args))
        time.sleep(0.02)


def settled(client: redis.Redis) -> redis.Redis:
    """``client``, made to read what this process's sync releases did.

    A release does not wait for Redis: it is written at once and answered in the background
    (redis_router.outbox), so a look on another connection right after ``release()`` could run
    before it. Before each command ``client`` reads the replies of every release written to its
    server, as ``Released.result()`` would; the asyncio balancers' releases are answered on
    their own loop and are not covered. Tests that act while releases are still unanswered
    (killing their connection) use a client of their own.
    """
    pool = client.connection_pool
    where = (pool.connection_kwargs.get("host"), pool.connection_kwargs.get("port"))
    get_connection = pool.get_connection

    def answered_first(*args: Any, **kwargs: Any) -> Any:
        for box in list(outbox._open):
            kw = box._pool.connection_kwargs
            if box.unanswered and (kw.get("host"), kw.get("port")) == where:
                box.drain()
        return get_connection(*args, **kwargs)

    pool.get_connection = answered_first  # type: ignore[method-assign]
    return client
