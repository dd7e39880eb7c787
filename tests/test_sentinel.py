"""Sentinel: a master, a replica and three sentinels per server binary.

Worker processes acquire and release through a ``redis+sentinel://`` URL while a failover
(``SENTINEL FAILOVER``) happens. They follow the new master by themselves, none dies, and on
the new master the invariants hold; leases whose release was lost with the old master (writes
it took after the replica was promoted) expire and are reaped (I2).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio.sentinel

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, RedisUnavailable
from redis_router.local_server import find_server_binaries

from . import invariants
from .servers import LocalSentinelGroup

BINARIES = find_server_binaries()
LEASE_TTL = 1.0
WORKERS = 4

pytestmark = pytest.mark.skipif(not BINARIES, reason="no server binary found")


@pytest.fixture(scope="module", params=BINARIES, ids=[b.label for b in BINARIES])
def group(request: pytest.FixtureRequest) -> Iterator[LocalSentinelGroup]:
    with LocalSentinelGroup(request.param, service_name="rr-master", sentinels=3) as g:
        yield g


def _replicated(group: LocalSentinelGroup) -> None:
    """Wait until the replica has every write so far (so the test starts from a known state)."""
    with group.master.client() as c:
        assert c.execute_command("WAIT", 1, 5000) == 1


def test_sentinel_url_and_ready_clients_sync_and_async(group: LocalSentinelGroup) -> None:
    with RedisLoadBalancer({"a": None}, redis=group.url, name="urls") as lb:
        assert lb.url == group.url
        assert lb.acquire("r").release()
    master = group.sentinel_client().master_for("rr-master", decode_responses=True)
    with RedisLoadBalancer(redis=master, name="urls") as lb:
        assert lb.url == "redis+sentinel://rr-master"
        assert lb.acquire_server("r")[0] == "a"  # sticky, same balancer

    async def main() -> None:
        async with AsyncRedisLoadBalancer(redis=group.url, name="urls") as alb:
            assert (await alb.acquire_server("r"))[0] == "a"
        sentinel = redis.asyncio.sentinel.Sentinel(group.sentinel_addresses)
        ready = sentinel.master_for("rr-master")
        async with AsyncRedisLoadBalancer(redis=ready, name="urls") as alb:
            # Both earlier balancers closed holding a lease: close() ended each at once.
            assert await alb.get_inflight_count("a") == 0
            assert await alb.reap() == 0
            await alb.destroy()
        await ready.aclose()

    asyncio.run(main())


def _worker(
    url: str, name: str, index: int, stop: Any, progress: Any, ports: Any, out: Any
) -> None:
    """Acquire, hold briefly, release, until told to stop. A RedisUnavailable is expected
    during the failover (the worker waits a moment and goes on); anything else is a bug."""
    stats: dict[str, Any] = {
        "ops": 0, "unavailable": 0, "unreleased": 0, "errors": [], "gaps": [], "masters": []
    }  # fmt: skip
    failing_since: float | None = None
    try:
        lb = RedisLoadBalancer(redis=url, name=name, lease_ttl=LEASE_TTL)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                lease = lb.acquire(f"w{index}-session-{i % 40}")
            except RedisUnavailable:
                stats["unavailable"] += 1
                failing_since = failing_since or time.time()
                time.sleep(0.02)
                continue
            time.sleep(0.005)
            try:
                lease.release()
            except RedisUnavailable:
                stats["unreleased"] += 1  # left to expire: lease_ttl heals it
                failing_since = failing_since or time.time()
            if failing_since is not None:
                stats["gaps"].append((failing_since, time.time()))
                failing_since = None
            stats["ops"] += 1
            progress[index] += 1
            # Which master this worker's connections go to (redis-py asks Sentinel on connect).
            master = lb._client.connection_pool.master_address
            if not stats["masters"] or stats["masters"][-1][1] != master:
                stats["masters"].append((time.time(), master))
                ports[index] = master[1]
        lb.close()
    except BaseException as exc:  # reported, not raised: the test asserts there were none
        stats["errors"].append(repr(exc))
    out.put((index, stats))


@pytest.mark.slow
def test_workers_survive_a_failover_and_leases_heal_lost_writes(
    group: LocalSentinelGroup,
) -> None:
    name = "failover"
    lb = RedisLoadBalancer({"a": None, "b": None, "c": None}, redis=group.url, name=name)
    lb.clear_sticky_cache()
    _replicated(group)
    old = group.master_address()
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    progress, ports = ctx.Array("l", WORKERS), ctx.Array("l", WORKERS)
    procs = [
        ctx.Process(
            target=_worker, args=(group.url, name, i, stop, progress, ports, out), daemon=True
        )
        for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    try:
        _wait(lambda: all(n > 20 for n in progress[:]), 30, "workers to start")
        t0 = time.time()
        new = group.failover()
        switched = time.time()
        # Workers write to the old master until the sentinels demote it (those writes are
        # lost); its first READONLY reply sends each to the new one.
        _wait(lambda: set(ports[:]) == {new[1]}, 30, "every worker to reach the new master")
        resumed = time.time()
        time.sleep(0.2)
    finally:
        stop.set()
        results = dict(out.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(10)
    assert new != old
    assert [p.exitcode for p in procs] == [0] * WORKERS
    assert [s["errors"] for s in results.values()] == [[]] * WORKERS, "a worker died"
    gaps = [b - a for s in results.values() for a, b in s["gaps"]]
    followed = [next(t for t, m in s["masters"] if m[1] == new[1]) - t0 for s in results.values()]
    unavailable = sum(s["unavailable"] for s in results.values())
    unreleased = sum(s["unreleased"] for s in results.values())

    # Until the sentinels reconfigure it, the old master still takes writes (they are lost);
    # once it is a replica, a write through a stale connection gets READONLY, which makes the
    # balancer ask Sentinel again. Reads may come from it until then (stale, not wrong).
    with group.master.client(decode_responses=True) as r:
        assert r.execute_command("ROLE")[0] == "master"
        # Every worker has released all it held, yet leases whose release went to the old
        # master after the promotion are still here: I1 holds, I2 waits for their expiry.
        leftover = sum(invariants.check(r, name).values())
        _wait(lambda: _is_synced_replica(group), 30, "the old master to become a replica")
        assert lb.acquire("main-process").release()  # the test's own balancer followed too
        time.sleep(LEASE_TTL + 0.2)
        lb.reap()
        assert invariants.check(r, name) == {"a": 0, "b": 0, "c": 0}  # I2 after expiry
    healed = sum(x["reclaimed"] for x in lb.get_status()["replicas"].values())
    assert healed >= leftover
    lb.destroy()
    lb.close()
    print(
        f"\n{group.binary.label}: failover {old[1]}->{new[1]} took {switched - t0:.2f}s; "
        f"workers on the new master {min(followed):.2f}-{max(followed):.2f}s after it began; "
        f"all there {resumed - t0:.2f}s after; longest worker error gap "
        f"{max(gaps, default=0):.2f}s; {sum(s['ops'] for s in results.values())} ops, "
        f"{unavailable} RedisUnavailable, {unreleased} releases lost in the switch, "
        f"{leftover} leases left on the new master; reclaimed by expiry: {healed}"
    )


@pytest.mark.slow
def test_async_balancer_follows_a_failover(group: LocalSentinelGroup) -> None:
    if group.binary != BINARIES[0]:
        pytest.skip("the async failover runs on the first binary only (the sync one on all)")

    async def main() -> float:
        async with AsyncRedisLoadBalancer({"a": None}, redis=group.url, name="afo") as lb:
            assert await (await lb.acquire("before")).release()
            _replicated(group)
            t0 = time.monotonic()
            failover = asyncio.ensure_future(asyncio.to_thread(group.failover))
            while True:  # keep calling through the switch, as a real worker would
                try:
                    lease = await lb.acquire("during")
                    await lease.release()
                except RedisUnavailable:
                    pass
                if failover.done():
                    break
                await asyncio.sleep(0.01)
            await failover
            assert (await lb.acquire_server("after"))[0] == "a"
            elapsed = time.monotonic() - t0
            await lb.destroy()
            return elapsed

    print(f"\n{group.binary.label}: async balancer back after {asyncio.run(main()):.2f}s")


def _is_synced_replica(group: LocalSentinelGroup) -> bool:
    with group.replica.client(decode_responses=True) as c:
        info = c.info("replication")
    return info["role"] == "slave" and info.get("master_link_status") == "up"


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
