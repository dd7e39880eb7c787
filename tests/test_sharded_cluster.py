"""The sharded pool on a real Redis Cluster: 3 primaries with one replica each, per binary.

Each shard is a balancer of its own hash tag, so one slot, and the pool names its shards so
that shard i's slot lies on primary i mod 3: the shards spread over the primaries. The
directory (keys under the pool's own name) is one more slot, on whichever primary owns it.
When one primary dies, only what lives in its slot stops until its replica takes over; the
other shards keep routing the sessions this process already placed (a known session's turn
touches only its shard, never the directory).

The cluster runs with ``cluster-require-full-coverage no``: with Redis' default every node
answers CLUSTERDOWN from the moment a primary is flagged failing until its replica takes
over (about a second here), so every shard stalls in that window, whatever the pool does
(redis-py's and the pool's resends usually carry a call over it, late).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis
from redis.crc import key_slot

from redis_router.aio_sharded import AsyncShardedLoadBalancer
from redis_router.errors import RedisUnavailable
from redis_router.local_server import ServerBinary, find_server_binaries
from redis_router.sharded import ShardedLoadBalancer
from redis_router.shards import cluster_primaries, shard_names, slot_of

from . import invariants
from .servers import LocalCluster

BINARIES = find_server_binaries()
_names = itertools.count()

pytestmark = pytest.mark.skipif(not BINARIES, reason="no server binary found")

K = 3
REPLICAS = {f"r{i}": None for i in range(6)}


@pytest.fixture(params=BINARIES, ids=[b.label for b in BINARIES])
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A fresh 3 x 1 cluster per test: the failover test leaves its own changed."""
    binary: ServerBinary = request.param
    with LocalCluster(binary, masters=3, replicas=1, require_full_coverage=False) as c:
        yield c


def _shard_names(cluster: LocalCluster, name: str) -> list[str]:
    """The shard names a new pool ``name`` picks on this cluster (as the pool computes them)."""
    client = cluster.client()
    try:
        return shard_names(name, K, cluster_primaries(client.cluster_slots()))
    finally:
        client.close()


def _owner(cluster: LocalCluster, balancer: str) -> redis.Redis:
    """A plain client on the primary serving balancer ``balancer``'s slot now."""
    node = cluster.node_for_slot(slot_of(balancer))
    return node.client(decode_responses=True)


def _keys_by_primary(cluster: LocalCluster, balancer: str) -> dict[int, list[str]]:
    """Every key of balancer ``balancer`` on each running primary (by port)."""
    out = {}
    for node in cluster.primaries():
        with node.client(decode_responses=True) as c:
            out[node.port] = sorted(c.scan_iter(match=f"rr:{{{balancer}}}:*", count=1000))
    return out


def _check_shards(cluster: LocalCluster, lb: ShardedLoadBalancer) -> dict[str, dict[str, int]]:
    """The invariant check (counts == live leases, ...) on every shard, read on the primary
    serving its slot; each shard's counts."""
    out = {}
    for name in lb.shard_names:
        with _owner(cluster, name) as r:
            out[name] = invariants.check(r, name)
    return out


def test_shards_spread_over_the_primaries_and_route(cluster: LocalCluster) -> None:
    name = f"sc{next(_names)}"
    primaries = cluster.primaries()
    assert len(primaries) == 3
    with ShardedLoadBalancer(REPLICAS, shards=K, redis=cluster.url, name=name) as lb:
        # The shard names' slots fall on three different primaries, shard i on primary i
        # (primaries ordered by address: here all on 127.0.0.1, so by port).
        assert lb.shard_names == _shard_names(cluster, name)
        with primaries[0].client() as c:
            for shard in lb.shard_names:
                assert c.execute_command("CLUSTER", "KEYSLOT", f"rr:{{{shard}}}:x") == (
                    key_slot(invariants.prefix(shard).encode())
                )
        owners = [cluster.node_for_slot(slot_of(s)) for s in lb.shard_names]
        assert [n.port for n in owners] == [n.port for n in primaries]

        leases = [lb.acquire(f"s{i}") for i in range(30)]
        placed = {lease.request_id: lease.server_id for lease in leases}
        # Held together, the 30 spread over the shards (fewest requests per replica) and,
        # inside each, over its two replicas (least loaded): every replica gets some.
        assert set(placed.values()) == set(REPLICAS)
        status = lb.get_status()
        assert [s["name"] for s in status["shards"]] == lb.shard_names
        assert [s["servers"] for s in status["shards"]] == [2, 2, 2]
        assert all(s["total_inflight"] > 0 for s in status["shards"])
        assert status["total_inflight"] == 30

        # Every key of a shard (and of the directory) lives on the one primary of its slot.
        for balancer, owner in [*zip(lb.shard_names, owners, strict=True), (name, None)]:
            per = _keys_by_primary(cluster, balancer)
            holders = [port for port, keys in per.items() if keys]
            assert len(holders) == 1, (balancer, per)
            if owner is not None:
                assert holders == [owner.port]
        directory = _keys_by_primary(cluster, name)[cluster.node_for_slot(slot_of(name)).port]
        kinds = {key[len(invariants.prefix(name)) :].split(":")[0] for key in directory}
        assert kinds >= {"layout", "homes", "shards", "placed"}, directory

        counts = _check_shards(cluster, lb)
        assert sum(sum(c.values()) for c in counts.values()) == 30
        for lease in leases:
            assert lease.release()

        # Sticky across processes: another pool object on the same name (it remembers no
        # session) finds each session's shard in the directory and its replica there.
        with ShardedLoadBalancer(shards=K, redis=cluster.url, name=name) as other:
            assert other.shard_names == lb.shard_names
            for rid, sid in placed.items():
                got, _ = other.acquire_server(rid)
                assert got == sid, rid
                assert other.release_server(got, rid)
            counts = _check_shards(cluster, lb)
            assert all(n == 0 for c in counts.values() for n in c.values()), counts
            assert other.get_total_inflight() == 0
        assert lb.get_total_inflight() == 0
        assert lb.destroy() > 0
    for balancer in [*lb.shard_names, name]:
        left = _keys_by_primary(cluster, balancer)
        assert all(not keys for keys in left.values()), (balancer, left)


