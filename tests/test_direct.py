"""The asyncio balancer's ordered connection (redis_router.direct): replies read where they
arrive (hiredis, no reader task) or by a reader task (without hiredis), with the same results,
the same round trips, and the same recovery when the server stalls or the connection dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, RedisUnavailable, direct

from . import invariants
from .commandstats import script_calls

SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(8)}


@pytest.fixture(params=["protocol", "task"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the pipe reads its replies: hiredis in the connection's protocol, or (as without
    hiredis installed) a reader task through redis-py."""
    if request.param == "task":
        monkeypatch.setattr(direct, "hiredis", None)
    return str(request.param)


def _reads_with(lb: AsyncRedisLoadBalancer) -> str:
    pipe = lb._pipe
    assert pipe is not None and pipe.ready, "the balancer's ordered connection is open"
    return "protocol" if pipe._replies is not None else "task"


def test_calls_of_one_turn_are_one_round_trip_either_way(server, r, reader):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="direct") as lb:
            await lb.release_server((await lb.acquire_server("warm"))[0], "warm")
            assert _reads_with(lb) == reader
            r.config_resetstat()
            got = await asyncio.gather(*(lb.acquire_server(f"q{i}") for i in range(64)))
            assert script_calls(r) == 1
            assert sorted(Counter(sid for sid, _ in got).values()) == [8] * 8
            # a lone call, and calls made while a batch is in flight, all answered
            alone = await lb.acquire_server("alone")
            more = await asyncio.gather(*(lb.acquire_server(f"m{i}") for i in range(8)))
            assert sum(invariants.check(r, "direct").values()) == 64 + 1 + 8
            ends = [lb.release_server(sid, f"q{i}") for i, (sid, _) in enumerate(got)]
            ends += [lb.release_server(alone[0], "alone")]
            ends += [lb.release_server(sid, f"m{i}") for i, (sid, _) in enumerate(more)]
            assert all(await asyncio.gather(*ends))
            assert set(invariants.check(r, "direct").values()) == {0}

    asyncio.run(main())


def test_a_stalled_server_fails_the_calls_in_flight_then_calls_work_again(private, reader):
    # The socket timeout bounds how long a written call waits for its reply, with either
    # reader; the call then goes the ordinary way, which times out too and says so.
    url = f"{private.url}?socket_timeout=0.5"
    r = private.client(decode_responses=True)

    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=url, name="stall", lease_ttl=2) as lb:
            await lb.release_server((await lb.acquire_server("warm"))[0], "warm")
            assert _reads_with(lb) == reader
            assert private.pid is not None
            os.kill(private.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(RedisUnavailable):
                    # far longer than the call may take: a hang fails with TimeoutError here
                    await asyncio.wait_for(lb.acquire_server("stalled"), 30)
                failed_after = time.monotonic() - started
            finally:
                os.kill(private.pid, signal.SIGCONT)
            assert failed_after < 30
            sid, _ = await lb.acquire_server("after")
            # The stalled acquire sat in the server's socket and may have run once the server
            # went on: its lease is counted exactly (the keeper ends it once old enough, as
            # any grant whose reply never came), and ends by its request id like any other.
            counts = invariants.check(r, "stall")
            assert sum(counts.values()) in (1, 2) and counts[sid] >= 1
            owner = await lb.request_owner("stalled")
            assert (owner is not None) == (sum(counts.values()) == 2)
            if owner is not None:
                assert await lb.release_server(owner, "stalled")
            assert await lb.release_server(sid, "after")
            assert set(invariants.check(r, "stall").values()) == {0}

    asyncio.run(main())


def test_calls_in_flight_when_the_connection_dies_are_sent_again(server, r, reader):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="killed") as lb:
            await lb.release_server((await lb.acquire_server("warm"))[0], "warm")
            assert _reads_with(lb) == reader
            killer = redis.Redis(host=server.host, port=server.port)
            for round_ in range(5):
                rids = [f"k{round_}-{i}" for i in range(16)]
                acquiring = asyncio.gather(*(lb.acquire_server(rid) for rid in rids))
                await asyncio.sleep(0)  # the batch is written in this turn
                killer.client_kill_filter(_type="normal", skipme=True)
                got = await acquiring
                assert sum(invariants.check(r, "killed").values()) == 16
                done = await asyncio.gather(
                    *(lb.release_server(sid, rid) for rid, (sid, _) in zip(rids, got, strict=True))
                )
                assert all(done)
                assert set(invariants.check(r, "killed").values()) == {0}
            killer.close()

    asyncio.run(main())


