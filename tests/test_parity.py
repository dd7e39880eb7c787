"""The sync and asyncio balancers take the same decisions on a fault path: a process that
held every place is SIGKILLed, and a new process acquires once the dead holder's lease ttl
has long passed. Every acquire method of both flavours reclaims the dead holder's places and
routes (none raises NoCapacity), whatever its wait: the decision lives in one place
(redis_router.core.admit). The sharded pool's two flavours (two shards, a replica each) do
the same."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, ShardedLoadBalancer
from redis_router.aio_sharded import AsyncShardedLoadBalancer
from redis_router.shards import shard_names

from . import invariants

SERVERS = {"s0": "a", "s1": "b"}
CAPACITY = dict.fromkeys(SERVERS, 1)
LEASE_TTL = 0.5

HOLDER = """
import sys, time
from redis_router import RedisLoadBalancer, ShardedLoadBalancer
url, name, ttl, pair = sys.argv[1:5]
if pair == "sharded":
    lb = ShardedLoadBalancer(redis=url, name=name, lease_ttl=float(ttl), shards=2)
else:
    lb = RedisLoadBalancer(redis=url, name=name, lease_ttl=float(ttl))
for i in range(2):
    lb.acquire_server(f"doomed-{i}")
print("held", flush=True)
time.sleep(120)
"""

# How each method acquires two places (one request each, or both in one call); what it
# returns is reduced to the replicas it routed to.
SYNC: dict[str, Callable[[RedisLoadBalancer], list[str]]] = {
    "acquire_server": lambda lb: [lb.acquire_server(f"r{i}")[0] for i in range(2)],
    "acquire": lambda lb: [lb.acquire(f"r{i}").server_id for i in range(2)],
    "acquire_many": lambda lb: [sid for sid, _ in lb.acquire_many(["r0", "r1"])],
}


async def _lease_async(lb: AsyncRedisLoadBalancer) -> list[str]:
    out = []
    for i in range(2):
        async with lb.lease(f"r{i}") as lease:
            out.append(lease.server_id)
            other = await lb.acquire_server("held-meanwhile")  # the other place, meanwhile
            out.append(other[0])
            assert await lb.release_server(other[0], "held-meanwhile")
    return out[:2]


def _lease_sync(lb: RedisLoadBalancer) -> list[str]:
    out = []
    for i in range(2):
        with lb.lease(f"r{i}") as lease:
            out.append(lease.server_id)
            other = lb.acquire_server("held-meanwhile")
            out.append(other[0])
            assert lb.release_server(other[0], "held-meanwhile")
    return out[:2]


SYNC["lease"] = _lease_sync

ASYNC: dict[str, Callable[[AsyncRedisLoadBalancer], Any]] = {
    "acquire_server": lambda lb: _each(lb, lambda i: lb.acquire_server(f"r{i}"), 0),
    "acquire": lambda lb: _each(lb, lambda i: lb.acquire(f"r{i}"), None),
    "acquire_many": lambda lb: _many(lb),
    "lease": _lease_async,
}


async def _each(lb: AsyncRedisLoadBalancer, call: Callable[[int], Any], index: Any) -> list[str]:
    out = []
    for i in range(2):
        got = await call(i)
        out.append(got[index] if index is not None else got.server_id)
    return out


async def _many(lb: AsyncRedisLoadBalancer) -> list[str]:
    return [sid for sid, _ in await lb.acquire_many(["r0", "r1"])]


# The two pairs of flavours: a balancer, and a pool of two shards (a replica each).
PAIRS = {
    "balancer": (RedisLoadBalancer, AsyncRedisLoadBalancer, {}),
    "sharded": (ShardedLoadBalancer, AsyncShardedLoadBalancer, {"shards": 2}),
}


def _killed_holder(url: str, name: str, pair: str) -> None:
    """A worker process that takes both places, then is SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, name, str(LEASE_TTL), pair],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _counts(r: Any, name: str, pair: str) -> dict[str, int]:
    """The pool's counts, summed over its shards' keys where it has shards (I1 on each)."""
    out: dict[str, int] = {}
    for balancer in shard_names(name, 2) if pair == "sharded" else [name]:
        out.update(invariants.check(r, balancer))
    return out


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "alone"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_both_flavours_reclaim_a_killed_holders_places_alike(server, r, coalesce, pair):
    sync_cls, async_cls, kw = PAIRS[pair]
    methods = sorted(SYNC)
    names = {(flavour, m): f"parity-{coalesce}-{flavour}-{m}" for flavour in "sa" for m in methods}
    for name in names.values():
        with sync_cls(redis=server.url, name=name, lease_ttl=LEASE_TTL, **kw) as setup:
            setup.add_servers(SERVERS, capacity=CAPACITY)
        _killed_holder(server.url, name, pair)
    for name in names.values():
        assert _counts(r, name, pair) == {"s0": 1, "s1": 1}  # both places held by the dead
    time.sleep(3 * LEASE_TTL)  # its lease ttl has long passed: it is dead, not on probation

    results: dict[tuple[str, str], Any] = {}
    for m in methods:
        lb = sync_cls(redis=server.url, name=names["s", m], lease_ttl=LEASE_TTL, **kw)
        try:
            results["s", m] = sorted(SYNC[m](lb))
        except Exception as exc:
            results["s", m] = type(exc).__name__
        finally:
            lb.close()

    async def flavour_async() -> None:
        for m in methods:
            lb = async_cls(
                redis=server.url, name=names["a", m], lease_ttl=LEASE_TTL, coalesce=coalesce, **kw
            )
            try:
                results["a", m] = sorted(await ASYNC[m](lb))
            except Exception as exc:
                results["a", m] = type(exc).__name__
            finally:
                await lb.close()

    asyncio.run(flavour_async())
    assert {k: v for k, v in results.items() if k[0] == "a"} == {
        ("a", m): results["s", m] for m in methods
    }
    assert all(results["s", m] == ["s0", "s1"] for m in methods), results
    for name in names.values():
        assert _counts(r, name, pair) == {"s0": 0, "s1": 0}
