"""Coalescing: concurrent calls of one asyncio balancer share round trips, with the result of
making them one after another, and a cancelled caller never leaks a lease."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, NoServersAvailable, RedisUnavailable
from redis_router.coalesce import Coalescer

from . import invariants
from .commandstats import script_calls

SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(8)}


def calls(r: redis.Redis, *commands: str) -> dict[str, int]:
    """How many times the server has run each command (scripts' own calls included)."""
    stats = r.info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands}


async def warm(lb: AsyncRedisLoadBalancer) -> None:
    """Load the scripts (a first use answers NOSCRIPT, which counts as a call)."""
    await lb.release_server((await lb.acquire_server("warm"))[0], "warm")


def test_concurrent_calls_share_round_trips_and_balance_as_sequential_ones(server, r):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="co") as lb:
            await warm(lb)
            r.config_resetstat()
            got = await asyncio.gather(*(lb.acquire_server(f"q{i}") for i in range(64)))
            # all 64 were made before the event loop's next turn: one round trip, which reads
            # the replicas' metadata once for the batch (an HMGET), not once per replica
            assert script_calls(r) == 1 and calls(r, "hget")["hget"] == 0
            assert all(handle == SERVERS[sid] for sid, handle in got)
            # one after another, least-loaded fills 8 idle replicas evenly: 8 each
            assert sorted(Counter(sid for sid, _ in got).values()) == [8] * 8
            assert sum(invariants.check(r, "co").values()) == 64
            r.config_resetstat()
            done = await asyncio.gather(
                *(lb.release_server(sid, f"q{i}") for i, (sid, _) in enumerate(got))
            )
            assert script_calls(r) == 1 and all(done)
            # the batch remembers its 64 operation ids in one HMGET and one HSET and takes the
            # leases off their holder's set in one ZREM (plus one ZREM per lease off its
            # replica's set)
            assert calls(r, "hmget", "hset", "zrem") == {"hmget": 1, "hset": 1, "zrem": 1 + 64}
            assert set(invariants.check(r, "co").values()) == {0}

    asyncio.run(main())


def test_a_coalesced_batch_routes_as_sequential_awaits_with_the_same_seed(server, r):
    ids = [f"u{i % 12}" for i in range(30)]  # 12 sessions, most with several turns

    async def main() -> None:
        kw: dict[str, Any] = {"redis": server.url}
        async with (
            AsyncRedisLoadBalancer(
                SERVERS, name="seq", coalesce=False, rng=random.Random(5), **kw
            ) as one_by_one,
            AsyncRedisLoadBalancer(SERVERS, name="bat", rng=random.Random(5), **kw) as together,
        ):
            sequential = [await one_by_one.acquire_server(rid) for rid in ids]
            before = script_calls(r)
            coalesced = await asyncio.gather(*(together.acquire_server(rid) for rid in ids))
            assert script_calls(r) - before == 1
            assert coalesced == sequential
            assert invariants.check(r, "seq") == invariants.check(r, "bat")

    asyncio.run(main())


def test_a_caller_cancelled_before_its_batch_is_sent_takes_nothing(server, r):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="cb") as lb:
            gate, send = asyncio.Event(), lb._exec

            async def held(call: Any) -> Any:
                await gate.wait()
                return await send(call)

            lb._pipe = None  # coalesced calls go through _exec, which the test holds
            lb._exec = held  # type: ignore[method-assign]
            first = asyncio.ensure_future(lb.acquire_server("first"))
            await asyncio.sleep(0.05)  # first is in flight, held at the gate
            second = asyncio.ensure_future(lb.acquire_server("second"))
            await asyncio.sleep(0.05)  # second waits in the queue
            second.cancel()
            gate.set()
            sid, _ = await first
            with pytest.raises(asyncio.CancelledError):
                await second
            await asyncio.sleep(0.05)
            assert invariants.check(r, "cb") == {**dict.fromkeys(SERVERS, 0), sid: 1}
            assert await lb.release_server(sid, "first")
            assert not await lb.release_server(sid, "second")

    asyncio.run(main())


def test_a_caller_cancelled_after_its_batch_was_sent_leaks_no_lease(server, r):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="ca") as lb:
            gate, send = asyncio.Event(), lb._exec

            async def reply_held(call: Any) -> Any:
                reply = await send(call)  # the lease is granted in Redis now
                await gate.wait()
                return reply

            lb._pipe = None  # coalesced calls go through _exec, which the test holds
            lb._exec = reply_held  # type: ignore[method-assign]
            waiter = asyncio.ensure_future(lb.acquire_server("gone"))
            await asyncio.sleep(0.1)
            assert sum(invariants.check(r, "ca").values()) == 1
            waiter.cancel()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            for _ in range(200):  # the orphaned lease is released in the background
                if sum(invariants.check(r, "ca").values()) == 0:
                    break
                await asyncio.sleep(0.01)
            assert set(invariants.check(r, "ca").values()) == {0}

    asyncio.run(main())


