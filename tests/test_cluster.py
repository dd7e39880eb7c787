"""Redis Cluster: a real 3-master cluster per server binary.

Every operation works through ``redis+cluster://`` URLs and ready ``RedisCluster`` clients,
sync and asyncio; all keys of one balancer live in the slot of its hash tag (I7), so one
balancer is one node's work, and balancers with different names spread over the nodes.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster
from redis.crc import key_slot

from redis_router import (
    AsyncRedisLoadBalancer,
    NoCapacity,
    NoServersAvailable,
    RedisLoadBalancer,
)
from redis_router.kv_events import BlockStored, KVIndex
from redis_router.local_server import find_server_binaries

from . import invariants
from .servers import LocalCluster

BINARIES = find_server_binaries()
_names = itertools.count()

pytestmark = pytest.mark.skipif(not BINARIES, reason="no server binary found")


@pytest.fixture(scope="module", params=BINARIES, ids=[b.label for b in BINARIES])
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    with LocalCluster(request.param, masters=3) as c:
        yield c


def _name() -> str:
    return f"c{next(_names)}"


def _node_clients(cluster: LocalCluster) -> list[redis.Redis]:
    return [n.client(decode_responses=True) for n in cluster.nodes]


def _keys_by_node(cluster: LocalCluster, name: str) -> list[list[str]]:
    """Every key of balancer `name`, per node, read the way redis-cli would."""
    out = []
    for c in _node_clients(cluster):
        out.append(sorted(c.scan_iter(match=f"rr:{{{name}}}:*", count=1000)))
        c.close()
    return out


def _owner(cluster: LocalCluster, name: str) -> redis.Redis:
    """A plain client on the node that serves balancer `name`'s slot."""
    slot = key_slot(invariants.prefix(name).encode())
    for node, (first, last) in zip(cluster.nodes, cluster.slot_ranges(), strict=True):
        if first <= slot <= last:
            return node.client(decode_responses=True)
    raise AssertionError(f"no node serves slot {slot}")


def test_every_operation_works_through_a_cluster_url(cluster: LocalCluster) -> None:
    name = _name()
    with RedisLoadBalancer(
        {"a": {"url": "http://a"}, "b": None}, redis=cluster.url, name=name
    ) as lb:
        assert lb.url == cluster.url
        sid, _ = lb.acquire_server("s1")
        assert sid in {"a", "b"}
        assert lb.acquire_server("s1")[0] == sid  # sticky (I3)
        routed = lb.acquire_many(["m1", "m2", "m3", "m4"])
        assert {s for s, _ in routed} == {"a", "b"}
        lease = lb.acquire("s2")
        assert lease.renew()
        assert lb.get_total_inflight() == 7
        assert lease.release() and lb.release_server(sid, "s1")
        assert lb.add_servers({"c": 1}) == 1
        assert lb.drain_servers(["c"]) == 1
        assert lb.get_status()["draining_servers"] == ["c"]
        assert lb.undrain_servers(["c"]) == 1
        assert lb.remove_servers(["c"]) == 1
        lb.clear_sticky_cache()
        assert lb.reap() == 0
        with _owner(cluster, name) as r:
            assert sum(invariants.check(r, name).values()) == lb.get_total_inflight() == 5
        assert lb.destroy() > 0
        assert _keys_by_node(cluster, name) == [[], [], []]
        with pytest.raises(NoServersAvailable):
            lb.acquire_server("after-destroy")


def test_capacity_ejection_and_waiting_work_through_a_cluster_url(
    cluster: LocalCluster,
) -> None:
    name = _name()
    with RedisLoadBalancer(
        {"a": {"capacity": 1}, "b": None}, redis=cluster.url, name=name, eject_after=1
    ) as lb:
        lb.drain_servers(["a"])
        lb.acquire("on-b").fail()  # b ejected for every worker
        lb.undrain_servers(["a"])
        assert lb.get_status()["ejected_servers"] == ["b"]
        held = lb.acquire("fills-a")
        with pytest.raises(NoCapacity):
            lb.acquire("refused")
        served: list[str] = []
        waiter = threading.Thread(target=lambda: served.append(lb.acquire_server("w", wait=10)[0]))
        waiter.start()
        time.sleep(0.3)  # queued, blocked in BLPOP on a key of the balancer's slot
        held.release()
        waiter.join(timeout=10)
        assert served == ["a"]
        assert lb.get_status()["waiting"]["served"] == 1
        with _owner(cluster, name) as r:
            invariants.check(r, name)
        assert lb.destroy() > 0
        assert _keys_by_node(cluster, name) == [[], [], []]


