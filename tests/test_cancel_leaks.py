"""What a cancelled asyncio caller was granted is released, whatever the moment of the cancel.

A burst of sessions shares one AsyncRedisLoadBalancer, as a rollout worker's do; most are
cancelled at a random moment (queued, in flight, in the very loop turn their grant arrives,
while held, or waiting for a place), as ``asyncio.wait_for`` or a departing client does.
Once every session has ended and its releases are answered, nothing may stay counted: a
lease kept in the process's ledger would be kept alive by its keeper until the process exits.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from redis_router import AsyncRedisLoadBalancer
from redis_router.errors import NoCapacity, RedisUnavailable

from . import invariants

SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(8)}
SESSIONS = 300
HOLD = 0.3
_names = itertools.count()


async def _cancel_point(rng: random.Random) -> None:
    """A random moment: a few loop turns (a batch queued or on its way, or its reply just
    read), a few milliseconds (a round trip), or a while (the lease held)."""
    mode = rng.randrange(4)
    if mode == 0:
        for _ in range(rng.randrange(40)):
            await asyncio.sleep(0)
    elif mode == 1:
        await asyncio.sleep(rng.random() * 0.01)
    elif mode == 2:
        await asyncio.sleep(rng.random() * 0.05)
    else:
        await asyncio.sleep(rng.random() * (HOLD + 0.1))


async def burst(lb: AsyncRedisLoadBalancer, seed: int, wait: float | None = None) -> list[Any]:
    """SESSIONS sessions through acquire, acquire_server and lease(), each holding its replica
    HOLD s, about 70 % cancelled; the errors the others raised."""
    rng = random.Random(seed)
    failures: list[Any] = []

    async def session(k: int) -> None:
        rid = f"r{k}"
        how = k % 3
        if how == 0:
            lease = await lb.acquire(rid, wait=wait)
            try:
                await asyncio.sleep(HOLD)
            finally:
                lease.release()
        elif how == 1:
            sid, _ = await lb.acquire_server(rid, wait=wait)
            try:
                await asyncio.sleep(HOLD)
            finally:
                lb.release_server(sid, rid)
        else:
            async with lb.lease(rid, wait=wait):
                await asyncio.sleep(HOLD)

    async def one(k: int) -> None:
        task = asyncio.ensure_future(session(k))
        if rng.random() < 0.7:
            await _cancel_point(rng)
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except NoCapacity:
            pass  # a wait that ran out: not a failure of the balancer
        except Exception as exc:
            failures.append(exc)

    async with asyncio.timeout(60):
        await asyncio.gather(*(one(k) for k in range(SESSIONS)))
    return failures


async def _left(lb: AsyncRedisLoadBalancer) -> int:
    """The leases still counted once the releases in flight are answered (bounded)."""
    seen = -1
    for _ in range(300):
        seen = await lb.get_total_inflight()
        if seen == 0:
            break
        await asyncio.sleep(0.01)
    return seen


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "alone"])
def test_a_cancelled_burst_leaves_no_lease(server, r, coalesce):
    name = f"cancel-burst-{next(_names)}"

    async def main() -> list[int]:
        left = []
        async with AsyncRedisLoadBalancer(
            SERVERS, redis=server.url, name=name, coalesce=coalesce
        ) as lb:
            for seed in range(4):
                failures = await burst(lb, seed)
                assert not failures, failures[:3]
                left.append(await _left(lb))
                # I1 on the keys: counts equal leases, both zero.
                assert invariants.check(r, name) == dict.fromkeys(SERVERS, 0), left
                assert not lb._core.held, "a released lease stayed in the process's ledger"
        return left

    assert asyncio.run(main()) == [0, 0, 0, 0]


def test_a_cancelled_burst_waiting_for_places_leaves_no_lease(server, r):
    """Full replicas: most sessions wait in the queue for a place (acquire_server's waiting
    loop), and are cancelled there, or as they are served."""
    name = f"cancel-wait-{next(_names)}"

    async def main() -> list[int]:
        left = []
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name=name) as lb:
            await lb.add_servers(SERVERS, capacity=dict.fromkeys(SERVERS, 12))
            for seed in range(2):
                failures = await burst(lb, 100 + seed, wait=2.0)
                assert not [f for f in failures if isinstance(f, RedisUnavailable)], failures
                left.append(await _left(lb))
                assert invariants.check(r, name) == dict.fromkeys(SERVERS, 0), left
                assert not lb._core.held
        return left

    assert asyncio.run(main()) == [0, 0]