def test_a_refused_batch_is_retried_request_by_request(server, r):
    """Batches are refused whole when one request has nowhere to go; a coalesced caller must
    not fail because another one had nowhere to go."""

    async def main() -> None:
        async with AsyncRedisLoadBalancer({"s0": "a"}, redis=server.url, name="nb") as lb:
            lease = await lb.acquire("sticky")
            await lease.release()
            await lb.drain_servers(["s0"])  # no replica takes new sessions; s0 keeps its own
            got = await asyncio.gather(
                lb.acquire_server("new-1"),
                lb.acquire_server("sticky"),
                lb.acquire_server("new-2"),
                return_exceptions=True,
            )
            assert isinstance(got[0], NoServersAvailable)
            assert got[1] == ("s0", "a")
            assert isinstance(got[2], NoServersAvailable)
            assert invariants.check(r, "nb") == {"s0": 1}

    asyncio.run(main())


def test_a_grant_reaches_its_caller_when_a_later_retried_request_fails(server, r):
    """In the request-by-request retry of a refused batch, a transport error on a later
    request fails that request alone: the earlier grant is delivered, never leaked."""

    async def main() -> None:
        async with AsyncRedisLoadBalancer({"s0": "a"}, redis=server.url, name="nb2") as lb:
            await (await lb.acquire("sticky")).release()
            await lb.drain_servers(["s0"])
            real_acquire = lb._acquire

            async def flaky(rids: list[str], *args: Any, **kw: Any) -> Any:
                if rids == ["after"]:
                    raise RedisUnavailable("injected: connection dropped")
                return await real_acquire(rids, *args, **kw)

            lb._acquire = flaky  # type: ignore[method-assign]
            got = await asyncio.gather(
                lb.acquire("new"),
                lb.acquire("sticky"),
                lb.acquire("after"),
                return_exceptions=True,
            )
            assert isinstance(got[0], NoServersAvailable)
            assert got[1].server_id == "s0"
            assert isinstance(got[2], RedisUnavailable)
            assert invariants.check(r, "nb2") == {"s0": 1}
            assert await got[1].release()
            assert invariants.check(r, "nb2") == {"s0": 0}

    asyncio.run(main())


def script_calls_naming(r: redis.Redis, rids: list[str]) -> list[list[str]]:
    """The request ids each script call (EVALSHA or FCALL) since the last SLOWLOG RESET
    carried, one list per call that carried any (a keeper's heartbeat, which may come at any
    time, carries none)."""
    found: list[list[str]] = []
    for entry in r.slowlog_get(1024):
        command = entry["command"]
        args = (command.decode() if isinstance(command, bytes) else command).split(" ")
        named = [rid for rid in rids if rid in args]
        if args[0].upper() in ("EVALSHA", "FCALL", "FCALL_RO") and named:
            found.append(named)
    return found


@pytest.fixture
def every_command_logged(r: redis.Redis) -> Iterator[None]:
    """SLOWLOG records every command (threshold 0) during the test, then the settings return."""
    kept = r.config_get("slowlog-*")
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", 1024)
    r.slowlog_reset()
    yield
    for key, value in kept.items():
        r.config_set(key, value)
    r.slowlog_reset()


def test_without_coalescing_each_call_is_its_own_round_trip(server, r, every_command_logged):
    rids = [f"q{i}" for i in range(10)]

    async def main() -> None:
        async with AsyncRedisLoadBalancer(
            SERVERS, redis=server.url, name="nc", coalesce=False
        ) as lb:
            await warm(lb)
            r.slowlog_reset()
            got = await asyncio.gather(*(lb.acquire_server(rid) for rid in rids))
            one_each = sorted([rid] for rid in rids)
            assert sorted(script_calls_naming(r, rids)) == one_each  # a script call each
            r.slowlog_reset()
            placed = zip(rids, got, strict=True)
            await asyncio.gather(*(lb.release_server(sid, rid) for rid, (sid, _) in placed))
            assert sorted(script_calls_naming(r, rids)) == one_each

    asyncio.run(main())


