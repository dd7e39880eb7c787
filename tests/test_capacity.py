"""Capacity and admission: no acquire ever exceeds a replica's declared capacity, load is
compared relative to capacity, and a full pool refuses at once or serves waiters in order."""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import threading
import time

import pytest

from redis_router import AsyncRedisLoadBalancer, NoCapacity, NoServersAvailable

from . import invariants

CAPS = {"small": 2, "mid": 4, "big": 6}


def _raw_counts(r, name: str) -> dict[str, int]:
    p = invariants.prefix(name)
    out: dict[str, int] = {}
    for zs in ("load", "draining", "off"):
        for sid, score in r.zrange(p + zs, 0, -1, withscores=True):
            out[sid] = int(score)
    return out


def test_metadata_capacity_is_never_exceeded_and_refuses_with_its_own_error(make_lb, r):
    lb = make_lb({sid: {"capacity": c} for sid, c in CAPS.items()})
    held = [lb.acquire(f"s{i}") for i in range(sum(CAPS.values()))]
    counts = invariants.check(r, lb.name)
    assert counts == CAPS
    with pytest.raises(NoCapacity, match="full"):
        lb.acquire("one-too-many")
    assert invariants.check(r, lb.name) == CAPS  # refused: nothing written
    held[0].release()
    freed = held[0].server_id
    assert lb.acquire("next").server_id == freed
    assert invariants.check(r, lb.name) == CAPS


def test_a_sticky_session_on_a_full_replica_moves_instead_of_exceeding(make_lb, r):
    lb = make_lb({"a": {"capacity": 1}})
    lb.acquire("chat").release()  # pinned to a
    blocker = lb.acquire("blocker")  # a is full now
    assert blocker.server_id == "a"
    lb.add_servers({"b": {"capacity": 5}})
    turn = lb.acquire("chat")
    assert turn.server_id == "b" and not turn.sticky  # moved, as for a removed replica
    assert invariants.check(r, lb.name) == {"a": 1, "b": 1}
    blocker.release()
    turn.release()
    assert lb.acquire("chat").server_id == "b"  # and stays where it moved


def test_least_loaded_fills_unequal_replicas_evenly_relative_to_capacity(make_lb, r):
    caps = {"r1": 4, "r2": 8, "r3": 16}
    lb = make_lb({sid: {"capacity": c} for sid, c in caps.items()})
    for step in range(sum(caps.values())):
        lb.acquire(f"s{step}")
        counts = invariants.check(r, lb.name)
        # Relative loads never differ by more than one request's share of the smallest.
        rel = [counts[s] / caps[s] for s in caps]
        assert max(rel) - min(rel) <= 1 / min(caps.values()) + 1e-9, counts
    assert invariants.check(r, lb.name) == caps


def test_a_batch_is_granted_whole_or_refused_whole(make_lb, r):
    lb = make_lb({"a": {"capacity": 2}, "b": {"capacity": 1}})
    with pytest.raises(NoCapacity):
        lb.acquire_many([f"x{i}" for i in range(4)])
    assert invariants.check(r, lb.name) == {"a": 0, "b": 0}
    got = lb.acquire_many([f"y{i}" for i in range(3)])
    assert sorted(sid for sid, _ in got) == ["a", "a", "b"]
    assert invariants.check(r, lb.name) == {"a": 2, "b": 1}


def test_lowering_and_lifting_capacity_takes_effect_at_once(make_lb, r):
    lb = make_lb({"a": None})
    held = [lb.acquire(f"s{i}") for i in range(3)]
    lb.add_servers({"a": None}, capacity={"a": 3})  # now full
    with pytest.raises(NoCapacity):
        lb.acquire("x")
    lb.add_servers({"a": None})  # capacity lifted
    held.append(lb.acquire("x"))
    assert invariants.check(r, lb.name) == {"a": 4}


def test_bad_capacity_is_refused_before_anything_is_written(make_lb, r):
    lb = make_lb()
    with pytest.raises(ValueError, match="capacity"):
        lb.add_servers({"a": {"capacity": 0}})
    with pytest.raises(TypeError, match="capacity"):
        lb.add_servers({"a": None}, capacity={"a": "8"})
    with pytest.raises(ValueError, match="not being added"):
        lb.add_servers({"a": None}, capacity={"b": 2})
    with pytest.raises(ValueError, match="wait"):
        lb.acquire("x", wait=-1)
    assert r.keys("*") == []


