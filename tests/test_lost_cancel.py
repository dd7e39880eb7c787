"""Background tasks stop although a cancel can be lost.

Before Python 3.12, ``asyncio.wait_for`` returns its inner task's result when that task
completes as the waiting task is cancelled, and the cancel is lost (CPython gh-86296).
redis-py sends every command through ``wait_for`` when a socket timeout is set, as the
balancer sets it; so cancelling the keeper, or a lease's renewer, as its command is being sent
used to leave it running: a closed balancer's keeper registered its retired holder again and
its leases were never reclaimed, and leaving ``lease(renew_every=...)`` hung. These tests hold
a real send until its task has been cancelled, which makes the lost cancel certain on 3.11.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer
from redis_router.scripts import load

from . import invariants

SERVERS = {"s0": "a", "s1": "b"}
LOSES_CANCELS = sys.version_info < (3, 12)

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="the send is held until Task.cancelling() (3.11+)"
)


def _hold_send_until_cancelled(
    monkeypatch: pytest.MonkeyPatch, script: str, sender: Callable[[], asyncio.Task[Any] | None]
) -> list[asyncio.Task[Any]]:
    """The next send of ``script`` completes only once ``sender()`` (the task sending it, read
    when the send starts) has been asked to cancel. Returns a list that gets that task."""
    real, sent = AbstractConnection._send_packed_command, load(script)
    names = (sent.sha.encode(), sent.function.encode())  # by EVALSHA, or by FCALL
    held: list[asyncio.Task[Any]] = []

    async def send(self: AbstractConnection, command: Any) -> None:
        await real(self, command)
        task = sender()
        if held or task is None or not any(n in b"".join(command) for n in names):
            return
        held.append(task)
        while not task.cancelling():
            await asyncio.sleep(0)

    monkeypatch.setattr(AbstractConnection, "_send_packed_command", send)
    return held


def _plain(server: Any) -> Any:
    """A client as redis-py makes it, with a socket timeout, passed in: its connections write
    through ``asyncio.wait_for`` (the balancer's own clients write without it, so their sends
    lose no cancel; a client passed in still does). redis-py writes without ``wait_for``
    when no socket timeout is set, and older versions set none by default: one is set here."""
    return aioredis.Redis.from_url(server.url, socket_timeout=30)


async def _until(held: list[Any]) -> None:
    async with asyncio.timeout(10):
        while not held:
            await asyncio.sleep(0.005)


def test_close_stops_a_keeper_whose_cancel_is_lost(server, r, monkeypatch):
    name = "lost-keeper"
    reaper = RedisLoadBalancer(redis=server.url, name=name, lease_ttl=0.4)

    async def main() -> asyncio.Task[Any]:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=_plain(server), name=name, lease_ttl=0.4)
        await lb.acquire_server("left-open")
        held = _hold_send_until_cancelled(monkeypatch, "heartbeat", lambda: lb._keeper)
        await _until(held)  # a heartbeat is on its way
        await lb.close()
        keeper = held[0]
        assert keeper.done(), "close() returned with its keeper still beating"
        await asyncio.sleep(1.0)  # 10 heartbeat periods
        return keeper

    try:
        keeper = asyncio.run(main())
        # On 3.11 the cancel was lost (the keeper returned instead of being cancelled), and
        # the retired holder stayed retired: close() ended its lease and it left for good.
        assert keeper.cancelled() is not LOSES_CANCELS
        holders = reaper.get_status()["holders"]
        assert (holders["live"], holders["dead"], holders["awaiting_reclaim"]) == (0, 0, 0)
        assert reaper.reap() == 0
        assert invariants.check(r, name) == {"s0": 0, "s1": 0}
    finally:
        reaper.close()


def test_leaving_a_renewed_lease_stops_its_renewer_whose_cancel_is_lost(server, r, monkeypatch):
    name = "lost-renewer"

    def renewer() -> asyncio.Task[Any] | None:
        return next((t for t in asyncio.all_tasks() if "_renew_age" in repr(t.get_coro())), None)

    async def main() -> asyncio.Task[Any]:
        async with AsyncRedisLoadBalancer(SERVERS, redis=_plain(server), name=name) as lb:
            held = _hold_send_until_cancelled(monkeypatch, "renew", renewer)
            async with asyncio.timeout(10):  # before the fix, leaving the lease hung
                async with lb.lease("long", renew_every=0.02) as lease:
                    await _until(held)  # a renewal is on its way
                assert held[0].done()
                assert await lb.get_inflight_count(lease.server_id) == 0
            return held[0]

    task = asyncio.run(main())
    assert task.cancelled() is not LOSES_CANCELS, "the renewer outlived its lease's exit"
    assert invariants.check(r, name) == {"s0": 0, "s1": 0}


def test_a_cancel_while_leaving_a_renewed_lease_propagates_and_releases(server, r, monkeypatch):
    """Leaving the lease waits for its renewer to stop; a cancel of the leaving task meanwhile
    is the caller's, so it is raised (not taken for the renewer's), and the lease still goes."""
    name = "cancel-leaving"

    async def slow_to_stop(lease: Any, stop: asyncio.Event, every: float) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)  # stops on a second cancel only

    monkeypatch.setattr("redis_router.aio._renew_age", slow_to_stop)

    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=_plain(server), name=name) as lb:

            async def body() -> None:
                async with lb.lease("long", renew_every=1.0):
                    await asyncio.sleep(0.01)  # the renewer is running

            leaving = asyncio.ensure_future(body())
            await asyncio.sleep(0.1)  # left the body; waiting for the renewer to stop
            assert not leaving.done()
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
            assert await lb.get_total_inflight() == 0
            for task in asyncio.all_tasks():
                if "slow_to_stop" in repr(task.get_coro()):
                    task.cancel()

    asyncio.run(main())
    assert invariants.check(r, name) == {"s0": 0, "s1": 0}
