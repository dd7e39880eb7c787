"""The command line and the exporter on a sharded pool: the pool as one and per shard, pool
commands on each replica's home shard, per-balancer commands told to name a shard."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from redis_router.cli.exporter import BalancerCollector
from redis_router.local_server import LocalServer
from redis_router.sharded import ShardedLoadBalancer

from . import invariants
from .test_cli import assert_one_line_error, run_cli
from .test_sharded import check_directory

REPLICAS = {f"r{i}": f"http://10.0.0.{i}:8000" for i in range(6)}


@pytest.fixture
def pool(server: LocalServer) -> Iterator[ShardedLoadBalancer]:
    lb = ShardedLoadBalancer(REPLICAS, shards=3, redis=server.url, name="fleet")
    yield lb
    lb.close()


def test_status_shows_the_pool_as_one_and_each_shard(
    pool: ShardedLoadBalancer, server: LocalServer
) -> None:
    leases = [pool.acquire(f"s{i}") for i in range(9)]
    proc = run_cli("--name", "fleet", "status", "--json", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["balancer"] == "fleet"
    assert sorted(snap["replicas"]) == sorted(REPLICAS)
    assert snap["totals"]["inflight"] == 9
    assert [s["name"] for s in snap["shards"]] == pool.shard_names
    assert sum(s["total_inflight"] for s in snap["shards"]) == 9
    assert sum(s["replicas"] for s in snap["shards"]) == 6  # the directory's count
    table = run_cli("--name", "fleet", "status", redis=server.url)
    assert table.returncode == 0, table.stderr
    for name in pool.shard_names:
        assert f"shard {name}: 2 replicas" in table.stdout
    for lease in leases:
        lease.release()


def test_servers_commands_act_on_each_replicas_home_shard(
    pool: ShardedLoadBalancer, server: LocalServer, r: redis.Redis
) -> None:
    added = run_cli(
        "--name",
        "fleet",
        "servers",
        "add",
        "new",
        "--meta",
        "http://10.0.0.9:8000",
        redis=server.url,
    )
    assert added.returncode == 0, added.stderr
    assert "added replica 'new' to balancer 'fleet'" in added.stdout
    assert "new" in pool.get_all_servers()
    check_directory(r, "fleet", 3)
    drained = run_cli("--name", "fleet", "servers", "drain", "new", "r0", redis=server.url)
    assert drained.returncode == 0, drained.stderr
    assert sorted(pool.get_status()["draining_servers"]) == ["new", "r0"]
    removed = run_cli("--name", "fleet", "servers", "remove", "new", redis=server.url)
    assert removed.returncode == 0, removed.stderr
    assert "new" not in pool.get_all_servers()
    assert not r.hexists(invariants.prefix("fleet") + "homes", "new")
    check_directory(r, "fleet", 3)
    unknown = run_cli("--name", "fleet", "servers", "remove", "ghost", redis=server.url)
    assert_one_line_error(unknown, "no replica 'ghost'", "nothing was changed")


def test_sessions_clear_and_reap_act_on_every_shard(
    pool: ShardedLoadBalancer, server: LocalServer
) -> None:
    for i in range(6):
        sid = pool.acquire_server(f"s{i}")[0]
        pool.release_server(sid, f"s{i}")
    assert pool.get_status()["sticky_sessions"] == 6
    cleared = run_cli("--name", "fleet", "sessions", "clear", redis=server.url)
    assert cleared.returncode == 0, cleared.stderr
    assert "cleared 6 sticky session(s)" in cleared.stdout
    assert pool.get_status()["sticky_sessions"] == 0
    reaped = run_cli("--name", "fleet", "reap", redis=server.url)
    assert reaped.returncode == 0, reaped.stderr
    assert "reclaimed 0 lease(s)" in reaped.stdout


def test_owner_and_bump_weight_version_act_on_the_pool(
    pool: ShardedLoadBalancer, server: LocalServer
) -> None:
    leases = [pool.acquire(f"s{i}") for i in range(6)]
    for lease in leases:
        proc = run_cli("--name", "fleet", "owner", lease.request_id, redis=server.url)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[0] == lease.server_id
    for lease in leases:
        lease.release()
    assert run_cli("--name", "fleet", "owner", "s0", redis=server.url).returncode == 1
    sticky = pool.get_status()["sticky_sessions"]
    bumped = run_cli("--name", "fleet", "bump-weight-version", "--sticky", redis=server.url)
    assert bumped.returncode == 0, bumped.stderr
    assert f"and {sticky} sticky session(s)" in bumped.stdout
    assert pool.get_status()["sticky_sessions"] == 0


def test_a_command_for_one_balancer_is_told_to_name_a_shard(
    pool: ShardedLoadBalancer, server: LocalServer
) -> None:
    proc = run_cli("--name", "fleet", "health", "--once", redis=server.url)
    assert_one_line_error(proc, "'fleet' is a sharded pool", f"--name {pool.shard_names[0]!r}")
    on_shard = run_cli("--name", pool.shard_names[0], "status", "--json", redis=server.url)
    assert on_shard.returncode == 0, on_shard.stderr
    assert len(json.loads(on_shard.stdout)["replicas"]) == 2


def test_the_exporter_shows_the_pool_and_its_shards(
    pool: ShardedLoadBalancer, server: LocalServer
) -> None:
    pytest.importorskip("prometheus_client")
    leases = [pool.acquire(f"s{i}") for i in range(4)]
    metrics = {m.name: m for m in BalancerCollector(server.url, "fleet").collect()}
    assert metrics["redis_router_replicas"].samples[0].value == 6
    inflight = sum(s.value for s in metrics["redis_router_inflight"].samples)
    assert inflight == 4
    per_shard = {s.labels["shard"]: s.value for s in metrics["redis_router_shard_inflight"].samples}
    assert set(per_shard) == set(pool.shard_names)
    assert sum(per_shard.values()) == 4
    for lease in leases:
        lease.release()
