"""Checks of DESIGN.md's invariants on the raw keys, as an operator would read them."""

from __future__ import annotations

import redis

SEP = "\x1f"


def prefix(name: str) -> str:
    return f"rr:{{{name}}}:"


# One atomic read of every key the invariants relate: checks made while other processes act
# (e.g. verl's fire-and-forget releases) must never see half of a script's writes.
_SNAPSHOT = """
local P = KEYS[1]
local pool = {}
for _, zs in ipairs({'load', 'draining'}) do
  local ids = redis.call('ZRANGE', P .. zs, 0, -1, 'WITHSCORES')
  for i = 1, #ids, 2 do pool[#pool + 1] = {zs, ids[i], ids[i + 1]} end
end
local held = {}
for _, row in ipairs(pool) do
  held[#held + 1] = redis.call('ZRANGE', P .. 'held:' .. row[2], 0, -1)
end
return {pool, held, redis.call('HKEYS', P .. 'servers'), redis.call('HGETALL', P .. 'leases'),
        redis.call('HGETALL', P .. 'byreq'), redis.call('KEYS', P .. 'held:*')}
"""


def _pairs(flat: list) -> dict:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def check(r: redis.Redis, name: str) -> dict[str, int]:
    """Assert I1 (count == live leases, never negative) and index consistency on one atomic
    snapshot of the balancer's keys; return the counts."""
    p = prefix(name)
    pool, held_lists, servers, flat_leases, flat_byreq, held_keys = r.eval(_SNAPSHOT, 1, p)
    counts: dict[str, int] = {}
    for _zs, sid, score in pool:
        assert sid not in counts, f"{sid!r} is both taking and draining"
        counts[sid] = int(float(score))
    assert set(counts) == set(servers), "pool sorted sets disagree with servers"
    held = {sid: set(tokens) for (_zs, sid, _s), tokens in zip(pool, held_lists, strict=True)}
    leases, byreq = _pairs(flat_leases), _pairs(flat_byreq)
    per_server: dict[str, int] = dict.fromkeys(counts, 0)
    for token, field in leases.items():
        sid = field.split(SEP, 1)[0]
        assert sid in counts, f"lease {token} on {sid!r}, which is not in the pool (I6)"
        assert token in held[sid], f"lease {token} not held"
        assert token in byreq.get(field, "").split(), f"lease {token} not indexed"
        per_server[sid] += 1
    for sid, n in counts.items():
        assert n >= 0, f"negative count on {sid!r} (I1)"
        assert n == len(held[sid]) == per_server[sid], (
            f"{sid!r}: count {n}, held {len(held[sid])}, leases {per_server[sid]} (I1)"
        )
    for field, tokens in byreq.items():
        for t in tokens.split():
            assert leases.get(t) == field, f"byreq {field!r} names a dead lease {t}"
    for key in held_keys:
        assert key[len(p) + 5 :] in counts, f"leftover {key!r} of a removed replica"
    return counts


def fair(counts: dict[str, int], total: int, replicas: int, sds: float = 5.0) -> bool:
    """Every replica's share of `total` uniform picks is within `sds` binomial standard
    deviations of the mean (a fair balancer fails this with probability < 1e-5)."""
    mean = total / replicas
    sd = (total * (1 / replicas) * (1 - 1 / replicas)) ** 0.5
    return len(counts) == replicas and all(abs(c - mean) <= sds * sd for c in counts.values())