def test_all_keys_of_a_balancer_share_one_slot_on_one_node(cluster: LocalCluster) -> None:
    name = _name()
    # Server ids end up in key names (held:<id>): braces in them must not move the hash tag.
    odd = ["{x}", "a}b{c", "*:?", "ünï"]
    with RedisLoadBalancer(dict.fromkeys(odd), redis=cluster.url, name=name) as lb:
        for i in range(20):
            lb.acquire(f"req-{i}")
        lb.drain_servers([odd[0]])
        lb.acquire_server("req-0")  # sticky to a draining replica
        per_node = _keys_by_node(cluster, name)
        holders = [keys for keys in per_node if keys]
        assert len(holders) == 1, per_node
        keys = holders[0]
        assert {f"rr:{{{name}}}:held:{sid}" for sid in odd} <= set(keys)
        expected = key_slot(invariants.prefix(name).encode())
        with _node_clients(cluster)[0] as c:
            for key in keys:
                assert key_slot(key.encode()) == expected
                assert c.execute_command("CLUSTER", "KEYSLOT", key) == expected
        lb.destroy()


def test_balancers_with_different_names_spread_over_the_nodes(cluster: LocalCluster) -> None:
    names = [f"pool-{i}" for i in range(12)]
    slots = {key_slot(invariants.prefix(n).encode()) for n in names}
    assert len(slots) == len(names)
    lbs = [RedisLoadBalancer({"a": None}, redis=cluster.url, name=n) for n in names]
    try:
        for lb in lbs:
            lb.acquire_server("r")
        used = [
            i
            for i, node in enumerate(cluster.nodes)
            if any(_keys_by_node(cluster, n)[i] for n in names)
        ]
        assert used == [0, 1, 2], f"{len(names)} names landed on nodes {used}"
        print(f"\n{len(names)} balancer names on {len(slots)} slots over nodes {used}")
        for lb in lbs:
            assert lb.get_inflight_count("a") == 1
    finally:
        for lb in lbs:
            lb.destroy()
            lb.close()


def test_scripts_are_reloaded_after_script_flush_on_every_node(cluster: LocalCluster) -> None:
    name = _name()
    with RedisLoadBalancer({"a": None}, redis=cluster.url, name=name) as lb:
        lb.acquire_server("r1")
        for c in _node_clients(cluster):
            c.script_flush()
            c.close()
        assert lb.acquire_server("r2")[0] == "a"  # NOSCRIPT, SCRIPT LOAD, EVALSHA
        assert lb.get_inflight_count("a") == 2
        lb.destroy()


def test_kv_index_batches_are_pipelined_through_a_cluster(cluster: LocalCluster) -> None:
    """The KV-events subscriber sends several batches in one pipeline: a cluster pipeline
    takes them (by EVALSHA, which redis-py's cluster pipeline refuses as a method), and
    reloads the script after a SCRIPT FLUSH."""
    name = _name()
    meta = {"r0": {"kv_events": "tcp://127.0.0.1:1"}}
    RedisLoadBalancer(meta, redis=cluster.url, name=name).close()
    client = cluster.client()
    index = KVIndex(client, name)
    toks = list(range(8))
    first = ("r0", 0, 1, 0, 1.0, [BlockStored([1, 2], None, toks, 4)])
    got = index.apply_many([first, first, ("r0", 0, 1, 3, 1.3, [])])
    assert [(a.outcome, a.stored, a.need) for a in got] == [
        ("ok", 2, -1),
        ("dup", 0, -1),
        ("need", 0, 1),
    ]
    for c in _node_clients(cluster):
        c.script_flush()
        c.close()
    assert [a.outcome for a in index.apply_many([("r0", 0, 1, 1, 1.1, [])])] == ["ok"]
    owner = _owner(cluster, name)
    assert owner.hlen(f"rr:{{{name}}}:kv:idx") == 2
    owner.close()
    client.close()


def test_a_ready_cluster_client_is_accepted_and_left_open(cluster: LocalCluster) -> None:
    client = cluster.client(decode_responses=True)
    name = _name()
    with RedisLoadBalancer({"a": None}, redis=client, name=name) as lb:
        assert lb.url.startswith("redis+cluster://127.0.0.1:")
        assert lb.acquire("r").release()
        lb.destroy()
    assert client.ping()  # the caller's client stays open
    client.close()


def test_async_balancer_on_a_cluster(cluster: LocalCluster) -> None:
    name = _name()

    async def main() -> None:
        async with AsyncRedisLoadBalancer(
            {"a": None, "b": None}, redis=cluster.url, name=name
        ) as lb:
            leases = await asyncio.gather(*(lb.acquire(f"r{i}") for i in range(10)))
            assert sorted(await lb.get_all_servers()) == ["a", "b"]
            assert await lb.get_total_inflight() == 10
            counts = (await lb.get_status())["servers"]
            assert counts == {"a": 5, "b": 5}  # least loaded, one at a time (I4)
            for lease in leases:
                assert await lease.release()
            assert await lb.reap() == 0
            await lb.destroy()
        nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in cluster.startup_nodes]
        ready = redis.asyncio.cluster.RedisCluster(startup_nodes=nodes)
        async with AsyncRedisLoadBalancer({"a": None}, redis=ready, name=name) as lb:
            assert (await lb.acquire_server("x"))[0] == "a"
            await lb.destroy()
        await ready.aclose()

    asyncio.run(main())
    assert _keys_by_node(cluster, name) == [[], [], []]
