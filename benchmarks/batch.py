"""Target 3: ``acquire_many(K ids)`` against K single acquires, sync and asyncio.

Each round routes K new sessions on a fresh balancer (same client, same 8 replicas) once as
one batch and once one by one, so both start from the same state; the balancer is destroyed
after. Before timing, a seeded run checks the batch gives what sequential acquires give.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid

import redis
import redis.asyncio

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer

from .harness import Row, Sizes, median
from .latency import servers

_names = itertools.count()


def _name(kind: str) -> str:
    return f"bench-batch-{kind}-{next(_names)}"


def _workload(k: int, seed: int) -> list[str]:
    """K request ids in which about a tenth repeat an earlier one (a later turn: sticky)."""
    rnd = random.Random(seed)
    ids: list[str] = []
    for _ in range(k):
        ids.append(rnd.choice(ids) if ids and rnd.random() < 0.1 else uuid.uuid4().hex)
    return ids


def verify_sync(client: redis.Redis, k: int) -> bool:
    """Same replicas, same counts as K sequential acquires (equal seeds, some sticky turns,
    one replica draining) - the property tests/test_routing.py checks, at benchmark size."""
    ids = _workload(k, 7)
    lbs = [
        RedisLoadBalancer(servers(8), redis=client, name=_name("v"), rng=random.Random(11))
        for _ in range(2)
    ]
    for lb in lbs:
        lb.acquire_many(ids[: k // 4])
        lb.drain_servers(["replica-3"])
    got = lbs[0].acquire_many(ids)
    want = [lbs[1].acquire_server(rid) for rid in ids]
    same = got == want and lbs[0].get_status()["servers"] == lbs[1].get_status()["servers"]
    for lb in lbs:
        lb.destroy()
        lb.close()
    return same


async def verify_async(client: redis.asyncio.Redis, k: int) -> bool:
    ids = _workload(k, 8)
    lbs = [
        AsyncRedisLoadBalancer(servers(8), redis=client, name=_name("va"), rng=random.Random(12))
        for _ in range(2)
    ]
    got = await lbs[0].acquire_many(ids)
    want = [await lbs[1].acquire_server(rid) for rid in ids]
    same = (
        got == want
        and (await lbs[0].get_status())["servers"] == (await lbs[1].get_status())["servers"]
    )
    for lb in lbs:
        await lb.destroy()
        await lb.close()
    return same


def run_sync(client: redis.Redis, sizes: Sizes) -> Row:
    k = sizes.batch_k
    ok = verify_sync(client, k)
    t_batch: list[float] = []
    t_single: list[float] = []
    for r in range(sizes.batch_rounds + 1):  # round 0 warms up
        batch = RedisLoadBalancer(servers(8), redis=client, name=_name("b"))
        single = RedisLoadBalancer(servers(8), redis=client, name=_name("s"))
        ids = [uuid.uuid4().hex for _ in range(k)]
        t0 = time.perf_counter()
        batch.acquire_many(ids)
        t1 = time.perf_counter()
        for rid in ids:
            single.acquire_server(rid)
        t2 = time.perf_counter()
        if r:
            t_batch.append(t1 - t0)
            t_single.append(t2 - t1)
        for lb in (batch, single):
            lb.destroy()
            lb.close()
    return _row("batch_sync", "sync", k, t_batch, t_single, ok)


async def _run_async(client: redis.asyncio.Redis, sizes: Sizes) -> Row:
    k = sizes.batch_k
    ok = await verify_async(client, k)
    t_batch: list[float] = []
    t_single: list[float] = []
    for r in range(sizes.batch_rounds + 1):
        batch = AsyncRedisLoadBalancer(servers(8), redis=client, name=_name("ab"))
        single = AsyncRedisLoadBalancer(servers(8), redis=client, name=_name("as"))
        await batch.get_total_inflight()  # settings pinned, replicas registered: untimed
        await single.get_total_inflight()
        ids = [uuid.uuid4().hex for _ in range(k)]
        t0 = time.perf_counter()
        await batch.acquire_many(ids)
        t1 = time.perf_counter()
        for rid in ids:
            await single.acquire_server(rid)
        t2 = time.perf_counter()
        if r:
            t_batch.append(t1 - t0)
            t_single.append(t2 - t1)
        for alb in (batch, single):
            await alb.destroy()
            await alb.close()
    return _row("batch_async", "async", k, t_batch, t_single, ok)


def run_async(url: str, sizes: Sizes) -> Row:
    async def main() -> Row:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        try:
            return await _run_async(client, sizes)
        finally:
            await client.aclose()

    return asyncio.run(main())


def _row(rid: str, kind: str, k: int, batch: list[float], single: list[float], ok: bool) -> Row:
    speedup = median([s / b for s, b in zip(single, batch, strict=True)])
    return Row(
        rid,
        f"(3) acquire_many(K={k}), {kind}",
        median(batch),
        "s",
        baseline=f"{k} single acquires",
        baseline_value=median(single),
        ratio=speedup,
        target=(">=", 10),
        note=f"same routing as sequential acquires: {'verified' if ok else 'MISMATCH'}",
        extra={"verified_same_as_sequential": ok, "k": k},
    )
