"""The balancer's own clients, asyncio and sync, pack commands in C (hiredis), byte for byte
as redis-py's Python packer does, and change nothing else about their connections."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.connection
from redis.asyncio import connection as aconn
from redis.exceptions import DataError
from redis.utils import HIREDIS_AVAILABLE

from redis_router import AsyncRedisLoadBalancer
from redis_router.connection import connect
from redis_router.packing import pack_in_c, packed_in_c, packed_sync

from . import invariants

ARGS: list[tuple[Any, ...]] = [
    ("EVALSHA", "a" * 40, 1, "rr:{job}:", "s0", "", "tok-1", "\x1fop"),
    ("GET", "ünïcødé ✓"),
    ("SET", b"raw\x00bytes", 12345678901234),
    ("ZADD", "k", 1.5, "m", -0.25, "n"),
    ("SCRIPT LOAD", "return 1"),  # a command name of two words is split, as redis-py does
    ("CLIENT", "SETNAME", "x" * 7000),  # past redis-py's 6000-byte buffer cutoff
    ("HSET", "k", memoryview(b"view"), bytearray(b"array")),
    ("SET", "big", 2**70, -(2**65), 0, -1),  # integers past 64 bits, negatives
    (b"GET", "k"),  # a command name given as bytes
    (b"SCRIPT LOAD", "return 1"),  # two words as bytes, split as well
]
# Packing in C is hiredis's; [test] and [hiredis] install it, and the balancer works without it
# (test_asyncio_and_sync_clients_get_it checks that case).
needs_hiredis = pytest.mark.skipif(not HIREDIS_AVAILABLE, reason="packing in C needs hiredis")


def _outcome(conn: Any, args: tuple[Any, ...]) -> bytes | type[DataError]:
    """The bytes ``conn`` packs ``args`` into, or DataError where it refuses them (redis-py
    before 7.3, the 7.2.1 floor included, refuses a bytearray)."""
    try:
        return b"".join(bytes(chunk) for chunk in conn.pack_command(*args))
    except DataError:
        return DataError


@needs_hiredis
@pytest.mark.parametrize("args", ARGS, ids=lambda a: str(a[0]))
def test_packs_exactly_as_redis_py_does(args: tuple[Any, ...]) -> None:
    python = _outcome(aconn.Connection(), args)
    assert _outcome(packed_in_c(aconn.Connection)(), args) == python
    sync = _outcome(packed_sync(redis.connection.Connection)(), args)
    assert sync == _outcome(redis.connection.Connection(), args)
    if python is not DataError and sync is not DataError:
        assert sync == python  # sync and asyncio connections send the same bytes


@needs_hiredis
@pytest.mark.parametrize("bad", [None, True, {"a": 1}, [1]])
def test_refuses_what_redis_py_refuses(bad: Any) -> None:
    with pytest.raises(DataError):
        aconn.Connection().pack_command("GET", bad)
    with pytest.raises(DataError):
        packed_in_c(aconn.Connection)().pack_command("GET", bad)
    with pytest.raises(DataError):
        packed_sync(redis.connection.Connection)().pack_command("GET", bad)


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:1/0", aconn.Connection),
        ("rediss://127.0.0.1:1/0", aconn.SSLConnection),
        ("unix:///tmp/nowhere.sock", aconn.UnixDomainSocketConnection),
    ],
)
def test_asyncio_and_sync_clients_get_it(url: str, base: type) -> None:
    made = connect(url, asyncio=True).connection_pool.connection_class
    assert made is not base and issubclass(made, base) and made.writes_without_task
    assert made.packs_in_c is HIREDIS_AVAILABLE  # without hiredis redis-py packs
    sync_base = getattr(redis.connection, base.__name__)
    sync = connect(url).connection_pool.connection_class
    assert issubclass(sync, sync_base) and not getattr(sync, "writes_without_task", False)
    assert getattr(sync, "packs_in_c", False) is HIREDIS_AVAILABLE


def test_applying_twice_changes_nothing_more() -> None:
    pool = aconn.ConnectionPool()
    pack_in_c(pool)
    once = pool.connection_class
    pack_in_c(pool)
    assert pool.connection_class is once
    assert not pack_in_c(object())  # a pool without a connection class is left alone


def test_a_batched_balancer_routes_through_packed_connections(server: Any, r: Any) -> None:
    async def main() -> None:
        async with AsyncRedisLoadBalancer(
            {f"s{i}": None for i in range(4)}, redis=server.url, name="packed"
        ) as lb:
            assert getattr(lb._client.connection_pool.connection_class, "packs_in_c", False) is (
                HIREDIS_AVAILABLE
            )
            rids = [f"ünï-{i}" for i in range(64)]
            got = await asyncio.gather(*(lb.acquire_server(rid) for rid in rids))
            assert (await lb.get_status())["total_inflight"] == 64
            assert invariants.check(r, "packed") == {
                sid: sum(1 for s, _ in got if s == sid) for sid in {s for s, _ in got}
            }
            await asyncio.gather(
                *(lb.release_server(sid, rid) for (sid, _), rid in zip(got, rids, strict=True))
            )
            assert await lb.get_total_inflight() == 0
            invariants.check(r, "packed")

    asyncio.run(main())