def test_the_asyncio_pool_places_its_shards_and_routes_the_same(cluster: LocalCluster) -> None:
    name = f"sa{next(_names)}"

    async def main() -> tuple[list[str], dict[str, str], dict[str, str]]:
        pool = AsyncShardedLoadBalancer(REPLICAS, shards=K, redis=cluster.url, name=name)
        try:
            leases = [await pool.acquire(f"s{i}") for i in range(30)]
            placed = {lease.request_id: lease.server_id for lease in leases}
            for lease in leases:
                assert await lease.release()
            with ShardedLoadBalancer(shards=K, redis=cluster.url, name=name) as other:
                again = {rid: other.acquire_server(rid)[0] for rid in placed}
                for rid, sid in again.items():
                    other.release_server(sid, rid)
            names = pool.shard_names
            assert await pool.get_total_inflight() == 0
            await pool.destroy()
            return names, placed, again
        finally:
            await pool.close()

    names, placed, again = asyncio.run(main())
    assert names == _shard_names(cluster, name)
    owners = [cluster.node_for_slot(slot_of(s)).port for s in names]
    assert sorted(owners) == sorted(n.port for n in cluster.primaries())
    assert set(placed.values()) == set(REPLICAS)
    assert again == placed  # the sync pool, another process's view, finds every session


