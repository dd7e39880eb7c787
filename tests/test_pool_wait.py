"""A busy connection pool is not an outage: calls wait their turn for a connection (bounded),
and a wait that runs out raises PoolExhausted, which names the pool's size and how to raise
it, never RedisUnavailable (which callers retry as an outage)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from redis_router import AsyncRedisLoadBalancer, PoolExhausted, RedisLoadBalancer
from redis_router import connection as connection_module
from redis_router.errors import RedisUnavailable

from . import invariants
from .test_cancel_leaks import SERVERS, burst

_names = itertools.count()


def test_a_burst_through_a_small_pool_waits_for_connections(server, r):
    """300 sessions, each call on a connection of its own (coalesce=False), through a pool of
    4: every call waits for a connection rather than fail with RedisUnavailable."""
    name = f"pool-burst-{next(_names)}"

    async def main() -> list[BaseException]:
        async with AsyncRedisLoadBalancer(
            SERVERS, redis=server.url, name=name, coalesce=False, max_connections=4
        ) as lb:
            failures = await burst(lb, 7)
            assert lb._client.connection_pool.max_connections == 4
            for _ in range(300):
                if await lb.get_total_inflight() == 0:
                    break
                await asyncio.sleep(0.01)
        return failures

    failures = asyncio.run(main())
    assert not [f for f in failures if isinstance(f, RedisUnavailable)], failures[:3]
    assert not failures, failures[:3]
    assert invariants.check(r, name) == dict.fromkeys(SERVERS, 0)


def _exhausted(exc: PoolExhausted, size: int) -> None:
    assert not isinstance(exc, RedisUnavailable)
    assert exc.max_connections == size
    text = str(exc)
    assert f"all {size} connections" in text and "max_connections" in text, text


def test_an_async_call_finding_the_pool_busy_for_its_wait_raises_pool_exhausted(
    server, monkeypatch
):
    monkeypatch.setattr(connection_module, "POOL_WAIT", 0.3)

    async def main() -> None:
        lb = AsyncRedisLoadBalancer(
            SERVERS,
            redis=server.url,
            name=f"pool-busy-{next(_names)}",
            coalesce=False,
            max_connections=2,
        )
        await lb.get_status()
        pool = lb._client.connection_pool
        held = [await pool.get_connection() for _ in range(2)]  # both busy elsewhere
        started = time.monotonic()
        with pytest.raises(PoolExhausted) as caught:
            await lb.acquire_server("r")
        assert 0.25 < time.monotonic() - started < 5
        _exhausted(caught.value, 2)
        await pool.release(held.pop())  # a connection is free again: the call goes through
        sid, _ = await lb.acquire_server("r")
        assert await lb.release_server(sid, "r")
        for conn in held:
            await pool.release(conn)
        await lb.close()

    asyncio.run(main())


def test_a_sync_call_finding_the_pool_busy_for_its_wait_raises_pool_exhausted(server, monkeypatch):
    monkeypatch.setattr(connection_module, "POOL_WAIT", 0.3)
    lb = RedisLoadBalancer(
        SERVERS, redis=server.url, name=f"pool-busy-{next(_names)}", max_connections=2
    )
    try:
        pool = lb._client.connection_pool
        held = [pool.get_connection() for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(PoolExhausted) as caught:
            lb.acquire_server("r")
        assert 0.25 < time.monotonic() - started < 5
        _exhausted(caught.value, 2)
        for conn in held:
            pool.release(conn)
        sid, _ = lb.acquire_server("r")
        assert lb.release_server(sid, "r")
    finally:
        lb.close()


@pytest.mark.parametrize("cls", [RedisLoadBalancer, AsyncRedisLoadBalancer])
def test_max_connections_is_checked(cls):
    with pytest.raises(ValueError, match=r"max_connections must be at least 2.*got 1"):
        cls(redis="redis://127.0.0.1:1/0", max_connections=1)
    with pytest.raises(TypeError, match=r"max_connections must be an int, got str"):
        cls(redis="redis://127.0.0.1:1/0", max_connections="8")
    with pytest.raises(TypeError, match=r"max_connections must be an int, got bool"):
        cls(redis="redis://127.0.0.1:1/0", max_connections=True)


def test_max_connections_default_is_documented(server):
    lb = RedisLoadBalancer(redis=server.url, name=f"pool-default-{next(_names)}")
    try:
        assert lb._client.connection_pool.max_connections == 100
        assert connection_module.DEFAULT_MAX_CONNECTIONS == 100
    finally:
        lb.close()


def test_max_connections_with_a_client_passed_in_is_refused(server):
    client = server.client()
    try:
        with pytest.raises(ValueError, match="a redis client passed in keeps its own pool"):
            RedisLoadBalancer(redis=client, max_connections=8)
    finally:
        client.close()
