"""A partitioned process's late release ends nothing of another process's.

Process A holds sessions, then loses its network (its heartbeats stop; the process lives) for
longer than lease_ttl: the living reclaim its leases and take the sessions' next turns, sticky
to the same replicas. When the network heals, A releases its finished requests, by request id
(as verl and RouterClient do), by replica only or by lease. Each must return False and end
nothing: a release that ended the request's lease of the process now serving it would leave
that request running uncounted (I1) and let a new session onto a replica already at its
capacity (I10). A process that never held the request there still ends its oldest lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, NoCapacity, RedisLoadBalancer
from redis_router.core import Call, new_operation, run_steps
from redis_router.scripts import load

from . import invariants

# Every process's lease ttl: A's leases are reclaimable this long after its last heartbeat;
# the living beat every quarter of it (a gap of half of it would be taken for a pause of Redis).
TTL = 1.0
POOL = {"s0": None, "s1": None}
SESSIONS = ("chat-1", "chat-2")


def _reclaimed(b: RedisLoadBalancer, r: redis.Redis, holder: str) -> None:
    """Wait for A's deadline to pass, then have B reap until A's holder is gone (bounded: a
    probation after a stalled machine delays it by at most half a ttl)."""
    key = invariants.prefix(b.name) + "holders"
    deadline = r.zscore(key, holder)
    assert deadline is not None
    secs, micros = r.time()
    time.sleep(max(0.0, (deadline - (secs * 1000 + micros // 1000)) / 1000) + 0.02)
    limit = time.monotonic() + 10 * TTL
    while r.zscore(key, holder) is not None:
        assert time.monotonic() < limit, "the partitioned holder's leases were never reclaimed"
        b.reap()
        time.sleep(0.02)


def _full_pool(make_lb: Any) -> RedisLoadBalancer:
    """B: a live process on a pool of two replicas that hold one request each."""
    b = make_lb(POOL, lease_ttl=TTL)
    b.add_servers(POOL, capacity=dict.fromkeys(POOL, 1))
    return b


def _next_turns(b: RedisLoadBalancer, placed: dict[str, str]) -> None:
    """The sessions' next turns go through B, sticky: the pool is full again."""
    for rid, sid in placed.items():
        assert b.acquire_server(rid)[0] == sid
    with pytest.raises(NoCapacity):
        b.acquire_server("new", wait=0)


def _b_still_holds(b: RedisLoadBalancer, r: redis.Redis, placed: dict[str, str]) -> None:
    """B's leases are counted and the pool still refuses a new session; B ends them."""
    assert invariants.check(r, b.name) == dict.fromkeys(POOL, 1)
    with pytest.raises(NoCapacity):
        b.acquire_server("new", wait=0)
    for rid, sid in placed.items():
        assert b.release_server(sid, rid)
    assert invariants.check(r, b.name) == dict.fromkeys(POOL, 0)


def test_a_late_release_by_request_id_ends_no_other_process_lease(make_lb, r):
    b = _full_pool(make_lb)
    a = make_lb(name=b.name, lease_ttl=TTL)
    placed = {rid: a.acquire_server(rid)[0] for rid in SESSIONS}
    assert sorted(placed.values()) == sorted(POOL)
    invariants.silence(a)  # A's network fails: its heartbeats stop, the process lives
    _reclaimed(b, r, a._core.holder)
    _next_turns(b, placed)
    for rid, sid in placed.items():  # the network heals: A releases its finished requests
        assert not a.release_server(sid, rid).result()
    _b_still_holds(b, r, placed)


def test_late_releases_by_lease_and_by_replica_end_nothing(make_lb, r):
    b = _full_pool(make_lb)
    a = make_lb(name=b.name, lease_ttl=TTL)
    lease = a.acquire(SESSIONS[0])
    other = a.acquire_server(SESSIONS[1])[0]
    placed = {SESSIONS[0]: lease.server_id, SESSIONS[1]: other}
    invariants.silence(a)
    _reclaimed(b, r, a._core.holder)
    _next_turns(b, placed)
    assert not lease.release()
    assert not a.release_server(other).result()  # by replica only
    _b_still_holds(b, r, placed)


