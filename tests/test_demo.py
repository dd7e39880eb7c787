"""`redis-router demo`, tiny, as a subprocess: on a given server (and it cleans up after
itself), on a private server it starts and removes, and with --plot. Slow (worker processes),
so it runs on one binary only."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from redis_router import RedisLoadBalancer
from redis_router.local_server import LocalServer, first_server_binary

from .test_cli import CLI, env_without_redis_url

TINY = ["--replicas", "3", "--workers", "2", "--sessions", "4", "--turns", "2"]
FAST = ["--service", "0", "0.01", "--think", "0", "0.01"]


@pytest.fixture(scope="module")
def one_server() -> Iterator[LocalServer]:
    binary = first_server_binary()
    if binary is None:
        pytest.fail("no redis-server / valkey-server binary found")
    with LocalServer(binary) as srv:
        yield srv


def demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env if env is not None else env_without_redis_url(),
    )


def test_demo_on_a_given_server_reports_both_runs_and_deletes_its_keys(one_server):
    client = redis.Redis.from_url(one_server.url, decode_responses=True)
    bystander = RedisLoadBalancer({"x": None}, redis=one_server.url, name="bystander")
    before = {k: client.dump(k) for k in client.keys("*")}
    proc = demo("--redis", one_server.url, "demo", *TINY, *FAST, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [run["tie_break"] for run in report["runs"]] == ["random", "first"]
    for run in report["runs"]:
        assert list(run["sessions"]) == ["r0", "r1", "r2"]
        assert sum(run["sessions"].values()) == 4
        assert sum(run["requests"].values()) == 8
        assert run["sticky_hit_rate"] == 1.0  # later turns follow their session
        assert all(run["peak_inflight"][r] >= 1 for r, n in run["sessions"].items() if n)
    assert {k: client.dump(k) for k in client.keys("*")} == before  # its keys are gone
    bystander.close()
    client.close()


def test_old_tie_break_sends_every_sequential_session_to_the_first_replica(one_server):
    proc = demo(
        "--redis", one_server.url, "demo", *TINY, *FAST,
        "--workers", "1", "--tie-break", "first", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads(proc.stdout)["runs"]
    # One agent, so every new session meets an idle pool: a three-way tie that rank 0 wins.
    assert run["sessions"] == {"r0": 4, "r1": 0, "r2": 0}
    assert run["balance_sessions"] == 3.0
    assert run["idle_replicas"] == 2


def test_demo_without_a_server_starts_and_removes_its_own():
    proc = demo("demo", *TINY, *FAST)  # no --redis, no REDIS_URL
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"private \S+ on port (\d+) \(removed afterwards\)", proc.stdout)
    assert m, proc.stdout
    for heading in ("random tie-break (new)", "first candidate (old)", "sticky hit rate"):
        assert heading in proc.stdout
    assert re.search(r"^r0\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+\s+\d+$", proc.stdout, re.MULTILINE)
    gone = redis.Redis(port=int(m.group(1)), socket_connect_timeout=1)
    with pytest.raises(redis.ConnectionError):
        gone.ping()


def test_demo_plot_writes_a_png(one_server, tmp_path: Path):
    out = tmp_path / "demo.png"
    proc = demo("--redis", one_server.url, "demo", *TINY, *FAST, "--plot", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path):
    shadow = tmp_path / "matplotlib"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**env_without_redis_url(), "PYTHONPATH": str(tmp_path)}
    proc = demo("--redis", "redis://127.0.0.1:1/0", "demo", "--plot", "x.png", env=env)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "redis-router: error: --plot needs matplotlib: pip install matplotlib"
    ]


def test_demo_rejects_an_empty_range():
    proc = demo("--redis", "redis://127.0.0.1:1/0", "demo", "--service", "0.2", "0.1")
    assert proc.returncode != 0
    assert "--service MIN MAX" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
