"""A pool sharded over K balancers, both flavours, on every server: replicas' homes, where
new sessions go, stickiness from any process, GRPO groups, a shard that cannot take a
session, the pool as one in status, bad input, and the directory's own invariant (D1).
A real Cluster (slots over primaries, a failover) is in test_sharded_cluster."""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from redis_router import NoCapacity, NoServersAvailable
from redis_router.aio_sharded import AsyncShardedLoadBalancer
from redis_router.coalesce import Coalescer
from redis_router.errors import ConfigMismatch
from redis_router.local_server import LocalServer
from redis_router.sharded import ShardedLoadBalancer
from redis_router.shards import (
    MAX_NAME,
    PUBLISH_EVERY,
    cluster_primaries,
    shard_names,
    slot_of,
)

from . import invariants

_names = itertools.count()
FLAVOURS = ("sync", "asyncio")


class Blocking:
    """An asyncio pool driven from the test as a blocking one: every coroutine (and every
    awaitable a method returns) runs to completion on the test's event loop."""

    def __init__(self, pool: AsyncShardedLoadBalancer, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.loop = pool, loop

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.pool, attr)
        if not callable(value):
            return value

        def call(*args: Any, **kw: Any) -> Any:
            return self.loop.run_until_complete(_in_loop(value, *args, **kw))

        return call

    def acquire(self, *args: Any, **kw: Any) -> Any:
        return _Lease(self.loop.run_until_complete(self.pool.acquire(*args, **kw)), self.loop)

    def idle(self, seconds: float) -> None:
        """Let the pool's background tasks run (the sync pool's run in their own threads)."""
        self.loop.run_until_complete(asyncio.sleep(seconds))