@dataclass
class _Tally:
    """What the workers saw: successful acquire+release pairs and errors, timestamped,
    per shard."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: dict[int, list[float]] = field(default_factory=dict)
    errors: dict[int, list[tuple[float, str]]] = field(default_factory=dict)

    def done(self, shard: int, started: float) -> None:
        with self.lock:
            self.ok.setdefault(shard, []).append(started)

    def failed(self, shard: int, at: float, exc: BaseException) -> None:
        with self.lock:
            self.errors.setdefault(shard, []).append((at, f"{type(exc).__name__}: {exc}"))

    def ok_between(self, shards: set[int], lo: float, hi: float) -> int:
        with self.lock:
            return sum(1 for s in shards for t in self.ok.get(s, ()) if lo <= t <= hi)


def _pick_name(cluster: LocalCluster) -> str:
    """A pool name whose directory slot is NOT on the primary of its shard 0.

    The directory places new sessions; while its own primary fails over, no new session can
    be placed (and a process whose memory of a session went stale could not look it up). A
    session this process already placed is routed by its shard alone, so killing shard 0's
    primary tells whether the other shards keep routing only if the directory is elsewhere.
    """
    for i in itertools.count():
        name = f"fo{next(_names)}"
        shard0 = _shard_names(cluster, name)[0]
        if cluster.node_for_slot(slot_of(name)) is not cluster.node_for_slot(slot_of(shard0)):
            return name
        assert i < 100, "no pool name puts the directory off shard 0's primary"
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_other_shards_keep_routing_while_one_shards_primary_fails_over(
    cluster: LocalCluster,
) -> None:
    name = _pick_name(cluster)
    lb = ShardedLoadBalancer(REPLICAS, shards=K, redis=cluster.url, name=name)
    try:
        _failover_under_load(cluster, lb, name)
    finally:
        lb.close()


def _failover_under_load(cluster: LocalCluster, lb: ShardedLoadBalancer, name: str) -> None:
    victim = cluster.node_for_slot(slot_of(lb.shard_names[0]))
    directory = cluster.node_for_slot(slot_of(name))
    assert victim is not directory
    assert {cluster.node_for_slot(slot_of(s)).port for s in lb.shard_names[1:]} == (
        {n.port for n in cluster.primaries()} - {victim.port}
    )

    # Place sessions up front (held together, so spread over every shard); a session's shard
    # is its replica's home (the shard that has it).
    home = {sid: i for i, b in enumerate(lb._shards) for sid in b.get_all_servers()}
    assert sorted(home) == sorted(REPLICAS)
    leases = [lb.acquire(f"s{i}") for i in range(60)]
    shard_of = {lease.request_id: home[lease.server_id] for lease in leases}
    for lease in leases:
        assert lease.release()
    by_shard: dict[int, list[str]] = {}
    for rid, shard in shard_of.items():
        by_shard.setdefault(shard, []).append(rid)
    assert sorted(by_shard) == [0, 1, 2], by_shard

    tally = _Tally()
    stop = threading.Event()

    def work(sessions: list[str]) -> None:
        for rid in itertools.cycle(sessions):
            if stop.is_set():
                return
            shard = shard_of[rid]
            started = time.monotonic()
            try:
                lease = lb.acquire(rid)
                try:
                    assert lease.release(), f"{rid}: its lease was gone at release"
                finally:
                    lease.release()  # a no-op once released; never leave one behind
            except Exception as exc:  # every failure is tallied, per shard
                tally.failed(shard, time.monotonic(), exc)
                time.sleep(0.05)
                continue
            tally.done(shard, started)
            time.sleep(0.002)

    # Two workers on the surviving shards' sessions, one on shard 0's.
    survivors = [rid for s in (1, 2) for rid in by_shard[s]]
    groups = [survivors[0::2], survivors[1::2], by_shard[0]]
    threads = [threading.Thread(target=work, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while not (tally.ok.get(0) and tally.ok.get(1) and tally.ok.get(2)):
            assert time.monotonic() < deadline, "the workers never routed on every shard"
            time.sleep(0.05)

        held = lb.acquire(by_shard[0][-1])  # released while its primary is down
        assert victim.pid is not None
        dead = cluster.kill_primary(victim.pid)
        killed_at = time.monotonic()
        try:
            ended_in_outage = held.release().result()
        except RedisUnavailable:  # the release raised: the lease may be released again
            ended_in_outage = None
        promoted = cluster.wait_for_failover(dead, timeout=30)
        promoted_at = time.monotonic()
        if ended_in_outage is None:
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert held.release().result() is True
                    break
                except RedisUnavailable:
                    assert time.monotonic() < deadline, "the lease could not be released"
                    time.sleep(0.1)
        else:  # redis-py's retries reached the promoted replica in time
            assert ended_in_outage is True
        assert held.release().result() is False  # ended exactly once
        assert cluster.node_for_slot(slot_of(lb.shard_names[0])) is promoted

        # Shard 0 routes again once its replica took over (a bounded retry: redis-py finds
        # the new primary after a refused connection or a MOVED).
        rid0 = by_shard[0][0]
        deadline = time.monotonic() + 20
        while True:
            try:
                lb.acquire(rid0).release()
                break
            except Exception:
                assert time.monotonic() < deadline, "shard 0 did not route after its failover"
                time.sleep(0.1)
        deadline = time.monotonic() + 20
        while tally.ok_between({0}, promoted_at, time.monotonic()) == 0:
            assert time.monotonic() < deadline, "shard 0's worker did not route again"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)

    window = tally.ok_between({1, 2}, killed_at, promoted_at)
    print(
        f"\nfailover of {victim.port} -> {promoted.port} in {promoted_at - killed_at:.1f}s; "
        f"shards 1, 2 routed {window} sessions meanwhile; shard 0 errors: "
        f"{len(tally.errors.get(0, []))}"
    )
    assert window > 0
    assert not tally.errors.get(1) and not tally.errors.get(2), (
        tally.errors.get(1, [])[:3],
        tally.errors.get(2, [])[:3],
    )

    # Every worker is done: a lease still held for a session now is one whose call failed on
    # shard 0 around the kill. Mostly a release that raised RedisUnavailable while the primary
    # was down: the Lease counts as released (a second release() writes nothing), so the
    # lease stays, kept alive by this process's heartbeats; rarer, an acquire granted whose
    # reply was lost, or a release the dead primary acknowledged but never replicated.
    # release_server() ends those.
    orphans = 0
    for rid in shard_of:
        for _ in range(5):
            owner = lb.request_owner(rid)
            if owner is None:
                break
            assert shard_of[rid] == 0, f"{rid} on surviving shard {shard_of[rid]} leaked"
            lb.release_server(owner, rid)
            orphans += 1
        assert lb.request_owner(rid) is None, rid
    print(f"orphaned leases on shard 0 released after the failover: {orphans}")

    counts = _check_shards(cluster, lb)
    assert all(n == 0 for c in counts.values() for n in c.values()), counts
    assert lb.get_total_inflight() == 0
    assert lb.get_status()["total_inflight"] == 0