def test_a_pooled_connection_the_server_closed_is_opened_again_for_the_pipe(
    server, r, reader, monkeypatch
):
    # A connection the server closed while it sat idle in the pool: its stream has taken the
    # end, and its transport no longer reads. Taken as it is, calls written there would hear
    # nothing for a whole socket timeout (30 s here). redis-py's pool looks for an end before
    # it hands a connection out, but misses one that arrives while it looks (seen under load,
    # then a 5 s timeout): the pool here hands the ended connection out as that race does.
    url = f"{server.url}?socket_timeout=30"

    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=url, name="stale") as lb:
            old = lb._pipe
            assert old is not None and old.ready
            pool = old._pool
            idle = await direct._connection(pool)
            await idle.send_command("CLIENT", "ID")
            r.client_kill_filter(_id=await idle.read_response())
            deadline = time.monotonic() + 10
            while not idle._reader.at_eof():
                assert time.monotonic() < deadline, "the killed connection's stream never ended"
                await asyncio.sleep(0.01)
            lb._pipe = pipe = direct.Pipe(pool, lb._command, lb._exec, lb._refused, old.resends)
            await old.close()
            monkeypatch.setattr(pool, "ensure_connection", lambda conn: conn.connect())
            await pool.release(idle)  # the next connection the pool hands out
            await pipe.open()
            assert pipe.ready and not pipe._conn._reader.at_eof()
            assert _reads_with(lb) == reader
            got = await asyncio.wait_for(
                asyncio.gather(*(lb.acquire_server(f"p{i}") for i in range(8))), 10
            )
            assert sum(invariants.check(r, "stale").values()) == 8
            ends = [lb.release_server(sid, f"p{i}") for i, (sid, _) in enumerate(got)]
            assert all(await asyncio.wait_for(asyncio.gather(*ends), 10))
            assert set(invariants.check(r, "stale").values()) == {0}

    asyncio.run(main())


def test_calls_of_one_turn_reach_redis_in_the_order_they_were_made(server, r, reader):
    # A retry of a granted lease's token made before that lease's release, in one turn: the
    # retry runs first (it finds the lease, counts nothing), then the release ends it. Sent the
    # other way round, the retry would grant the lease again after its release.
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="order") as lb:
            await lb.release_server((await lb.acquire_server("warm"))[0], "warm")
            assert _reads_with(lb) == reader
            for k in range(5):
                lease = await lb.acquire(f"o{k}")
                again, released = await asyncio.gather(
                    lb.acquire(f"o{k}", token=lease.token), _released(lease)
                )
                assert again.server_id == lease.server_id and released
                assert set(invariants.check(r, "order").values()) == {0}

    asyncio.run(main())


def test_releases_sent_again_when_the_connection_dies_reach_redis_in_the_order_made(
    server, r, reader
):
    # Three releases, each its own call, on a connection the server has just closed: each is
    # sent again through the client's pool, whose connections keep no order between them, and
    # the first resend is slowed down. They still run in the order they were made (SLOWLOG
    # logs every command here, in the order it ran).
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="resent") as lb:
            await lb.release_server((await lb.acquire_server("warm"))[0], "warm")
            assert _reads_with(lb) == reader
            leases = [await lb.acquire(f"q{i}") for i in range(3)]
            ordinary, sent = lb._exec, []

            async def first_one_slow(call: object) -> object:
                sent.append(call)
                if len(sent) == 1:
                    await asyncio.sleep(0.3)
                return await ordinary(call)  # type: ignore[arg-type]

            lb._exec = first_one_slow  # type: ignore[method-assign]
            r.client_kill_filter(_type="normal", skipme=True)
            r.config_set("slowlog-log-slower-than", 0)  # set back as it was, below
            r.slowlog_reset()
            ends = []
            for lease in leases:
                ends.append(lease.release())
                await asyncio.sleep(0)  # written in this turn: a call of its own
            assert all(await asyncio.wait_for(asyncio.gather(*ends), 30))
            assert len(sent) == 3  # each went again the ordinary way
            ran = [_command(entry) for entry in reversed(r.slowlog_get(128))]
            order = [
                next(i for i, command in enumerate(ran) if lease.token in command)
                for lease in leases
            ]
            assert order == sorted(order), ran
            assert set(invariants.check(r, "resent").values()) == {0}

    threshold = r.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
    try:
        asyncio.run(main())
    finally:
        r.config_set("slowlog-log-slower-than", threshold)


def _command(entry: dict) -> str:
    """A SLOWLOG entry's command line (redis-py gives it as bytes, whatever the client)."""
    command = entry["command"]
    return command.decode() if isinstance(command, bytes) else str(command)


async def _released(lease: object) -> bool:
    return bool(await lease.release())  # type: ignore[attr-defined]