def test_an_empty_pool_is_still_no_servers_not_no_capacity(make_lb):
    lb = make_lb()
    with pytest.raises(NoServersAvailable) as err:
        lb.acquire("x")
    assert not isinstance(err.value, NoCapacity)


def test_waiters_are_served_first_come_first_served_across_balancers(make_lb, r, server):
    lb = make_lb({"a": {"capacity": 1}})
    others = [make_lb(name=lb.name) for _ in range(3)]
    blocker = lb.acquire("blocker")
    order: list[int] = []
    arrived: dict[int, float] = {}
    served: dict[int, float] = {}
    lock = threading.Lock()

    def wait_turn(i: int) -> None:
        mine = others[i % len(others)]
        arrived[i] = time.monotonic()
        lease = mine.acquire(f"w{i}", wait=30)
        with lock:
            order.append(i)
            served[i] = time.monotonic()
        time.sleep(0.01)
        lease.release()

    threads = []
    for i in range(12):
        t = threading.Thread(target=wait_turn, args=(i,))
        t.start()
        threads.append(t)
        # the next one arrives once this one is queued
        deadline = time.monotonic() + 10
        while r.zcard(invariants.prefix(lb.name) + "waiters") < i + 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    blocker.release()
    for t in threads:
        t.join(timeout=60)
    assert order == list(range(12))
    waits = [served[i] - arrived[i] for i in range(12)]
    status = lb.get_status()["waiting"]
    assert status["served"] == 12 and status["now"] == 0
    gaps = [served[i + 1] - served[i] for i in range(11)]
    print(
        f"\nFIFO: 12 waiters over 4 balancers served in arrival order; hand-off between "
        f"consecutive waiters median {statistics.median(gaps) * 1000:.1f} ms, max "
        f"{max(gaps) * 1000:.1f} ms (each held 10 ms); waits {min(waits):.2f}..{max(waits):.2f} s"
    )
    assert invariants.check(r, lb.name) == {"a": 0}


def test_a_waiter_that_gives_up_leaves_the_queue_and_passes_its_turn(make_lb, r):
    lb = make_lb({"a": {"capacity": 1}})
    blocker = lb.acquire("blocker")
    started = time.monotonic()
    with pytest.raises(NoCapacity, match=r"within 0\.3s"):
        lb.acquire("impatient", wait=0.3)
    assert 0.3 <= time.monotonic() - started < 5
    p = invariants.prefix(lb.name)
    assert r.zcard(p + "waiters") == 0 and r.keys(p + "wake:*") == []
    assert lb.get_status()["waiting"]["timed_out"] == 1
    blocker.release()
    assert lb.acquire("later").server_id == "a"


def test_a_waiter_whose_process_died_is_dropped_from_the_queue(make_lb, r):
    lb = make_lb({"a": {"capacity": 1}}, lease_ttl=1.0)
    dead = make_lb(name=lb.name, lease_ttl=1.0)
    blocker = lb.acquire("blocker")
    with pytest.raises(NoCapacity):
        dead.acquire("doomed")  # registers its holder and starts its heartbeats
    dead._run(dead._core.enqueue("ticket-of-a-dead-process", 30.0))
    invariants.silence(dead)  # its process dies while it waits
    p = invariants.prefix(lb.name)
    assert r.zcard(p + "waiters") == 1
    time.sleep(1.3)  # its holder's deadline passes
    blocker.release()
    assert lb.acquire("alive").server_id == "a"  # not blocked by the dead waiter
    assert r.zcard(p + "waiters") == 0 and r.keys(p + "wake:*") == []
    assert lb.get_status()["waiting"]["abandoned"] == 1


def test_async_waiters_are_served_in_order(server, r):
    import asyncio

    async def main() -> list[int]:
        lb = AsyncRedisLoadBalancer({"a": {"capacity": 1}}, redis=server.url, name="aw")
        blocker = await lb.acquire("blocker")
        order: list[int] = []

        async def wait_turn(i: int) -> None:
            await asyncio.sleep(0.05 * i)
            lease = await lb.acquire(f"w{i}", wait=30)
            order.append(i)
            await asyncio.sleep(0.01)
            await lease.release()

        tasks = [asyncio.ensure_future(wait_turn(i)) for i in range(6)]
        await asyncio.sleep(0.5)
        await blocker.release()
        await asyncio.gather(*tasks)
        await lb.close()
        return order

    assert asyncio.run(main()) == list(range(6))
    assert invariants.check(r, "aw") == {"a": 0}