def _writes(lb: AsyncRedisLoadBalancer) -> list[str]:
    """The scripts the balancer writes on its ordered connection from now on, in order."""
    names: list[str] = []
    pipe = lb._pipe
    assert pipe is not None
    write = pipe.write_then

    def counted(call: Any, handle: Any) -> bool:
        names.append(call.script.name)
        return write(call, handle)

    pipe.write_then = counted  # type: ignore[method-assign]
    return names


def test_a_lone_session_writes_its_release_and_next_acquire_in_its_own_step(server, r):
    """One session: its release is written when it is posted, and its next acquire when it
    is made, in the same step; with a second session's lease held, both wait for the loop's
    next turn (and go with whatever else that turn makes)."""

    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="lone") as lb:
            await warm(lb)
            written = _writes(lb)
            sid, _ = await lb.acquire_server("a")
            written.clear()
            released = lb.release_server(sid, "a")
            assert written == ["release"]  # before release_server returned
            nxt = asyncio.ensure_future(lb.acquire_server("b"))
            await asyncio.sleep(0)  # one turn: nxt makes its acquire, then this resumes
            assert written == ["release", "acquire"]
            assert await released and (await nxt)[0] in SERVERS
            sid, _ = await lb.acquire_server("c")  # two leases held now: b and c
            written.clear()
            released = lb.release_server(sid, "c")
            assert written == []
            nxt = asyncio.ensure_future(lb.acquire_server("d"))
            await asyncio.sleep(0)  # the release goes first; the acquire on the turn after
            assert written == ["release"]
            assert await released and (await nxt)[0] in SERVERS
            assert written == ["release", "acquire"]
            assert sum(invariants.check(r, "lone").values()) == 2  # b and d

    asyncio.run(main())


def test_a_burst_right_after_a_lone_release_is_routed_as_sequential_calls(server, r):
    """A burst made while a lone session's release is unanswered: its first acquire goes at
    once, the other 63 in one call on the next turn, and they route as one after another."""

    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="burst") as lb:
            await warm(lb)
            written = _writes(lb)
            sid, _ = await lb.acquire_server("a")
            lb.release_server(sid, "a")
            got = await asyncio.gather(*(lb.acquire_server(f"q{i}") for i in range(64)))
            assert written == ["acquire", "release", "acquire", "acquire"]
            assert sorted(Counter(s for s, _ in got).values()) == [8] * 8
            assert sum(invariants.check(r, "burst").values()) == 64

    asyncio.run(main())


def test_coalesce_must_be_a_bool():
    with pytest.raises(TypeError, match="coalesce must be a bool"):
        AsyncRedisLoadBalancer(SERVERS, redis="redis://127.0.0.1:1", coalesce="yes")  # type: ignore[arg-type]


# -- the Coalescer alone (no Redis) ----------------------------------------------------------


def test_a_batch_error_reaches_every_caller_and_item_errors_only_theirs():
    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int | BaseException]:
        sent.append(items)
        await asyncio.sleep(0.01)
        if 13 in items:
            raise ConnectionError("down")
        return [ValueError(i) if i % 2 else i * 10 for i in items]

    async def main() -> None:
        co: Coalescer[int, int] = Coalescer(send)
        first = asyncio.ensure_future(co.submit(0))
        await asyncio.sleep(0.001)  # 0 is in flight: the rest wait and go together
        rest = await asyncio.gather(*(co.submit(i) for i in range(1, 6)), return_exceptions=True)
        got = [await first, *rest]
        assert sent == [[0], [1, 2, 3, 4, 5]]
        assert got[0] == 0 and got[2] == 20 and got[4] == 40
        assert all(isinstance(got[i], ValueError) for i in (1, 3, 5))
        got = await asyncio.gather(
            co.submit(12), co.submit(13), co.submit(14), return_exceptions=True
        )
        assert all(isinstance(g, ConnectionError) for g in got)  # one batch: all of it fails
        assert await co.submit(16) == 160  # and the next batch goes on

    asyncio.run(main())


def test_batches_are_capped_and_keep_arrival_order():
    from redis_router import coalesce

    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int | BaseException]:
        sent.append(items)
        await asyncio.sleep(0)
        return list(items)

    async def main() -> None:
        co: Coalescer[int, int] = Coalescer(send)
        n = coalesce.MAX_BATCH + 10
        assert await asyncio.gather(*(co.submit(i) for i in range(n))) == list(range(n))
        assert [len(b) for b in sent] == [coalesce.MAX_BATCH, 10]
        assert [i for b in sent for i in b] == list(range(n))

    asyncio.run(main())
