"""Faults the client side must survive, injected for real on private servers: an unreachable
Sentinel, an out-of-memory spell, an asyncio acquire cancelled while Redis is stalled
(SIGSTOP), and an asyncio balancer used from a second event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from redis_router import (
    AsyncRedisLoadBalancer,
    RedisLoadBalancer,
    RedisOutOfMemory,
    RedisRouterError,
    RedisUnavailable,
)
from redis_router.local_server import LocalServer

from . import invariants

SECRET = "Zq7@Wk8:Xr9"


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass (a bound, no timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def r_private(private: LocalServer) -> Iterator[Any]:
    """A raw client on the private server, to look at keys the way redis-cli would."""
    c = invariants.settled(private.client(decode_responses=True))
    yield c
    c.close()


# -- an unreachable Sentinel fails as fast as an unreachable redis:// -----------------------

SENTINEL_URLS = [
    f"redis+sentinel://:{SECRET}@127.0.0.1:1/mymaster",
    f"redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster/0?sentinel_password={SECRET}",
]


@pytest.mark.parametrize("url", SENTINEL_URLS)
def test_unreachable_sentinel_fails_fast_and_clearly(url):
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        RedisLoadBalancer(redis=url, name="sen")
    assert time.monotonic() - started < 5  # a bound: redis-py's own retries took ~15 s
    message = str(info.value)
    assert "cannot reach Redis at redis+sentinel://" in message and "mymaster" in message
    assert SECRET not in message and "Wk8" not in message
    assert "no Sentinel reachable knows it" in message and len(message) < 300

    async def first_call() -> None:
        lb = AsyncRedisLoadBalancer(redis=url, name="sen")
        try:
            await lb.acquire_server("r1")
        finally:
            await lb.close()

    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        asyncio.run(first_call())
    assert time.monotonic() - started < 5
    assert "Wk8" not in str(info.value)
    assert "no Sentinel reachable knows it" in str(info.value)  # short, not a page of reprs


# -- an out-of-memory spell: the library's error, saying what to do -------------------------


@contextlib.contextmanager
def out_of_memory(srv: LocalServer) -> Iterator[None]:
    """A noeviction server over its maxmemory: a big key, then maxmemory below what it uses.
    Writes are refused until the spell ends (maxmemory lifted)."""
    with srv.client() as c:
        c.set("ballast", b"x" * 4_000_000)
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", "2mb")
        try:
            yield
        finally:
            c.config_set("maxmemory", "0")
            c.delete("ballast")


def test_out_of_memory_acquires_raise_redis_out_of_memory(private):
    lb = RedisLoadBalancer({"s0": None, "s1": None}, redis=private.url, name="oom")
    held = lb.acquire("held")
    try:
        with out_of_memory(private):
            for attempt in (
                lambda: lb.acquire_server("r1"),
                lambda: lb.acquire("r2"),
                lambda: lb.acquire_many(["r3", "r4"]),
            ):
                with pytest.raises(RedisOutOfMemory) as info:
                    attempt()
                err = info.value
                assert isinstance(err, RedisUnavailable) and isinstance(err, RedisRouterError)
                assert "out of memory" in str(err) and "maxmemory" in str(err)
                assert "noeviction" in str(err)
                assert "OOM" in err.reply or "maxmemory" in err.reply
            assert lb.get_total_inflight() == 1  # nothing was counted
            assert held.release()  # a release is no write Redis refuses
        assert lb.acquire_server("r1")[0] in ("s0", "s1")  # the spell is over: works again
        with private.client(decode_responses=True) as c:
            invariants.check(c, "oom")
    finally:
        lb.close()


def test_out_of_memory_async_acquire_raises_redis_out_of_memory(private):
    async def scenario() -> None:
        lb = AsyncRedisLoadBalancer({"s0": None}, redis=private.url, name="oom", coalesce=False)
        coalesced = AsyncRedisLoadBalancer(redis=private.url, name="oom")
        try:
            await lb.get_status()
            with out_of_memory(private):
                for attempt in (
                    lb.acquire_server("r1"),
                    coalesced.acquire_server("r2"),
                    coalesced.acquire_many(["r3", "r4"]),
                ):
                    with pytest.raises(RedisOutOfMemory, match="out of memory"):
                        await attempt
            assert await lb.get_total_inflight() == 0
        finally:
            await lb.close()
            await coalesced.close()

    asyncio.run(scenario())


# -- a cancelled asyncio acquire leaves nothing counted -------------------------------------

ACQUIRES: dict[str, Callable[[AsyncRedisLoadBalancer], Any]] = {
    "acquire_server": lambda lb: lb.acquire_server("r1"),
    "acquire": lambda lb: lb.acquire("r1"),
    "acquire_many": lambda lb: lb.acquire_many(["r1", "r2", "r3"]),
}


@pytest.mark.parametrize(
    "how, coalesce",
    [
        ("acquire_server", False),
        ("acquire", False),
        ("acquire_many", False),
        ("acquire_many", True),
        ("acquire_server", True),  # the coalescer got this right already: kept so
        ("acquire", True),
    ],
)
def test_acquire_cancelled_while_redis_is_stalled_leaves_no_lease(
    private, r_private, how, coalesce
):
    """The server is stopped (SIGSTOP) while the acquire is on its way; the caller gives up
    after 0.2 s; the server resumes and runs the script. The lease it granted must end at
    once, not after the keeper's reconciliation (~60 s)."""
    name = f"cx-{how}-{coalesce}"
    key = invariants.prefix(name)
    n = 3 if how == "acquire_many" else 1

    async def scenario() -> None:
        lb = AsyncRedisLoadBalancer(
            {"s0": None, "s1": None}, redis=private.url, name=name, coalesce=coalesce
        )
        try:
            await lb.get_status()  # connected and set up: the acquire reuses that connection
            assert private.pid is not None
            os.kill(private.pid, signal.SIGSTOP)
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(ACQUIRES[how](lb), 0.2)
                await asyncio.sleep(0.3)  # a stall of about half a second, well within timeouts
            finally:
                os.kill(private.pid, signal.SIGCONT)

            async def poll(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if predicate():
                        return True
                    await asyncio.sleep(0.05)  # the loop runs the release meanwhile
                return predicate()

            def granted() -> int:
                return sum(int(v) for v in r_private.hvals(key + "acquires"))

            # The script did run after the resume (else the test would prove nothing) ...
            assert await poll(lambda: granted() == n), "the cancelled acquire never ran"
            # ... and what it granted ended, well before the 60 s reconciliation.
            assert await poll(lambda: r_private.hlen(key + "leases") == 0)
            assert await lb.get_total_inflight() == 0
            invariants.check(r_private, name)
            # The balancer still works, and counts what it grants.
            await lb.acquire_server("r9")
            assert await lb.get_total_inflight() == 1
        finally:
            await lb.close()

    asyncio.run(scenario())


# -- one asyncio balancer, used from one asyncio.run() after another -------------------------


@pytest.mark.parametrize("coalesce", [True, False])
def test_balancer_works_from_a_second_event_loop_and_loses_nothing(private, r_private, coalesce):
    name = f"loops-{coalesce}"
    key = invariants.prefix(name)
    lb = AsyncRedisLoadBalancer(
        {"s0": None, "s1": None}, redis=private.url, name=name, lease_ttl=1.0, coalesce=coalesce
    )
    kept: list[Any] = []

    async def first() -> None:
        kept.append(await lb.acquire("kept"))  # held across the loops
        sid, _ = await lb.acquire_server("once")
        assert await lb.release_server(sid, "once")
        assert await lb.get_total_inflight() == 1

    def deadline() -> float:
        return float(r_private.zscore(key + "holders", lb._core.holder) or 0)

    async def second() -> None:
        assert await lb.get_total_inflight() == 1  # a read works on the new loop
        # The keeper beats again from this loop: the holder's deadline moves on.
        before = deadline()
        stop = time.monotonic() + 15
        while deadline() <= before and time.monotonic() < stop:
            await asyncio.sleep(0.05)
        assert deadline() > before, "no heartbeat from the second loop"
        many = await lb.acquire_many(["m1", "m2"])
        assert await lb.get_total_inflight() == 3
        for (sid, _), rid in zip(many, ["m1", "m2"], strict=True):
            assert await lb.release_server(sid, rid)
        assert await kept[0].release()  # the lease of the first loop is releasable here
        assert await lb.get_total_inflight() == 0

    try:
        asyncio.run(first())
        asyncio.run(second())
        assert r_private.hlen(key + "leases") == 0
        invariants.check(r_private, name)
    finally:
        asyncio.run(lb.close())


def test_a_client_passed_in_refuses_clearly_once_its_loop_closed(private, r_private):
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(private.url, decode_responses=True)
    lb = AsyncRedisLoadBalancer({"s0": None}, redis=client, name="given")
    key = invariants.prefix("given")

    async def first() -> None:
        sid, _ = await lb.acquire_server("a")
        assert await lb.release_server(sid, "a")

    async def second() -> None:
        with pytest.raises(RedisRouterError, match="event loop that is now closed"):
            await lb.acquire_server("b")
        with pytest.raises(RedisRouterError, match="pass a URL"):
            await lb.acquire_many(["c", "d"])
        await lb.close()  # refuses nothing: there is nothing it could send

    asyncio.run(first())
    acquired = sum(int(v) for v in r_private.hvals(key + "acquires"))
    asyncio.run(second())
    assert sum(int(v) for v in r_private.hvals(key + "acquires")) == acquired  # nothing sent
    assert r_private.hlen(key + "leases") == 0
    invariants.check(r_private, "given")
