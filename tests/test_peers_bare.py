"""The peers benchmark's bare-client oracle does the library's work: its acquires take leases
that the balancer's own status counts, and its posted releases end them, from the sync and the
asyncio client alike. Without Functions (Redis 6.2) its no-op library cannot load, and the
benchmark turns that into rows saying why.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from benchmarks import peers_bare as bare
from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer
from redis_router.local_server import LocalServer, ServerBinary, find_server_binaries

SERVERS = {f"s{i}": f"http://h{i}" for i in range(4)}


def _functions(binary: ServerBinary) -> bool:
    return binary.kind == "valkey" or binary.version_tuple >= (7,)


# The bare client sends FCALL: the servers with Functions (Redis 6.2 is the test above).
WITH_FUNCTIONS = [b for b in find_server_binaries() if _functions(b)]
functions_servers = pytest.mark.parametrize(
    "fbinary", WITH_FUNCTIONS, ids=[b.label for b in WITH_FUNCTIONS]
)


def test_no_functions_refuses_the_noop_library(binary: ServerBinary, r: redis.Redis) -> None:
    if _functions(binary):
        bare.load_noop(r)
        assert r.fcall(bare.NOOP, 1, "k") == ["s0", None, 0]
    else:
        with pytest.raises(redis.ResponseError):
            bare.load_noop(r)


def _counts(lb: RedisLoadBalancer) -> dict[str, int]:
    return {sid: lb.get_inflight_count(sid) for sid in SERVERS}


@functions_servers
def test_sync_bare_client_takes_and_ends_the_librarys_leases(fbinary: ServerBinary) -> None:
    with LocalServer(fbinary) as server:
        _sync(server)


def _sync(server: LocalServer) -> None:
    lb = RedisLoadBalancer(SERVERS, redis=server.url, name="bare")
    try:
        lb.release_server(lb.acquire_server("warm")[0], "warm")  # loads the scripts
        commands, client = bare.Commands(lb._core, False), bare.SyncBare(server.url)
        held = []
        for _ in range(8):
            rid, token = uuid.uuid4().hex, bare.new_token()
            held.append((bare.server_id(client.call(commands.acquire(rid, token))), rid, token))
        assert sorted(s for s, _, _ in held) == sorted([*SERVERS] * 2)  # least loaded
        assert sum(_counts(lb).values()) == 8
        for sid, rid, token in held:
            client.post(commands.release(sid, rid, token))
        # The posted releases' replies are read before the next call's: each ended its lease.
        ping = client.call(("PING",))
        assert ping == b"PONG"
        assert _counts(lb) == dict.fromkeys(SERVERS, 0)
        client.close()
    finally:
        lb.close()


@functions_servers
def test_async_bare_client_takes_and_ends_the_librarys_leases(fbinary: ServerBinary) -> None:
    with LocalServer(fbinary) as server:
        asyncio.run(_async(server))


async def _async(server: LocalServer) -> None:
    async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="abare") as lb:
        await lb.release_server((await lb.acquire_server("warm"))[0], "warm")
        commands = bare.Commands(lb._core, False)
        client = await bare.AsyncBare.open(server.url)
        rid, token = uuid.uuid4().hex, bare.new_token()
        sid = bare.server_id(await client.call(commands.acquire(rid, token)))
        assert sid in SERVERS and await lb.get_inflight_count(sid) == 1
        # The release's reply names the lease it ended; a second copy ends nothing.
        assert await client.call(commands.release(sid, rid, token)) == [token.encode()]
        client.post(commands.release(sid, rid, token))
        assert await client.call(("PING",)) == b"PONG"
        assert await lb.get_inflight_count(sid) == 0
        client.close()