def _sessions(url: str, name: str, seed: int, barrier, results) -> None:
    """32 concurrent sessions (threads) of one process, each turning 4 times; every grant is
    checked against the raw count of its replica."""
    from redis_router import RedisLoadBalancer

    lb = RedisLoadBalancer(redis=url, name=name, rng=random.Random(seed))
    import redis

    raw = redis.Redis.from_url(url, decode_responses=True)
    p = invariants.prefix(name)
    over: list[str] = []
    done = [0]
    waits: list[float] = []
    lock = threading.Lock()

    def session(k: int) -> None:
        rnd = random.Random(seed * 100 + k)
        for turn in range(4):
            asked = time.monotonic()
            lease = lb.acquire(f"{seed}-{k}-{turn % 2}", wait=60)
            waits.append(time.monotonic() - asked)
            count = max(float(raw.zscore(p + zs, lease.server_id) or -1) for zs in ("load", "off"))
            if count > CAPS[lease.server_id]:
                over.append(f"{lease.server_id}: {count}")
            time.sleep(rnd.uniform(0.001, 0.01))
            lease.release()
            with lock:
                done[0] += 1

    barrier.wait()
    threads = [threading.Thread(target=session, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put((done[0], over, waits))
    lb.close()


@pytest.mark.slow
def test_capacity_is_never_exceeded_by_4_processes_of_32_sessions(make_lb, server, r):
    lb = make_lb({sid: {"capacity": c} for sid, c in CAPS.items()})
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(5), ctx.Queue()
    procs = [
        ctx.Process(target=_sessions, args=(server.url, lb.name, s, barrier, results))
        for s in range(4)
    ]
    for p in procs:
        p.start()
    snapshots, peak = 0, dict.fromkeys(CAPS, 0)
    try:
        barrier.wait(timeout=120)
        outcomes = []
        while len(outcomes) < len(procs):
            counts = invariants.check(r, lb.name)  # I10 on an atomic snapshot
            snapshots += 1
            for sid, n in counts.items():
                peak[sid] = max(peak[sid], n)
            while not results.empty():
                outcomes.append(results.get())
            time.sleep(0.002)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert sum(done for done, _, _ in outcomes) == 4 * 32 * 4
    assert [o for _, over, _ in outcomes for o in over] == []
    assert all(peak[s] <= CAPS[s] for s in CAPS), peak
    assert peak == CAPS  # the run did fill every replica
    waiting = lb.get_status()["waiting"]
    means = [statistics.mean(w) * 1000 for _, _, w in outcomes]
    every = sorted(x for _, _, w in outcomes for x in w)
    print(
        f"\n4 processes x 32 sessions x 4 turns on capacities {CAPS}: {snapshots} raw "
        f"snapshots, peak {peak}; {waiting['served']} acquires waited (mean "
        f"{waiting['mean_wait'] * 1000:.0f} ms, max {waiting['max_wait'] * 1000:.0f} ms); "
        f"per-process mean acquire time {min(means):.0f}..{max(means):.0f} ms (spread "
        f"{max(means) / min(means):.2f}x), p50 {every[len(every) // 2] * 1000:.0f} ms, p99 "
        f"{every[int(len(every) * 0.99)] * 1000:.0f} ms"
    )
    assert invariants.check(r, lb.name) == dict.fromkeys(CAPS, 0)


def test_coalesced_async_acquires_never_exceed_capacity(server, r):
    import asyncio

    caps = {"a": 2, "b": 3}

    async def main() -> tuple[int, dict[str, int]]:
        lb = AsyncRedisLoadBalancer(
            {sid: {"capacity": c} for sid, c in caps.items()}, redis=server.url, name="co"
        )
        peak = dict.fromkeys(caps, 0)
        done = 0

        async def session(k: int) -> None:
            nonlocal done
            for turn in range(3):
                lease = await lb.acquire(f"s{k}-{turn}", wait=30)
                for sid, n in _raw_counts(r, "co").items():
                    peak[sid] = max(peak[sid], n)
                await asyncio.sleep(0.002)
                await lease.release()
                done += 1

        await asyncio.gather(*(session(k) for k in range(24)))
        await lb.close()
        return done, peak

    done, peak = asyncio.run(main())
    assert done == 72
    assert all(peak[s] <= caps[s] for s in caps), peak
    assert invariants.check(r, "co") == {"a": 0, "b": 0}
