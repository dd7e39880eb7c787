"""Checks of DESIGN.md's invariants on the raw keys, as an operator would read them."""

from __future__ import annotations

import redis

SEP = "\x1f"


def prefix(name: str) -> str:
    return f"rr:{{{name}}}:"


def check(r: redis.Redis, name: str) -> dict[str, int]:
    """Assert I1 (count == live leases, never negative) and index consistency; return counts."""
    p = prefix(name)
    counts: dict[str, int] = {}
    for zs in ("load", "draining"):
        for sid, score in r.zrange(p + zs, 0, -1, withscores=True):
            assert sid not in counts, f"{sid!r} is both taking and draining"
            counts[sid] = int(score)
    assert set(counts) == set(r.hkeys(p + "servers")), "pool sorted sets disagree with servers"
    leases = r.hgetall(p + "leases")
    per_server: dict[str, int] = dict.fromkeys(counts, 0)
    for token, field in leases.items():
        sid = field.split(SEP, 1)[0]
        assert sid in counts, f"lease {token} on {sid!r}, which is not in the pool (I6)"
        assert r.zscore(p + "held:" + sid, token) is not None, f"lease {token} not held"
        assert token in r.hget(p + "byreq", field).split(), f"lease {token} not indexed"
        per_server[sid] += 1
    for sid, n in counts.items():
        assert n >= 0, f"negative count on {sid!r} (I1)"
        assert n == r.zcard(p + "held:" + sid) == per_server[sid], (
            f"{sid!r}: count {n}, held {r.zcard(p + 'held:' + sid)}, leases {per_server[sid]} (I1)"
        )
    for field, tokens in r.hgetall(p + "byreq").items():
        for t in tokens.split():
            assert leases.get(t) == field, f"byreq {field!r} names a dead lease {t}"
    for key in r.scan_iter(match=p + "held:*"):
        assert key[len(p) + 5 :] in counts, f"leftover {key!r} of a removed replica"
    return counts


def fair(counts: dict[str, int], total: int, replicas: int, sds: float = 5.0) -> bool:
    """Every replica's share of `total` uniform picks is within `sds` binomial standard
    deviations of the mean (a fair balancer fails this with probability < 1e-5)."""
    mean = total / replicas
    sd = (total * (1 / replicas) * (1 - 1 / replicas)) ** 0.5
    return len(counts) == replicas and all(abs(c - mean) <= sds * sd for c in counts.values())
