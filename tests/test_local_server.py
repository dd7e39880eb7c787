"""Private servers (redis_router.local_server, and the cluster and sentinel topologies of
tests/servers.py) against real server processes.

Every test starts its own servers on free ports; the machine's own Redis is
never touched. Tests are parametrized over every binary found, so a missing
binary shrinks the matrix instead of failing it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

import redis_router.local_server as ls
from redis_router.local_server import LocalServer

from .servers import LocalCluster, LocalSentinelGroup

BINARIES = ls.find_server_binaries()

if not BINARIES:
    pytest.skip("no redis-server / valkey-server binary found", allow_module_level=True)

ALL = [pytest.param(b, id=b.label) for b in BINARIES]
# Cluster: the first binary, plus a 6.2 one if present (no ADDSLOTSRANGE there).
_REDIS_62 = [b for b in BINARIES[1:] if b.kind == "redis" and b.version_tuple[:2] == (6, 2)]
_CLUSTER = [BINARIES[0], *_REDIS_62[:1]]
CLUSTER = [pytest.param(b, id=b.label) for b in _CLUSTER]


def _no_retry_client(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))


def _pid_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def server_factory() -> Iterator[Callable[..., Any]]:
    """Create LocalServers that are always closed, even if a test fails."""
    made: list[Any] = []

    def make(*args: Any, **kw: Any) -> Any:
        server = LocalServer(*args, **kw)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def test_discovery_is_deduplicated_and_labelled() -> None:
    reals = [os.path.realpath(b.path) for b in BINARIES]
    assert len(reals) == len(set(reals))
    for b in BINARIES:
        assert b.label == f"{b.kind}-{b.version}"
        assert b.kind in {"redis", "valkey"}
    assert ls.first_server_binary() == BINARIES[0]


def test_env_var_adds_binaries_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    last = BINARIES[-1]
    link = tmp_path / "server-link"
    link.symlink_to(last.path)
    monkeypatch.setenv(ls.ENV_SERVER_BIN, os.pathsep.join([str(tmp_path / "missing"), str(link)]))
    try:
        found = ls.find_server_binaries(refresh=True)
        assert found[0].path == str(link)
        assert (found[0].kind, found[0].version) == (last.kind, last.version)
        # The symlink and its target are one binary, listed once.
        assert len(found) == len(BINARIES)
    finally:
        monkeypatch.delenv(ls.ENV_SERVER_BIN)
        assert ls.find_server_binaries(refresh=True) == BINARIES


@pytest.mark.parametrize("server_bin", ALL)
def test_start_ping_version(server_bin, server_factory) -> None:
    server = server_factory(server_bin).start()
    client = server.client()
    assert client.ping() is True
    info = client.info("server")
    # Valkey keeps redis_version at 7.2.4 for compatibility; its own is valkey_version.
    assert info[f"{server_bin.kind}_version"] == server_bin.version
    assert info["tcp_port"] == server.port
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    assert redis.Redis.from_url(server.url).ping()
    assert os.path.isfile(server.log_path)
    client.close()


@pytest.mark.parametrize("server_bin", ALL)
def test_stop_kills_and_is_idempotent(server_bin, server_factory) -> None:
    server = server_factory(server_bin).start()
    pid = server.pid
    assert pid is not None
    server.stop()
    assert server.pid is None
    assert _pid_gone(pid)
    server.stop()  # idempotent
    server.kill()  # also a no-op now


@pytest.mark.parametrize("server_bin", ALL)
def test_kill_and_restart_same_port(server_bin, server_factory) -> None:
    server = server_factory(server_bin).start()
    port, pid = server.port, server.pid
    server.kill()
    assert _pid_gone(pid)
    with pytest.raises(redis.ConnectionError):
        _no_retry_client(port).ping()
    server.restart()
    assert server.port == port
    assert server.pid not in (None, pid)
    assert server.client().ping()


@pytest.mark.parametrize("server_bin", ALL)
def test_persistent_survives_crash(server_bin, server_factory) -> None:
    server = server_factory(server_bin, persistent=True).start()
    client = server.client()
    client.set("survivor", b"yes")
    client.close()
    server.kill()
    server.restart()
    assert server.client().get("survivor") == b"yes"


@pytest.mark.parametrize("server_bin", ALL)
def test_non_persistent_forgets_on_crash(server_bin, server_factory) -> None:
    server = server_factory(server_bin).start()
    server.client().set("ephemeral", b"1")
    server.kill()
    server.restart()
    assert server.client().get("ephemeral") is None


@pytest.mark.parametrize("server_bin", ALL)
def test_two_servers_get_different_ports(server_bin, server_factory) -> None:
    a = server_factory(server_bin).start()
    b = server_factory(server_bin).start()
    assert a.port != b.port
    assert a.dir != b.dir
    a.client().set("k", b"a")
    assert b.client().get("k") is None


def test_password_in_url_and_enforced(server_factory) -> None:
    server = server_factory(BINARIES[0], password="s3cret").start()
    assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
    assert redis.Redis.from_url(server.url).ping()
    with pytest.raises(redis.AuthenticationError):
        _no_retry_client(server.port).ping()


def test_fixed_port_and_context_manager_cleanup(server_factory) -> None:
    probe = server_factory(BINARIES[0]).start()
    port = probe.port
    probe.close()
    with LocalServer(BINARIES[0], port=port) as server:
        assert server.port == port
        directory, pid = server.dir, server.pid
        assert server.client().ping()
    assert _pid_gone(pid)
    assert not os.path.exists(directory)


def test_bad_option_raises_with_log(server_factory) -> None:
    server = server_factory(BINARIES[0], args=["--definitely-not-an-option", "1"])
    with pytest.raises(RuntimeError, match="definitely-not-an-option"):
        server.start(timeout=5)
    assert server.pid is None


def test_fixed_port_in_use_fails_fast(server_factory) -> None:
    first = server_factory(BINARIES[0]).start()
    clash = server_factory(BINARIES[0], port=first.port)
    with pytest.raises(RuntimeError, match="in use"):
        clash.start(timeout=5)


def test_atexit_kills_leftover_servers(tmp_path: Path) -> None:
    """A process that exits without stopping its server must not leak it."""
    b = BINARIES[0]
    script = textwrap.dedent(
        f"""
        import redis_router.local_server as mod
        server_bin = mod.ServerBinary({b.kind!r}, {b.version!r}, {b.path!r})
        s = mod.LocalServer(server_bin).start()
        print(s.pid, s.dir, flush=True)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    pid_text, directory = out.stdout.split()
    assert _pid_gone(int(pid_text))
    assert not os.path.exists(directory)


