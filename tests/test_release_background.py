"""A release does not wait for Redis: it goes out at once, ahead of every later call of its
balancer, and is answered in the background, with every guarantee of a release kept (its
result on demand, counts equal to live leases, resend safety, nothing lost at close() or at
process exit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, NoCapacity
from redis_router.outbox import BOUND, LINGER, Released

from . import invariants

# Long enough that a release whose call returned only after Redis answered would be done by
# then; the pause ends by itself, so a failing test never hangs.
PAUSE_MS = 1500


def _pause(r: redis.Redis) -> None:
    """Redis stops running writes (scripts included) for PAUSE_MS."""
    r.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")


def test_a_release_returns_before_redis_answers_and_its_result_waits(make_lb, r):
    lb = make_lb({"s0": "a"})
    sid, _ = lb.acquire_server("x")
    lease = lb.acquire("y")
    _pause(r)
    released = lb.release_server(sid, "x")
    ended = lease.release()
    assert isinstance(released, Released) and not released.done() and not ended.done()
    assert lb._core.releasing  # in `releasing` until answered: reconcile leaves them alone
    assert released.result() is True and ended.result() is True  # after the pause
    assert not lb._core.releasing
    assert invariants.check(r, lb.name) == {"s0": 0}
    assert lb.release_server(sid, "x").result() is False  # released twice: a no-op


def test_a_release_never_waits_for_the_reply_the_background_reader_is_waiting_for(make_lb, r):
    """The background reader waits for a late reply without holding the balancer's lock: a
    release posted meanwhile goes out at once, and the earlier one is still unanswered when it
    returns (were the post held until the reader had read, it would be answered by then)."""
    lb = make_lb({"s0": "a"})
    first, second = lb.acquire("y0"), lb.acquire("y1")
    _pause(r)
    ended = first.release()
    time.sleep(0.2)  # far past the reader's period: it is waiting for that reply now
    also = second.release()
    assert not ended.done() and not also.done()  # both posted while Redis is paused
    assert ended.result() is True and also.result() is True  # after the pause
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_release_goes_ahead_of_the_next_acquire_on_a_full_replica(make_lb, r):
    lb = make_lb({"s0": {"url": "a", "capacity": 1}})
    for i in range(200):  # every acquire finds the place its predecessor's release freed
        sid, _ = lb.acquire_server(f"r{i}", wait=0)
        lb.release_server(sid, f"r{i}")
    with pytest.raises(NoCapacity):
        lb.acquire_server("held", wait=0), lb.acquire_server("refused", wait=0)
    lb.release_server("s0", "held")
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_reads_of_the_same_balancer_see_its_releases(make_lb):
    lb = make_lb({"s0": "a", "s1": "b"})
    grants = [lb.acquire_server(f"r{i}") for i in range(10)]
    for i, (sid, _) in enumerate(grants):
        lb.release_server(sid, f"r{i}")
        assert lb.get_inflight_count(sid) == sum(1 for s, _ in grants[i + 1 :] if s == sid)
    assert lb.get_total_inflight() == 0


def test_releases_from_many_threads_all_end_their_leases(make_lb, r):
    lb = make_lb({f"s{i}": None for i in range(4)})
    results: list[bool] = []

    def worker(t: int) -> None:
        mine = []
        for i in range(100):
            rid = f"t{t}-{i}"
            sid, _ = lb.acquire_server(rid)
            mine.append(lb.release_server(sid, rid))
        results.extend(m.result() for m in mine)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [True] * 400
    assert invariants.check(r, lb.name) == {f"s{i}": 0 for i in range(4)}


def test_close_answers_every_release_first(make_lb, r):
    lb = make_lb({"s0": "a", "s1": "b"})
    grants = [(lb.acquire_server(f"r{i}")[0], f"r{i}") for i in range(50)]
    _pause(r)
    posted = [lb.release_server(sid, rid) for sid, rid in grants]
    lb.close()  # waits out the pause for the replies
    assert all(p.done() and p.result() is True for p in posted)
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_a_broken_connection_sends_the_unanswered_releases_again(make_lb, r, server):
    lb = make_lb({"s0": "a"})
    grants = [(lb.acquire_server(f"r{i}")[0], f"r{i}") for i in range(20)]
    _pause(r)
    posted = [lb.release_server(sid, rid) for sid, rid in grants]
    # The outbox's connection dies with its releases written and unanswered.
    conn = lb._outbox._conn
    port = conn._sock.getsockname()[1]
    assert not any(p.done() for p in posted)
    with server.client() as now:  # not `r`: it would wait for those replies first
        assert now.execute_command("CLIENT", "KILL", "ADDR", f"127.0.0.1:{port}")
    assert all(p.result() is True for p in posted)  # each ended its lease exactly once
    assert invariants.check(r, lb.name) == {"s0": 0}
    sid, _ = lb.acquire_server("after")  # and the balancer goes on, on a new connection
    assert lb.release_server(sid, "after").result() is True


class _CountedWakes(threading.Condition):
    """An outbox's condition that counts the wakes sent to its background reader."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.wakes = 0

    def notify(self, n: int = 1) -> None:
        self.wakes += 1
        super().notify(n)


