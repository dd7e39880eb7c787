"""`redis-router exporter`, started as a subprocess and scraped over HTTP like Prometheus."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from redis_router import NoCapacity
from redis_router.local_server import LocalServer, first_server_binary

from . import invariants
from .test_cli import CLI, env_without_redis_url, popen_cli, watchdog

LOCAL_FREE_PORT = ["--port", "0", "--addr", "127.0.0.1"]
SERVERS = {f"s{i}": None for i in range(3)}
Samples = dict[tuple[str, str], float]  # (metric sample name, replica) -> value


@dataclass
class Exporter:
    proc: subprocess.Popen
    url: str = ""
    stderr: str = ""  # once stopped


@contextmanager
def exporter(
    redis_url: str, name: str, stop: signal.Signals = signal.SIGTERM
) -> Iterator[Exporter]:
    """Run the exporter on a free port until the block ends, then stop it with ``stop``."""
    proc = popen_cli("--redis", redis_url, "--name", name, "exporter", *LOCAL_FREE_PORT)
    timer = watchdog(proc)
    running = Exporter(proc)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"on (http://127\.0\.0\.1:\d+/metrics)$", line.strip())
        assert m, line
        running.url = m.group(1)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(stop)
        running.stderr = proc.communicate(timeout=30)[1]
        timer.cancel()


def scrape(metrics_url: str) -> Samples:
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, s.labels.get("replica", ""))] = s.value
    return out


def test_scrape_shows_each_replica_as_the_library_sees_it(server, make_lb):
    lb = make_lb(SERVERS)
    crashed = make_lb(name=lb.name, lease_ttl=0.5)  # a worker that dies holding leases
    for i in range(4):
        crashed.acquire(f"dead-{i}")
    invariants.silence(crashed)
    invariants.listen(lb, 0.7)  # other workers are heard meanwhile: it is dead
    assert lb.reap() == 4
    for i in range(5):
        lb.acquire_server(f"chat-{i}")
    lb.acquire_server("chat-0")  # sticky hit
    lb.drain_servers(["s2"])
    status = lb.get_status()["replicas"]
    with exporter(server.url, lb.name) as running:
        url = running.url
        got = scrape(url)
        assert got[("redis_router_up", "")] == 1
        assert got[("redis_router_replicas", "")] == 3
        for sid, r in status.items():
            assert got[("redis_router_inflight", sid)] == r["inflight"]
            assert got[("redis_router_draining", sid)] == int(r["draining"])
            assert got[("redis_router_live_leases", sid)] == r["live_leases"]
            assert got[("redis_router_sticky_sessions", sid)] == r["sticky_sessions"]
            assert got[("redis_router_acquires_total", sid)] == r["acquires"]
            assert got[("redis_router_sticky_hits_total", sid)] == r["sticky_hits"]
            assert got[("redis_router_reclaimed_leases_total", sid)] == r["reclaimed"]
        assert got[("redis_router_draining", "s2")] == 1
        assert sum(got[("redis_router_reclaimed_leases_total", s)] for s in SERVERS) == 4
        assert sum(got[("redis_router_sticky_hits_total", s)] for s in SERVERS) == 1

        # each scrape reads Redis afresh
        for sid in SERVERS:
            while lb.get_inflight_count(sid):
                lb.release_server(sid)
        again = scrape(url)
        assert all(again[("redis_router_inflight", s)] == 0 for s in SERVERS)
        assert again[("redis_router_acquires_total", "s0")] == status["s0"]["acquires"]
    assert running.proc.returncode == 0
    assert "Traceback" not in running.stderr


def test_scrape_shows_capacity_ejections_and_waiting(server, make_lb):
    lb = make_lb({"s0": {"capacity": 1}, "s1": None}, eject_after=1)
    lb.drain_servers(["s0"])
    lb.acquire("on-s1").fail()  # s1 ejected (1 of 2: within the share)
    lb.undrain_servers(["s0"])
    held = lb.acquire("fills-s0")
    assert held.server_id == "s0"
    with pytest.raises(NoCapacity):
        lb.acquire("waits", wait=0.2)
    with exporter(server.url, lb.name) as running:
        got = scrape(running.url)
    assert got[("redis_router_capacity", "s0")] == 1 and ("redis_router_capacity", "s1") not in got
    assert got[("redis_router_ejected", "s1")] == 1
    assert 0 < got[("redis_router_ejected_seconds_left", "s1")] <= 30
    assert got[("redis_router_failures_total", "s1")] == 1
    assert got[("redis_router_waiting", "")] == 0
    assert got[("redis_router_max_wait_seconds", "")] == 0
    assert running.proc.returncode == 0


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_exporter_stops_cleanly_on_ctrl_c_and_on_sigterm(server, make_lb, stop):
    lb = make_lb(SERVERS)
    with exporter(server.url, lb.name, stop=stop) as running:
        assert scrape(running.url)[("redis_router_up", "")] == 1
    assert running.proc.returncode == 0
    assert "Traceback" not in running.stderr


def test_exporter_waits_for_a_balancer_that_does_not_exist_yet(server, make_lb, r):
    with exporter(server.url, "later") as running:
        url = running.url
        got = scrape(url)
        assert got[("redis_router_up", "")] == 1 and got[("redis_router_replicas", "")] == 0
        assert not any(name == "redis_router_inflight" for name, _ in got)
        assert r.keys("rr:{later}*") == []  # scraping created nothing
        make_lb({"a": None}, name="later").acquire_server("x")
        assert scrape(url)[("redis_router_inflight", "a")] == 1


def test_redis_outage_is_up_0_not_a_failed_scrape():
    with LocalServer(first_server_binary()) as srv:
        make = subprocess.run(
            [*CLI, "--redis", srv.url, "servers", "add", "a"], capture_output=True, timeout=60
        )
        assert make.returncode == 0
        with exporter(srv.url, "default") as running:
            assert scrape(running.url)[("redis_router_up", "")] == 1
            srv.kill()
            assert scrape(running.url)[("redis_router_up", "")] == 0
            assert running.proc.poll() is None  # still serving
        assert running.proc.returncode == 0
        assert "cannot reach Redis" in running.stderr


def test_exporter_without_prometheus_client_names_the_extra(tmp_path: Path):
    shadow = tmp_path / "prometheus_client"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    proc = subprocess.run(
        [*CLI, "--redis", "redis://127.0.0.1:1/0", "exporter"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env_without_redis_url(), "PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "redis-router: error: the exporter needs prometheus_client (the metrics extra): "
        "pip install prometheus_client"
    ]


def test_a_port_it_cannot_bind_is_one_line(server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = subprocess.run(
            [*CLI, "--redis", server.url, "exporter", "--port", port, "--addr", "127.0.0.1"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env_without_redis_url(),
        )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"redis-router: error: cannot listen on 127.0.0.1:{port}: ")


def test_an_invalid_port_is_one_line():
    proc = subprocess.run(
        [*CLI, "--redis", "redis://127.0.0.1:1/0", "exporter", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without_redis_url(),
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "redis-router: error: --port must be between 0 and 65535, got 70000"
    ]
