"""The asyncio twin: the same balancer as the sync class, with cancellation-safe leases."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from redis_router import (
    AsyncRedisLoadBalancer,
    AsyncRequestLoadBalancer,
    NoServersAvailable,
    RedisLoadBalancer,
    RequestLoadBalancer,
)

from . import invariants

SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(4)}


def run(server: Any, name: str, body: Callable[[AsyncRedisLoadBalancer], Awaitable[None]]) -> None:
    """Run body against an async balancer on the test's server, in a fresh event loop."""

    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name=name) as alb:
            await body(alb)

    asyncio.run(main())


async def settle(alb: AsyncRedisLoadBalancer, total: int) -> int:
    """Wait (up to 10 s) for releases scheduled in the background to bring the total in-flight
    down to ``total``; returns the last total seen."""
    for _ in range(1000):
        seen = await alb.get_total_inflight()
        if seen == total:
            return seen
        await asyncio.sleep(0.01)
    return seen


def test_same_methods_as_the_sync_class_as_coroutines():
    public = {n for n in dir(RedisLoadBalancer) if not n.startswith("_")}
    assert public <= set(dir(AsyncRedisLoadBalancer))
    plain = {"name", "policy", "default_policy", "require_acquire_fields", "require_release_fields"}
    for n in public - plain:
        attr = getattr(AsyncRedisLoadBalancer, n)
        coro = (
            inspect.iscoroutinefunction(attr)
            or inspect.isasyncgenfunction(getattr(attr, "__wrapped__", None))
            or getattr(attr, "returns_awaitable", False)  # release_server: queued at once
        )
        assert coro, f"AsyncRedisLoadBalancer.{n} is not a coroutine (or async context manager)"
    assert issubclass(AsyncRedisLoadBalancer, RequestLoadBalancer)
    assert issubclass(AsyncRedisLoadBalancer, AsyncRequestLoadBalancer)


def test_sync_and_async_instances_with_one_name_are_one_balancer(make_lb, server, r):
    lb = make_lb(SERVERS)

    async def body(alb: AsyncRedisLoadBalancer) -> None:
        sid, handle = await alb.acquire_server("chat")
        assert handle == SERVERS[sid]
        assert lb.get_inflight_count(sid) == 1  # the sync instance sees the async lease
        assert lb.acquire_server("chat")[0] == sid  # and its sticky session
        assert await alb.get_total_inflight() == 2
        assert lb.release_server(sid, "chat")
        assert await alb.release_server(sid, "chat")
        assert await alb.get_status() == lb.get_status()

    run(server, lb.name, body)
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)


def test_lease_releases_exactly_once(server, r):
    async def body(alb: AsyncRedisLoadBalancer) -> None:
        async with alb.lease("L") as lease:
            assert await alb.get_inflight_count(lease.server_id) == 1
        assert await alb.get_total_inflight() == 0
        assert not await lease.release()  # already released by the context manager
        with pytest.raises(RuntimeError, match="boom"):
            async with alb.lease("L2"):
                raise RuntimeError("boom")
        assert await alb.get_total_inflight() == 0

    run(server, "async-once", body)
    invariants.check(r, "async-once")


def test_lease_is_released_when_the_task_is_cancelled_in_the_body(server, r):
    async def body(alb: AsyncRedisLoadBalancer) -> None:
        inside = asyncio.Event()

        async def worker() -> None:
            async with alb.lease("C"):
                inside.set()
                await asyncio.Event().wait()  # a request that never finishes by itself

        task = asyncio.ensure_future(worker())
        await inside.wait()
        assert await alb.get_total_inflight() == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await alb.get_total_inflight() == 0

    run(server, "async-cancel-body", body)
    assert invariants.check(r, "async-cancel-body") == dict.fromkeys(SERVERS, 0)


def test_lease_granted_to_a_task_cancelled_while_acquiring_is_released(server, r):
    async def body(alb: AsyncRedisLoadBalancer) -> None:
        sent, gate = asyncio.Event(), asyncio.Event()
        send = alb._client.execute_command  # FCALL or EVALSHA, whichever the server takes

        async def held_back(*args: Any, **options: Any) -> Any:  # reaches Redis at the gate
            sent.set()
            await gate.wait()
            return await send(*args, **options)

        alb._client.execute_command = held_back
        alb._pipe = None  # the acquire goes through the client, which the test holds
        entered = False

        async def worker() -> None:
            nonlocal entered
            async with alb.lease("X"):
                entered = True

        task = asyncio.ensure_future(worker())
        await sent.wait()
        task.cancel()  # while the acquire is in flight
        gate.set()  # ...and Redis grants it anyway
        with pytest.raises(asyncio.CancelledError):
            await task
        alb._client.execute_command = send
        assert not entered
        assert await settle(alb, 0) == 0  # the late grant was released, not leaked

    run(server, "async-cancel-acquire", body)
    assert invariants.check(r, "async-cancel-acquire") == dict.fromkeys(SERVERS, 0)


def test_acquire_many_routes_all_in_one_call(make_lb, server, r):
    lb = make_lb(SERVERS)

    async def body(alb: AsyncRedisLoadBalancer) -> None:
        got = await alb.acquire_many([f"m{i}" for i in range(8)] + ["m0"])
        assert [h for _, h in got] == [SERVERS[s] for s, _ in got]
        assert sorted(s for s, _ in got[:8]) == sorted(list(SERVERS) * 2)  # least loaded
        assert got[8][0] == got[0][0]  # a repeat in the batch is sticky
        assert lb.get_total_inflight() == 9

    run(server, lb.name, body)
    invariants.check(r, lb.name)


def test_empty_pool_raises_no_servers(server):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(redis=server.url, name="async-empty") as alb:
            with pytest.raises(NoServersAvailable):
                await alb.acquire_server("r")

    asyncio.run(main())


def test_a_cancelled_setup_is_retried_on_the_next_call(server):
    async def main() -> None:
        lb = AsyncRedisLoadBalancer({"s0": "a"}, redis=server.url, name="cancelled-setup")
        lb._setup = asyncio.get_running_loop().create_future()
        lb._setup.cancel()  # e.g. the loop cancelled every task at shutdown
        assert await lb.acquire_server("r") == ("s0", "a")
        await lb.close()

    asyncio.run(main())