@pytest.mark.slow
@pytest.mark.parametrize("server_bin", CLUSTER)
def test_cluster_forms_and_serves(server_bin) -> None:
    with LocalCluster(server_bin, masters=3) as cluster:
        ports = [p for _, p in cluster.startup_nodes]
        assert len(set(ports)) == 3
        assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        for node in cluster.nodes:
            info = node.client().execute_command("CLUSTER", "INFO").decode()
            assert "cluster_state:ok" in info
        client = redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in cluster.startup_nodes]
        )
        keys = [f"key:{i}" for i in range(50)]
        slots = {client.keyslot(k) for k in keys}
        assert len({client.get_node_from_key(k).port for k in keys}) == 3
        assert len(slots) > 10
        for i, key in enumerate(keys):
            client.set(key, str(i))
        assert [client.get(k) for k in keys] == [str(i).encode() for i in range(50)]
        client.close()
        nodes = cluster.nodes
    assert all(n.pid is None for n in nodes)


@pytest.mark.slow
def test_sentinel_failover() -> None:
    binary = BINARIES[0]
    with LocalSentinelGroup(binary) as group:
        ports = [p for _, p in group.sentinel_addresses]
        assert group.url == (
            "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/mymaster"
        )
        sentinel = redis.sentinel.Sentinel(group.sentinel_addresses, socket_timeout=1)
        before = sentinel.discover_master("mymaster")
        assert before == ("127.0.0.1", group.master.port)
        old_master, old_replica = group.master, group.replica

        after = group.failover()

        assert after != before
        assert after == ("127.0.0.1", old_replica.port)
        assert sentinel.discover_master("mymaster") == after
        assert group.master is old_replica and group.replica is old_master
        master = sentinel.master_for("mymaster", socket_timeout=1)
        master.set("after-failover", b"1")
        assert master.get("after-failover") == b"1"