class _Lease:
    def __init__(self, lease: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._lease, self._loop = lease, loop
        self.server_id, self.request_id = lease.server_id, lease.request_id

    def release(self) -> bool:
        return bool(self._loop.run_until_complete(_in_loop(self._lease.release)))


async def _in_loop(method: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Call ``method`` on the running loop; await what it returns if it is awaitable."""
    got = method(*args, **kw)
    if asyncio.iscoroutine(got) or hasattr(got, "__await__"):
        return await got
    return got


@pytest.fixture
def make_pool(server: LocalServer, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Build sharded pools of the test's flavour on the test's server (a fresh name each
    unless given); closed after the test."""
    flavour = request.param
    loop = asyncio.new_event_loop() if flavour == "asyncio" else None
    made: list[Any] = []

    def make(servers: Any = None, *, shards: int = 4, **kw: Any) -> Any:
        kw.setdefault("name", f"sp{next(_names)}")
        if loop is None:
            pool = ShardedLoadBalancer(servers, shards=shards, redis=server.url, **kw)
            pool.idle = time.sleep
            made.append(pool)
            return pool
        made.append(AsyncShardedLoadBalancer(servers, shards=shards, redis=server.url, **kw))
        view = Blocking(made[-1], loop)
        view.get_status()  # the layout is read (or written) by the first call
        return view

    yield make
    for pool in made:
        if loop is None:
            pool.close()
        else:
            loop.run_until_complete(pool.close())
    if loop is not None:
        loop.close()


both = pytest.mark.parametrize("make_pool", FLAVOURS, indirect=True)
REPLICAS = {f"r{i}": f"http://10.0.0.{i}:8000" for i in range(8)}


def check_directory(r: redis.Redis, name: str, k: int) -> None:
    """D1: each shard's n:<s> counts the replicas whose home it is, cap:<s> their
    capacities; every home names a shard of the layout."""
    p = invariants.prefix(name)
    homes = r.hgetall(p + "homes")
    stats = {k_: int(v) for k_, v in r.hgetall(p + "shards").items()}
    n = collections.Counter(int(v.split()[0]) for v in homes.values())
    cap = collections.Counter()
    for v in homes.values():
        s, c = v.split()
        cap[int(s)] += int(c)
    assert all(0 <= s < k for s in n)
    for s in range(k):
        assert stats.get(f"n:{s}", 0) == n[s], (s, stats, homes)
        assert stats.get(f"cap:{s}", 0) == cap[s], (s, stats, homes)


def check_shards(r: redis.Redis, pool: Any) -> int:
    """I1 and I2 on every shard; returns the pool's in-flight total as the keys say."""
    return sum(sum(invariants.check(r, n).values()) for n in pool.shard_names)


# -- pure parts ----------------------------------------------------------------------------


def test_shard_names_fall_on_the_primaries_in_turn() -> None:
    primaries = [[(0, 5460)], [(5461, 10922)], [(10923, 16383)]]
    names = shard_names("pool", 6, primaries)
    on = [
        next(i for i, rs in enumerate(primaries) if rs[0][0] <= slot_of(n) <= rs[0][1])
        for n in names
    ]
    assert on == [0, 1, 2, 0, 1, 2]
    assert len(set(names)) == 6
    assert shard_names("pool", 3) == ["pool/shard-0", "pool/shard-1", "pool/shard-2"]


def test_cluster_primaries_groups_slot_ranges_by_primary_in_address_order() -> None:
    reply = {
        (0, 99): {"primary": ("127.0.0.1", 7002), "replicas": []},
        (100, 199): {"primary": ("127.0.0.1", 7001), "replicas": []},
        (200, 299): {"primary": ("127.0.0.1", 7002), "replicas": []},
    }
    assert cluster_primaries(reply) == [[(100, 199)], [(0, 99), (200, 299)]]


@pytest.mark.parametrize(
    ("kw", "error", "says"),
    [
        ({"shards": 1}, ValueError, "shards must be 2-256"),
        ({"shards": 257}, ValueError, "shards must be 2-256"),
        ({"shards": "4"}, TypeError, "shards must be an int"),
        ({"shards": True}, TypeError, "shards must be an int"),
        ({"shards": 4, "name": "x" * (MAX_NAME + 1)}, ValueError, "at most"),
        ({"shards": 4, "name": "a{b}"}, ValueError, "name must be"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(
    kw: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        ShardedLoadBalancer(redis="redis://127.0.0.1:1/0", **kw)
    with pytest.raises(error, match=says):
        AsyncShardedLoadBalancer(redis="redis://127.0.0.1:1/0", **kw)


# -- on a server ---------------------------------------------------------------------------


@both
def test_replicas_get_homes_balanced_by_count_then_capacity(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(shards=3)
    pool.add_servers({f"a{i}": "u" for i in range(7)})
    status = pool.get_status()
    assert sorted(p["replicas"] for p in status["placement"]) == [2, 2, 3]
    # The next two go to the two shards with 2 (3 each now); the one after, with every
    # shard at 3, to the shard with the least capacity (0: no capacity declared there).
    pool.add_servers({"c0": {"url": "u", "capacity": 5}, "c1": {"url": "u", "capacity": 1}})
    pool.add_servers({"c2": {"url": "u", "capacity": 7}})
    placing = pool.get_status()["placement"]
    assert sorted(p["replicas"] for p in placing) == [3, 3, 4]
    assert sorted(p["capacity"] for p in placing) == [1, 5, 7]
    # Then counts tie at 3, 3 (c0's and c1's shards): the next goes to c1's (capacity 1).
    pool.add_servers({"c3": {"url": "u", "capacity": 2}})
    placing = pool.get_status()["placement"]
    assert sorted((p["replicas"], p["capacity"]) for p in placing) == [(3, 5), (4, 3), (4, 7)]
    check_directory(r, pool.name, 3)
    assert sorted(pool.get_all_servers()) == sorted(
        [*(f"a{i}" for i in range(7)), "c0", "c1", "c2", "c3"]
    )


@both
def test_new_sessions_spread_over_the_shards_and_their_replicas(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(REPLICAS, shards=4)
    leases = [pool.acquire(f"s{i}") for i in range(64)]
    per = collections.Counter(lease.server_id for lease in leases)
    assert set(per) == set(REPLICAS)
    # Exactly 8 each unless a published total lagged a placement (then one off, transiently).
    assert max(per.values()) - min(per.values()) <= 2, per
    assert check_shards(r, pool) == 64
    assert pool.get_total_inflight() == 64
    for lease in leases:
        assert lease.release()
    assert check_shards(r, pool) == 0


@both
def test_a_session_keeps_its_replica_from_any_process(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    first = make_pool(REPLICAS, shards=4)
    other = make_pool(shards=4, name=first.name)  # another process: nothing remembered
    where = {f"s{i}": first.acquire_server(f"s{i}")[0] for i in range(40)}
    for rid, sid in where.items():
        assert first.release_server(sid, rid)
    for rid, sid in where.items():
        assert other.acquire_server(rid)[0] == sid
        assert other.release_server(sid, rid)
    assert check_shards(r, first) == 0


@both
def test_a_release_on_a_replica_this_process_has_not_seen_ends_on_its_home(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    """As every call naming a replica, a release by replica reads the layout for one this
    process has not seen (added by another since it joined), and ends the lease there."""
    other = make_pool(shards=4)  # joined before any replica was added
    first = make_pool(REPLICAS, shards=4, name=other.name)
    where = {f"s{i}": first.acquire_server(f"s{i}")[0] for i in range(16)}
    homes = {int(v.split()[0]) for v in r.hgetall(invariants.prefix(other.name) + "homes").values()}
    assert len(homes) == 4  # the replicas' homes are on every shard, not only shard 0
    for rid, sid in where.items():
        assert other.release_server(sid, rid), (rid, sid)
    assert check_shards(r, first) == 0
    assert not other.release_server(where["s0"], "s0")  # released already: a no-op
    with pytest.raises(ValueError, match="server_id must be a non-empty string"):
        other.release_server("", "s0")


@both
def test_a_grpo_group_is_placed_as_one(make_pool: Callable[..., Any], r: redis.Redis) -> None:
    pool = make_pool(REPLICAS, shards=4, groups={"by": "-"})
    for prompt in range(6):
        got = {pool.acquire_server(f"p{prompt}-s{j}")[0] for j in range(8)}
        assert len(got) == 1, got  # one shard, and inside it one replica (the group option)
    assert check_shards(r, pool) == 48


@both
def test_a_new_session_goes_to_another_shard_when_its_own_cannot_take_it(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool({"x": "u", "y": "u"}, shards=2)
    homes = {p["shard"]: p["replicas"] for p in pool.get_status()["placement"]}
    assert sorted(homes.values()) == [1, 1]
    pool.drain_servers(["x"])
    got = collections.Counter(pool.acquire_server(f"n{i}")[0] for i in range(10))
    assert got == {"y": 10}
    pool.drain_servers(["y"])
    with pytest.raises(NoServersAvailable):
        pool.acquire_server("nowhere")
    pool.undrain_servers(["x", "y"])
    assert pool.acquire_server("somewhere")[0] in ("x", "y")
    check_directory(r, pool.name, 2)


@both
def test_a_full_shard_sends_a_new_session_to_one_with_room(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool({"x": {"url": "u", "capacity": 1}, "y": {"url": "u", "capacity": 1}}, shards=2)
    first = pool.acquire_server("a")[0]
    second = pool.acquire_server("b")[0]
    assert {first, second} == {"x", "y"}
    with pytest.raises(NoCapacity):
        pool.acquire_server("c")
    assert pool.release_server(first, "a")
    assert pool.acquire_server("c")[0] == first
    assert check_shards(r, pool) == 2


def _lease_once(pool: Any, request_id: str) -> str:
    """Enter and leave ``pool.lease(request_id)``, either flavour: the replica it gave."""
    if isinstance(pool, Blocking):

        async def enter() -> str:
            async with pool.pool.lease(request_id) as lease:
                return str(lease.server_id)

        return str(pool.loop.run_until_complete(enter()))
    with pool.lease(request_id) as lease:
        return str(lease.server_id)


@both
def test_a_lease_whose_shard_is_full_is_placed_on_another_as_an_acquire_is(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool({"x": {"url": "u", "capacity": 1}, "y": {"url": "u", "capacity": 1}}, shards=2)
    before = _lease_once(pool, "turn")  # the session's shard is remembered
    taken = {pool.acquire_server(rid)[0]: rid for rid in ("a", "b")}
    assert set(taken) == {"x", "y"}
    other = "y" if before == "x" else "x"
    assert pool.release_server(other, taken[other])  # room on the other shard only
    assert _lease_once(pool, "turn") == other
    assert check_shards(r, pool) == 1


@both
def test_a_batch_is_granted_whole_or_not_at_all_across_shards(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool({"x": {"url": "u", "capacity": 1}, "y": {"url": "u", "capacity": 1}}, shards=2)
    # Pin two sessions, one per shard, then fill x with a third.
    a, b = pool.acquire_server("a")[0], pool.acquire_server("b")[0]
    assert {a, b} == {"x", "y"}
    pool.release_server(a, "a")
    pool.release_server(b, "b")
    blocker = pool.acquire_server("a")  # a's replica is full now
    with pytest.raises(NoCapacity):
        pool.acquire_many(["b", "a"])  # b's shard grants, a's refuses: b's grant is undone
    assert pool.get_total_inflight() == 1
    assert check_shards(r, pool) == 1
    pool.release_server(blocker[0], "a")
    assert sorted(s for s, _ in pool.acquire_many(["b", "a"])) == ["x", "y"]


@both
def test_status_shows_the_pool_as_one_and_each_shard(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(REPLICAS, shards=4)
    leases = [pool.acquire(f"s{i}") for i in range(12)]
    status = pool.get_status()
    assert status["name"] == pool.name
    assert status["total_inflight"] == 12 == sum(status["servers"].values())
    assert set(status["servers"]) == set(REPLICAS) == set(status["replicas"])
    assert [s["name"] for s in status["shards"]] == pool.shard_names
    assert sum(s["total_inflight"] for s in status["shards"]) == 12
    assert sum(s["servers"] for s in status["shards"]) == 8
    assert status["active_servers"] == 8
    for lease in leases:
        lease.release()


@both
def test_published_totals_reach_the_directory(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(REPLICAS, shards=4)
    leases = [pool.acquire(f"s{i}") for i in range(20)]
    deadline = time.monotonic() + 10
    while True:
        placing = pool.get_status()["placement"]
        if sum(p["published_inflight"] for p in placing) == 20:
            break
        assert time.monotonic() < deadline, placing
        pool.idle(0.05)
    for lease in leases:
        lease.release()


@both
def test_remove_and_drain_act_on_the_pool(make_pool: Callable[..., Any], r: redis.Redis) -> None:
    pool = make_pool(REPLICAS, shards=4)
    assert pool.drain_servers(["r0", "r5"]) == 2
    assert sorted(pool.get_status()["draining_servers"]) == ["r0", "r5"]
    assert pool.remove_servers(["r0", "r1", "nope"]) == 2
    assert sorted(pool.get_all_servers()) == [f"r{i}" for i in range(2, 8)]
    assert sum(p["replicas"] for p in pool.get_status()["placement"]) == 6
    check_directory(r, pool.name, 4)
    assert pool.get_inflight_count("r2") == 0


@both
def test_a_lost_directory_record_costs_one_placement(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(REPLICAS, shards=4)
    sid = pool.acquire_server("roaming")[0]
    pool.release_server(sid, "roaming")
    p = invariants.prefix(pool.name)
    r.delete(p + "placed", p + "placed:old")
    other = make_pool(shards=4, name=pool.name)
    again = other.acquire_server("roaming")[0]  # placed anew, and recorded again
    assert r.hexists(p + "placed", "roaming")
    assert other.acquire_server("roaming")[0] == again
    assert check_shards(r, pool) == 2


@both
def test_a_process_joins_the_pool_as_it_is_and_never_shrinks_it(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(REPLICAS, shards=4)
    before = sorted(r.keys("*"))
    with pytest.raises(ConfigMismatch, match=r"has 4 shards, this process asked for 5: grow"):
        make_pool(shards=5, name=pool.name)
    assert sorted(r.keys("*")) == before
    # A process configured before the pool grew joins it with every shard.
    older = make_pool(shards=2, name=pool.name)
    assert older.shard_names == pool.shard_names
    with pytest.raises(ValueError, match="a pool only grows; it has 4, got 3"):
        pool.grow(3)


@both
def test_the_name_of_an_unsharded_balancer_is_refused(
    make_pool: Callable[..., Any], r: redis.Redis, make_lb: Callable[..., Any]
) -> None:
    make_lb({"a": "u"}, name="plain")
    with pytest.raises(ConfigMismatch, match="unsharded balancer named 'plain'"):
        make_pool(shards=2, name="plain")
    assert r.exists(invariants.prefix("plain") + "layout") == 0


@both
def test_bad_input_writes_nothing(make_pool: Callable[..., Any], r: redis.Redis) -> None:
    pool = make_pool(REPLICAS, shards=2)
    before = {k: r.type(k) for k in r.keys("*")}
    with pytest.raises(ValueError, match="request_id"):
        pool.acquire_server("")
    with pytest.raises(TypeError):
        pool.acquire_many(["a", 3])
    with pytest.raises((TypeError, ValueError)):
        pool.add_servers({"n": {"url": "u", "capacity": -1}})
    with pytest.raises(TypeError, match="exclude must be a collection"):
        pool.acquire_server("a", exclude="r0")  # a str, not a collection of ids
    assert {k: r.type(k) for k in r.keys("*")} == before


@both
def test_destroy_deletes_every_key_of_the_pool(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool(REPLICAS, shards=4)
    for i in range(10):
        pool.acquire_server(f"s{i}")
    assert r.keys("*")
    # The publisher (started by the first placement) is made slow reading a shard's total,
    # and the pool destroyed while it reads: what it read must not be written afterwards.
    shard, reading, slow = getattr(pool, "pool", pool)._shards[0], threading.Event(), 0.5
    real = shard.get_total_inflight
    if inspect.iscoroutinefunction(real):

        async def held() -> int:
            reading.set()
            await asyncio.sleep(slow)
            return int(await real())
    else:

        def held() -> int:
            reading.set()
            time.sleep(slow)
            return int(real())

    shard.get_total_inflight = held
    deadline = time.monotonic() + 10
    while not reading.is_set():
        assert time.monotonic() < deadline, "the publisher never read a shard's total"
        pool.idle(0.02)
    assert pool.destroy() > 0
    assert r.keys("*") == []
    pool.idle(2 * slow + 3 * PUBLISH_EVERY)
    assert r.keys(f"rr:{{{pool.name}}}:*") == []  # the directory's (no keeper writes there)


@both
def test_growing_the_pool_keeps_every_placed_session_on_its_replica(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool({f"a{i}": "u" for i in range(4)}, shards=2)
    other = make_pool(shards=2, name=pool.name)  # a process that does not grow it itself
    where = {f"s{i}": pool.acquire_server(f"s{i}")[0] for i in range(40)}
    for rid, sid in where.items():
        pool.release_server(sid, rid)
    assert len(pool.grow(4)) == 4
    # New shards start empty and take the replicas added next.
    pool.add_servers({f"b{i}": "u" for i in range(4)})
    placing = pool.get_status()["placement"]
    assert [p["replicas"] for p in placing] == [2, 2, 2, 2]
    # Every session placed before keeps its replica, from the process that did not grow it.
    for rid, sid in where.items():
        assert other.acquire_server(rid)[0] == sid
        other.release_server(sid, rid)
    # New sessions reach the new shards, from either process, which now sees four.
    fresh = collections.Counter(other.acquire_server(f"n{i}")[0] for i in range(40))
    assert sum(n for sid, n in fresh.items() if sid.startswith("b")) >= 10, fresh
    assert other.shard_names == pool.shard_names
    check_directory(r, pool.name, 4)
    assert check_shards(r, pool) == 40


@both
def test_a_replica_moves_to_a_new_shard_and_only_its_sessions_are_placed_again(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    pool = make_pool({f"a{i}": "u" for i in range(8)}, shards=2)
    other = make_pool(shards=2, name=pool.name)
    where = {f"s{i}": pool.acquire_server(f"s{i}")[0] for i in range(48)}
    for rid, sid in where.items():
        pool.release_server(sid, rid)
    old_home = dict(pool._homes)  # replica -> its shard, as this process read them
    pool.grow(4)
    # The documented move: drain, wait until idle (nothing in flight here), remove, add again:
    # a replica added goes to the emptiest shard, here the two new ones.
    moved = ["a0", "a1"]
    pool.drain_servers(moved)
    assert all(pool.get_inflight_count(sid) == 0 for sid in moved)
    assert pool.remove_servers(moved) == 2
    pool.add_servers(dict.fromkeys(moved, "u"))
    placing = pool.get_status()["placement"]
    assert [p["replicas"] for p in placing] == [3, 3, 1, 1]
    assert sorted(pool._home(sid) for sid in moved) == [2, 3]
    for rid, sid in where.items():
        got = other.acquire_server(rid)[0]
        if sid in moved:  # placed again inside its old shard, on a replica still there
            assert got not in moved and old_home[got] == old_home[sid], (rid, sid, got)
        else:
            assert got == sid, (rid, sid, got)
        other.release_server(got, rid)
    check_directory(r, pool.name, 4)
    assert check_shards(r, pool) == 0


def test_sessions_keep_their_replicas_while_the_pool_grows_under_running_workers(
    server: LocalServer, r: redis.Redis
) -> None:
    """Workers (each a pool instance of its own, as processes are) take turns of their
    sessions while another grows the pool and adds replicas: every turn of a session placed
    before lands on its replica."""
    name = f"sp{next(_names)}"
    admin = ShardedLoadBalancer(
        {f"a{i}": "u" for i in range(4)}, shards=2, redis=server.url, name=name
    )
    workers = [ShardedLoadBalancer(shards=2, redis=server.url, name=name) for _ in range(3)]
    try:
        first = {}
        for w, pool in enumerate(workers):
            for i in range(10):
                rid = f"w{w}-s{i}"
                first[rid] = pool.acquire_server(rid)[0]
                pool.release_server(first[rid], rid)
        moved: list[tuple[str, str, str]] = []
        stop = threading.Event()
        turns = collections.Counter()

        def work(w: int, pool: ShardedLoadBalancer) -> None:
            while not stop.is_set():
                for i in range(10):
                    rid = f"w{w}-s{i}"
                    sid = pool.acquire_server(rid)[0]
                    if sid != first[rid]:
                        moved.append((rid, first[rid], sid))
                    pool.release_server(sid, rid)
                    turns[w] += 1

        threads = [
            threading.Thread(target=work, args=(w, p), daemon=True) for w, p in enumerate(workers)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while min(turns[w] for w in range(3)) < 20:
            assert time.monotonic() < deadline, turns
            time.sleep(0.01)
        admin.grow(4)
        admin.add_servers({f"b{i}": "u" for i in range(4)})
        seen = dict(turns)
        while any(turns[w] < seen[w] + 20 for w in range(3)):
            assert time.monotonic() < deadline, turns
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()
        assert moved == []
        assert check_shards(r, admin) == 0
        check_directory(r, name, 4)
    finally:
        stop.set()
        for pool in (admin, *workers):
            pool.close()


def test_a_yaml_router_config_builds_a_sharded_pool(
    server: LocalServer, r: redis.Redis, tmp_path: Any
) -> None:
    from redis_router import get_router_handle

    path = tmp_path / "router.yaml"
    path.write_text("router_class: redis_router.ShardedLoadBalancer\nshards: 3\nlease_ttl: 30\n")
    name = f"sp{next(_names)}"
    pool = get_router_handle(REPLICAS, str(path), redis=server.url, name=name)
    try:
        assert isinstance(pool, ShardedLoadBalancer)
        assert len(pool.shard_names) == 3
        assert pool.get_status()["lease_ttl"] == 30
        sid, _ = pool.acquire_server("a")
        assert pool.release_server(sid, "a")
        check_directory(r, name, 3)
    finally:
        pool.close()
    joined = ShardedLoadBalancer(redis=server.url, name=name)  # no count: the pool as it is
    assert joined.shard_names == pool.shard_names
    joined.close()
    with pytest.raises(ConfigMismatch, match="no sharded pool named 'nothing-here'"):
        ShardedLoadBalancer(redis=server.url, name="nothing-here")
    assert r.keys("rr:{nothing-here}:*") == []


@pytest.mark.slow
def test_a_sessions_record_lives_a_generation_after_its_last_lookup(
    server: LocalServer, r: redis.Redis
) -> None:
    """D2 with a 4 s sticky_ttl (one generation). Records rotate when the shards' totals are
    published (the pool's publisher, every 0.1 s while it routes; called by hand here): a
    record looked up within a generation is kept; two rotations without a lookup drop it, and
    its session is placed anew (counted as a new placement)."""
    name = f"sp{next(_names)}"
    pool = ShardedLoadBalancer(REPLICAS, shards=2, redis=server.url, name=name, sticky_ttl=4.0)
    p = invariants.prefix(name)

    def place(key: str) -> int:  # what a process that remembers nothing asks the directory
        return pool._dir._run(pool._directory.place([key]))[0]

    def publish() -> None:
        pool._dir._run(pool._directory.totals({}))

    def placements() -> int:
        stats = r.hgetall(p + "shards")
        return sum(int(v) for f, v in stats.items() if f.startswith("new:"))

    try:
        publish()  # the first rotation starts the generation
        first = place("kept")
        place("dropped")
        assert placements() == 2
        for _ in range(3):  # each lookup within a generation of the previous one
            time.sleep(0.5)
            publish()
            assert place("kept") == first
        assert placements() == 2  # lookups, not placements
        for _ in range(2):  # two rotations without a lookup of either
            time.sleep(4.2)
            publish()
        assert not r.hexists(p + "placed", "dropped")
        assert not r.hexists(p + "placed:old", "dropped")
        place("kept")
        assert placements() == 3  # "kept" was placed anew: its record was dropped
    finally:
        pool.close()


@both
def test_sessions_weights_engines_and_dead_holders_act_on_every_shard(
    make_pool: Callable[..., Any], r: redis.Redis
) -> None:
    from redis_router import EngineLoad

    pool = make_pool(REPLICAS, shards=4)
    assert pool.require_acquire_fields() == []
    assert pool.require_release_fields() == []
    where = {f"s{i}": pool.acquire_server(f"s{i}")[0] for i in range(16)}
    for rid, sid in where.items():
        pool.release_server(sid, rid)
    assert pool.get_status()["sticky_sessions"] == 16
    assert pool.end_session("s0", "s1", "nobody") == 2  # each on its shard, once
    bumped = pool.bump_weight_version()
    assert bumped["weight_version"] >= 1
    assert pool.get_status()["sticky_sessions"] == 14  # sticky sessions kept (sticky=False)
    cleared = pool.clear_sticky_cache()
    assert cleared["cleared_entries"] == 14
    assert set(cleared["server_loads"]) == set(REPLICAS)
    assert pool.get_status()["sticky_sessions"] == 0
    loads = {sid: EngineLoad(running=2, waiting=1) for sid in ("r0", "r3", "r6")}
    assert pool.report_engine_load(loads) == 3
    reported = pool.get_status()["replicas"]
    assert all(reported[sid].get("engine") for sid in loads)
    assert pool.reap() == 0  # no dead holder on any shard


def test_a_lease_from_the_context_manager_ends_on_its_shard(
    server: LocalServer, r: redis.Redis
) -> None:
    name = f"sp{next(_names)}"

    async def in_asyncio() -> str:
        async with AsyncShardedLoadBalancer(
            REPLICAS, shards=3, redis=server.url, name=name + "a"
        ) as pool:
            async with pool.lease("s") as held:
                assert await pool.get_total_inflight() == 1
                assert await pool.request_owner("s") == held.server_id
            # Read after the shard's posted release (a balancer's reads wait for its releases).
            assert await pool.get_total_inflight() == 0
            return str(held.server_id)

    with ShardedLoadBalancer(REPLICAS, shards=3, redis=server.url, name=name) as pool:
        with pool.lease("s") as held:
            assert pool.get_total_inflight() == 1
            assert pool.request_owner("s") == held.server_id
        assert pool.get_total_inflight() == 0
        assert check_shards(r, pool) == 0
    assert asyncio.run(in_asyncio()) in REPLICAS


def test_asyncio_new_sessions_of_one_loop_turn_share_a_directory_call(
    server: LocalServer, r: redis.Redis
) -> None:
    """64 new sessions acquired at once: their placements go to the directory together (the
    coalescer), and each session still gets its own shard and replica."""
    name = f"sp{next(_names)}"
    batches: list[int] = []

    async def main() -> list[str]:
        pool = AsyncShardedLoadBalancer(REPLICAS, shards=4, redis=server.url, name=name)
        send = pool._place_batch

        async def counted(keys: list[str]) -> list[int | BaseException]:
            batches.append(len(keys))
            return await send(keys)

        pool._placer = Coalescer(counted)
        try:
            got = await asyncio.gather(*(pool.acquire_server(f"s{i}") for i in range(64)))
            for i, (sid, _) in enumerate(got):
                await pool.release_server(sid, f"s{i}")
            return [sid for sid, _ in got]
        finally:
            await pool.close()

    where = asyncio.run(main())
    assert sum(batches) == 64
    assert len(batches) < 64, batches  # some placements shared a call
    per = collections.Counter(where)
    assert set(per) == set(REPLICAS)
    assert max(per.values()) - min(per.values()) <= 2, per  # placed as one after another
    check_directory(r, name, 4)


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_both_flavours_have_the_same_methods_and_the_tests_drive_each() -> None:
    """The two flavours are the same pool (every test above runs on both); each public method
    is called by a test of this module or of test_sharded_cluster and test_cli_sharded."""
    methods = _public(ShardedLoadBalancer)
    assert methods == _public(AsyncShardedLoadBalancer)
    here = Path(__file__).parent
    sources = "".join(
        (here / f).read_text()
        for f in ("test_sharded.py", "test_sharded_cluster.py", "test_cli_sharded.py")
    )
    head, _, tail = sources.partition("def test_both_flavours_have_the_same_methods")
    body = head + tail.partition("\n\n\n")[2]  # this test's own text left out
    missing = sorted(m for m in methods if f".{m}(" not in body)
    assert missing == []
