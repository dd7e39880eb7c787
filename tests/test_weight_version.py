"""bump_weight_version: after new weights, every cache-locality record goes at once; leases and
counts stay exact."""

from __future__ import annotations

import asyncio
import random
from typing import Any, ClassVar

from redis_router import AsyncRedisLoadBalancer
from redis_router.plugins.prefix_cache import PrefixCacheRouter
from redis_router.policy import LeastLoaded

from . import invariants
from .test_cli import run_cli

SERVERS = {f"s{i}": None for i in range(3)}
PC_KEYS = ("pc:idx", "pc:lru", "pc:n")


def _counts(r: Any, name: str) -> dict[str, Any]:
    """The raw keys that hold leases and counts."""
    p = invariants.prefix(name)
    out = {
        "load": r.zrange(p + "load", 0, -1, withscores=True),
        "draining": r.zrange(p + "draining", 0, -1, withscores=True),
        "leases": r.hgetall(p + "leases"),
        "byreq": r.hgetall(p + "byreq"),
        "holders": r.zrange(p + "holders", 0, -1),
    }
    for sid in SERVERS:
        out["held:" + sid] = r.zrange(p + "held:" + sid, 0, -1, withscores=True)
    return out


def _sticky(r: Any, name: str) -> int:
    return sum(r.hlen(k) for k in r.keys(invariants.prefix(name) + "sticky:*"))


def _prefix_cache(server: Any, **kw: Any) -> PrefixCacheRouter:
    lb = PrefixCacheRouter(SERVERS, redis=server.url, rng=random.Random(1), **kw)
    rnd = random.Random(2)
    for i in range(6):
        lb.acquire(f"r{i}", prompt_ids=[rnd.randrange(1000) for _ in range(64)])
    return lb


def test_bump_drops_the_prefix_index_but_not_counts_or_leases(server, r):
    lb = _prefix_cache(server, name="wv-pc")
    try:
        p = invariants.prefix(lb.name)
        assert all(r.exists(p + k) for k in PC_KEYS)
        before = _counts(r, lb.name)
        got = lb.bump_weight_version()
        assert got["weight_version"] == 1 and got["locality_keys_dropped"] >= 3
        assert not any(r.exists(p + k) for k in PC_KEYS)
        assert _counts(r, lb.name) == before
        assert _sticky(r, lb.name) == 6  # kept unless asked
        invariants.check(r, lb.name)
        assert lb.bump_weight_version(sticky=True) == {
            "weight_version": 2,
            "locality_keys_dropped": 0,
            "sticky_entries_forgotten": 6,
        }
        assert _sticky(r, lb.name) == 0 and _counts(r, lb.name) == before
        invariants.check(r, lb.name)
    finally:
        lb.close()


def test_the_cli_bumps_a_balancer_without_knowing_its_policy(server, r):
    lb = _prefix_cache(server, name="wv-cli")
    try:
        before = _counts(r, lb.name)
        proc = run_cli("--name", lb.name, "bump-weight-version", redis=server.url)
        assert proc.returncode == 0, proc.stderr
        assert "weight version 1" in proc.stdout
        assert not any(r.exists(invariants.prefix(lb.name) + k) for k in PC_KEYS)
        assert _counts(r, lb.name) == before
        proc = run_cli("--name", lb.name, "bump-weight-version", "--sticky", redis=server.url)
        assert "6 sticky session(s)" in proc.stdout and _sticky(r, lb.name) == 0
        invariants.check(r, lb.name)
    finally:
        lb.close()


class _Remembers(LeastLoaded):
    """A policy keeping its own record of what the replicas cache."""

    name = "remembers"
    locality_keys: ClassVar[tuple[str, ...]] = ("mine:cache",)


def test_policy_locality_keys_are_dropped_by_any_later_bump(make_lb, r, server):
    lb = make_lb(SERVERS, policy=_Remembers)
    p = invariants.prefix(lb.name)
    lb.acquire("a")
    r.set(p + "mine:cache", "x")
    assert lb.bump_weight_version()["locality_keys_dropped"] == 1
    r.set(p + "mine:cache", "y")  # recorded again under the new weights
    proc = run_cli("--name", lb.name, "bump-weight-version", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert not r.exists(p + "mine:cache")  # the CLI knew it from the first bump
    invariants.check(r, lb.name)


def test_async_twin_bumps(server, r):
    async def run() -> dict[str, int]:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="wv-async")
        try:
            await lb.acquire("a")
            return await lb.bump_weight_version(sticky=True)
        finally:
            await lb.close()

    got = asyncio.run(run())
    assert got["weight_version"] == 1 and got["sticky_entries_forgotten"] == 1
    assert r.zscore(invariants.prefix("wv-async") + "load", "s0") is not None