def test_a_process_that_held_a_request_twice_ends_neither_of_its_successors(make_lb, r):
    """Both of A's leases of one request there are named by its releases (the latest, then
    the one before it), so neither late release falls back to B's leases of the request."""
    b = make_lb({"s0": None}, lease_ttl=TTL)
    a = make_lb(name=b.name, lease_ttl=TTL)
    a.acquire_server("same"), a.acquire_server("same")
    invariants.silence(a)
    _reclaimed(b, r, a._core.holder)
    b.acquire_server("same"), b.acquire_server("same")
    assert not a.release_server("s0", "same").result()
    assert not a.release_server("s0", "same").result()
    assert invariants.check(r, b.name) == {"s0": 2}
    assert b.release_server("s0", "same") and b.release_server("s0", "same")
    assert invariants.check(r, b.name) == {"s0": 0}


def test_releases_by_request_id_end_the_process_own_leases_not_an_older_one(make_lb, r):
    """A live process with two leases of a request ends its own two, newest first, even where
    another process's lease of that request is the oldest there."""
    b = make_lb({"s0": None})
    a = make_lb(name=b.name)
    b.acquire_server("same")
    a.acquire_server("same"), a.acquire_server("same")
    assert a.release_server("s0", "same") and a.release_server("s0", "same")
    owned = invariants.prefix(b.name) + "owned:" + b._core.holder
    assert r.zcard(owned) == 1 and invariants.check(r, b.name) == {"s0": 1}
    assert b.release_server("s0", "same")
    assert invariants.check(r, b.name) == {"s0": 0}


def test_a_process_that_never_held_the_request_ends_its_oldest_lease(make_lb, r):
    b = make_lb({"s0": None})
    c = make_lb(name=b.name)  # e.g. a RouterClient of another process
    b.acquire_server("req")
    assert c.release_server("s0", "req") and not b.release_server("s0", "req")
    assert invariants.check(r, b.name) == {"s0": 0}


def test_a_resent_copy_of_a_late_release_ends_nothing_either(make_lb, r):
    """A copy of the late release sent again (redis-py after a timeout) reports the first
    copy's result, False, and ends nothing (I9)."""
    b = make_lb({"s0": None}, lease_ttl=TTL)
    a = make_lb(name=b.name, lease_ttl=TTL)
    a.acquire_server("req")
    invariants.silence(a)
    _reclaimed(b, r, a._core.holder)
    b.acquire_server("req")
    rid, named = a._core._named("s0", "req", None)
    assert named.startswith("?")  # A sends its own token as a hint
    call = Call(load("release"), ("s0", rid, named, new_operation()))
    assert a._exec(call) == [0] and a._exec(call) == [0]
    assert invariants.check(r, b.name) == {"s0": 1}


async def _partitioned(a: AsyncRedisLoadBalancer) -> None:
    """Stop an asyncio balancer's heartbeats; its connection stays (the process lives)."""
    keeper, a._keeper = a._keeper, None
    assert keeper is not None
    keeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await keeper


def test_an_asyncio_process_late_releases_end_nothing(make_lb, server, r):
    b = _full_pool(make_lb)

    async def main() -> None:
        async with AsyncRedisLoadBalancer(name=b.name, redis=server.url, lease_ttl=TTL) as a:
            placed = {rid: (await a.acquire_server(rid))[0] for rid in SESSIONS}
            await _partitioned(a)
            _reclaimed(b, r, a._core.holder)
            _next_turns(b, placed)
            first, second = SESSIONS
            assert not await a.release_server(placed[first], first)  # by request id
            assert not await a.release_server(placed[second])  # by replica only
            _b_still_holds(b, r, placed)

    asyncio.run(main())


def test_a_lease_granted_while_a_release_was_on_its_way_keeps_its_hint(make_lb, r):
    """An asyncio process releases by replica only before it holds anything there, so the
    release names no lease; its two acquires of one request there, in the same loop turn, run
    first and are answered first. The release then ends the replica's oldest lease: both were
    granted at one time, so the lower token, here the newer grant. The ledger must hand the
    hint on to the lease the process still holds, so that its next release of the request
    ends that one and none is left counted."""
    lb = make_lb({"a": None})
    core = lb._core
    older, newer = "f" * 16, "0" * 15 + "1"
    release = core.release("a", None)  # made now: nothing held there, so no hint

    def acquired_first(call: Call) -> Any:
        lb._run(core.acquire(["x", "x"], [older, newer]))  # one call: one time for both
        return lb._exec(call)

    assert run_steps(release, acquired_first) is True
    assert invariants.check(r, lb.name) == {"a": 1}
    assert r.hexists(invariants.prefix(lb.name) + "leases", older)
    assert lb.release_server("a", "x").result()  # the one left, named by its hint
    assert invariants.check(r, lb.name) == {"a": 0}
    assert core.held == {} and core.latest == {} and core.earlier == {}