def test_releases_that_keep_coming_do_not_wake_the_reader_and_a_quiet_one_sleeps(make_lb, r):
    """While releases keep coming the background reader looks every BOUND by itself: only
    the first release, or one after a quiet LINGER, wakes it (waking a thread cost a sync
    pair ~8 %). Replies are still read with no later call, and a quiet reader sleeps."""
    lb = make_lb({"s0": "a", "s1": "b"})
    outbox = lb._outbox
    outbox._wake = counted = _CountedWakes(outbox._lock)
    quiet, last = 0, time.monotonic()
    for i in range(500):
        sid, _ = lb.acquire_server(f"r{i}")
        lb.release_server(sid, f"r{i}")
        now = time.monotonic()
        quiet += now - last > LINGER / 2  # a stalled machine: that release may wake it
        last = now
    assert counted.wakes <= 1 + quiet, (counted.wakes, quiet)
    sid, _ = lb.acquire_server("alone")
    alone = lb.release_server(sid, "alone")
    deadline = time.monotonic() + 10
    while not alone.done() and time.monotonic() < deadline:  # nothing else reads it
        time.sleep(0.01)
    assert alone.done() and alone.result() is True
    deadline = time.monotonic() + LINGER + 10
    while not outbox._idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outbox._idle  # asleep until the next release wakes it
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_a_release_then_a_long_wait_wakes_the_reader_a_few_times_not_every_bound(make_lb, r):
    """A process whose requests take long (an LLM call between a release and the next acquire)
    pays, per release, the wake its post makes, the read, and LINGER / BOUND looks, then the
    reader sleeps: not a look every BOUND for as long as it waits (which kept a sync balancer
    busy at a steady ~2 % of a core)."""
    lb = make_lb({"s0": "a", "s1": "b"})
    outbox = lb._outbox
    sid, _ = lb.acquire_server("first")
    lb.release_server(sid, "first").result()  # the reader is running
    steps = [0]
    step = outbox._reader_step

    def counted() -> bool:
        steps[0] += 1
        return step()

    outbox._reader_step = counted  # what the reader thread calls on each wake
    for i in range(3):
        sid, _ = lb.acquire_server(f"r{i}")
        lb.release_server(sid, f"r{i}")
        time.sleep(0.3)  # 150 BOUNDs
    # Per release a handful of wakes and LINGER / BOUND looks (about 8 here), far fewer than
    # the 150 BOUNDs each waits.
    assert steps[0] < 3 * 0.3 / BOUND / 4, steps[0]
    assert steps[0] <= 3 * (6 + LINGER / BOUND), steps[0]
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_a_process_that_exits_without_close_has_its_releases_answered(server, r):
    script = textwrap.dedent(
        f"""
        from redis_router import RedisLoadBalancer
        lb = RedisLoadBalancer({{"s0": "a", "s1": "b"}}, redis={server.url!r}, name="exit")
        grants = [(lb.acquire_server(f"r{{i}}")[0], f"r{{i}}") for i in range(100)]
        for sid, rid in grants:
            lb.release_server(sid, rid)
        """
    )
    subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, check=True)
    # The holder's leases all ended: nothing waits for the holder to be declared dead.
    assert invariants.check(r, "exit") == {"s0": 0, "s1": 0}
    assert r.hlen("rr:{exit}:leases") == 0


# -- asyncio ---------------------------------------------------------------------------------


def test_asyncio_release_is_queued_at_once_and_awaitable(server, r):
    async def main() -> None:
        async with AsyncRedisLoadBalancer({"s0": "a"}, redis=server.url, name="ar") as lb:
            sid, _ = await lb.acquire_server("x")
            lease = await lb.acquire("y")
            _pause(r)
            released = lb.release_server(sid, "x")  # not awaited: it goes out anyway
            ended = lease.release()
            await asyncio.sleep(0.2)
            assert not released.done() and not ended.done()  # Redis is paused
            assert await released is True and await ended is True
            assert await lb.get_total_inflight() == 0
            assert await lb.release_server(sid, "x") is False

    asyncio.run(main())
    assert invariants.check(r, "ar") == {"s0": 0}


def test_asyncio_release_goes_ahead_of_the_next_acquire_on_a_full_replica(server, r):
    async def main() -> None:
        servers = {"s0": {"url": "a", "capacity": 1}}
        async with AsyncRedisLoadBalancer(servers, redis=server.url, name="afull") as lb:
            for i in range(200):
                sid, _ = await lb.acquire_server(f"r{i}", wait=0)
                lb.release_server(sid, f"r{i}")
            async with lb.lease("last", wait=0):
                pass  # its release is not awaited either
            sid, _ = await lb.acquire_server("after", wait=0)
            assert (await lb.get_status())["total_inflight"] == 1

    asyncio.run(main())
    assert invariants.check(r, "afull") == {"s0": 0}  # close() ended the last lease


def test_asyncio_close_answers_every_release_first(server, r):
    async def main() -> list[Any]:
        lb = AsyncRedisLoadBalancer({"s0": "a", "s1": "b"}, redis=server.url, name="aclose")
        grants = [await lb.acquire_server(f"r{i}") for i in range(50)]
        _pause(r)
        posted = [lb.release_server(sid, f"r{i}") for i, (sid, _) in enumerate(grants)]
        await lb.close()
        return posted

    posted = asyncio.run(main())
    assert all(p.done() and p.result() is True for p in posted)
    assert invariants.check(r, "aclose") == {"s0": 0, "s1": 0}


def test_asyncio_calls_survive_their_connections_being_killed(server, r):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(
            {f"s{i}": None for i in range(4)}, redis=server.url, name="akill"
        ) as lb:
            for rnd in range(5):
                rids = [f"r{rnd}-{i}" for i in range(16)]
                got = await asyncio.gather(*(lb.acquire_server(rid) for rid in rids))
                r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                posted = [
                    lb.release_server(sid, rid) for (sid, _), rid in zip(got, rids, strict=True)
                ]
                assert await asyncio.gather(*posted) == [True] * 16
            assert await lb.get_total_inflight() == 0

    asyncio.run(main())
    assert invariants.check(r, "akill") == {f"s{i}": 0 for i in range(4)}
