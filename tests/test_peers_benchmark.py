"""The peers benchmark runs (``python -m benchmarks.peers --quick``) and every row it prints
carries finite numbers; the fake replicas count what the measures read from them.

Structure and invariants only: no timing or hit rate is compared with a target (timings on a
shared machine prove nothing in a test); ``python -m benchmarks.peers`` prints the rows.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import peers, peers_fronts, peers_gateways
from benchmarks.peers_http import BLOCK, AsyncClient, FakeReplicas, completion_body
from redis_router.local_server import first_server_binary

ROOT = Path(__file__).resolve().parent.parent
MEASURES = {
    "latency",
    "throughput_0ms",
    "throughput_20ms",
    "balance",
    "balance_sparse",
    "balance_sessions",
    "prefix_multiturn",
    "prefix_grpo",
    "cpu",
}

pytestmark = pytest.mark.skipif(first_server_binary() is None, reason="no server binary")


def _run(tmp_path: Path, *args: str, timeout: float) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "peers.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--quick", "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def _check_printed_rows(stdout: str, data: dict[str, Any]) -> None:
    """Every row has finite numbers, in the JSON and in the text table (no '-' cell)."""
    assert {r["measure"] for r in data["rows"]} == MEASURES
    lines = stdout.splitlines()
    for row in data["rows"]:
        assert row["values"], row
        for key, value in row["values"].items():
            assert value is not None and math.isfinite(value), (row["contender"], key, row["note"])
        printed = [x for x in lines if x.startswith(row["contender"] + "  ")]
        assert printed, row["contender"]
        for line in printed:
            cells = line[len(row["contender"]) :].split()
            assert "-" not in cells, line
    for row in data["rows"]:
        v = row["values"]
        if row["measure"].startswith("balance"):
            assert v["max_over_mean"] >= 1.0 and v["req_per_s"] > 0
        elif row["measure"].startswith("prefix"):
            assert 0.0 <= v["hit_rate_pct"] <= 100.0
        elif row["measure"].startswith("throughput"):
            assert v["req_per_s"] > 0 and v["ratio_to_direct"] > 0
        elif row["measure"] == "cpu":
            assert {"cpu_us", "client_us", "redis_us"} <= set(v)
            if row["contender"].startswith("redis-router"):
                assert v["redis_us"] > 0  # its scripts ran on Redis
            if "gateway_us" in v:
                assert v["gateway_us"] > 0  # the gateway's process proxied the requests
        else:
            assert v["p50_us"] > 0 and v["p99_us"] >= v["p50_us"]


def _by(data: dict[str, Any], measure: str) -> dict[str, dict[str, float]]:
    return {r["contender"]: r["values"] for r in data["rows"] if r["measure"] == measure}


SERVE_PREFIX = [f.label for f in peers_fronts.FRONTS if "grpo" in f.measures]
ORACLE = peers_fronts.ORACLE


@pytest.mark.slow
def test_quick_run_prints_finite_redis_router_rows(tmp_path: Path) -> None:
    """redis-router's rows (the library, and `redis-router serve` instances as processes of
    their own), the oracle and the references, on the fake replicas (gateways off: their env
    takes minutes to install; the next test runs them where it exists)."""
    stdout, data = _run(tmp_path, "--no-gateways", timeout=240)
    _check_printed_rows(stdout, data)
    meta = data["meta"]
    assert meta["repetitions"] == 1 and meta["replicas"] == 8 and meta["quick"]
    assert meta["versions"]["redis-router"] and meta["versions"]["server"]
    for measure, contender in [
        ("latency", "redis-router sync"),
        ("latency", "redis-router asyncio"),
        ("latency", "redis-router asyncio, release awaited"),
        ("latency", peers.LAT_PING),
        ("latency", peers.LAT_PING_ASYNC),
        ("latency", peers.LAT_BARE),
        ("latency", peers.LAT_BARE_NOOP),
        ("latency", peers.LAT_BARE_ASYNC),
        ("latency", peers.LAT_BARE_NOOP_ASYNC),
        ("throughput_0ms", "redis-router asyncio"),
        ("throughput_20ms", "redis-router asyncio"),
        ("balance", "redis-router, 4 processes on one Redis"),
        ("balance_sparse", "redis-router, 4 processes on one Redis"),
        ("balance_sessions", "redis-router, 4 processes on one Redis, defaults"),
        ("balance_sessions", "redis-router, spread_sessions, each session ended (end_session)"),
        ("cpu", "redis-router sync"),
        ("cpu", "redis-router asyncio"),
        ("prefix_grpo", "redis-router prefix_cache, shipped defaults"),
        ("prefix_grpo", "redis-router prefix_cache, abs 64 / rel 1.5"),
        ("latency", peers_fronts.SERVE),
        ("latency", f"{peers_fronts.SERVE}, asyncio client"),
        ("latency", ORACLE),
        ("latency", f"{ORACLE}, asyncio client"),
        ("latency", peers_fronts.ORACLE_PING),
        ("throughput_0ms", peers_fronts.ORACLE_PING),
        ("throughput_0ms", peers_fronts.SERVE),
        ("throughput_0ms", ORACLE),
        ("throughput_20ms", peers_fronts.SERVE),
        ("throughput_20ms", ORACLE),
        ("balance", f"{peers_fronts.SERVE}, one per process"),
        ("balance_sparse", f"{peers_fronts.SERVE}, one per process"),
        *(("prefix_grpo", f"{label}, one per process") for label in SERVE_PREFIX),
        *(("prefix_multiturn", f"{label}, 1 instance") for label in SERVE_PREFIX),
    ]:
        assert contender in _by(data, measure), (measure, contender)
    # The oracle routes nothing: it takes part in latency and throughput only.
    assert not any(ORACLE in r["contender"] for r in data["rows"] if r["measure"] == "balance")
    # A session is sticky through any of the 4 instances (balancer objects, or serve
    # processes reached with its id in X-Session-ID): every turn lands on its first replica,
    # so the hit rate is the one of sessions pinned by hand (same prompt lengths).
    mt = _by(data, "prefix_multiturn")
    ceiling = mt["each session pinned to one replica (ceiling)"]["hit_rate_pct"]
    roaming = [v["hit_rate_pct"] for k, v in mt.items() if "4 instances" in k]
    assert len(roaming) == 2 + len(SERVE_PREFIX) and ceiling > 0
    for rate in roaming:
        assert rate == pytest.approx(ceiling, abs=0.5)
    assert _by(data, "prefix_grpo")["ceiling (each group's first sample misses)"][
        "hit_rate_pct"
    ] == pytest.approx(87.5)


@pytest.mark.slow
def test_quick_run_prints_finite_gateway_rows(tmp_path: Path) -> None:
    """The same with the three gateways, four instances each, from the benchmark's own env."""
    versions = peers_gateways.installed()
    missing = {d: v for d, v in versions.items() if v.startswith("not installed")}
    if missing:
        pytest.skip(
            f"gateway env {peers_gateways.ENV_DIR} not installed ({', '.join(missing)}): "
            "`python -m benchmarks.peers` installs it from the registry; the gateways' rows "
            "are not run here"
        )
    stdout, data = _run(tmp_path, "--no-install", timeout=600)
    _check_printed_rows(stdout, data)
    for spec in peers_gateways.SPECS:
        assert data["meta"]["versions"][spec.dist] == versions[spec.dist]
        assert spec.label in _by(data, "latency")
        assert f"{spec.label}, one per process" in _by(data, "balance")
        assert f"{spec.label}, 1 instance" in _by(data, "prefix_multiturn")


def test_fake_replica_counts_prefix_hits_and_in_flight() -> None:
    """A prompt sent twice is cached the second time up to its last full block; a prompt that
    shares only its first block hits that block; in-flight time accumulates while a request
    is served (20 ms each, 4 at once)."""
    port = peers_gateways.free_port()
    replicas = FakeReplicas([port])
    try:
        tokens = [f"t{i}" for i in range(3 * BLOCK + 5)]
        other = tokens[:BLOCK] + [f"u{i}" for i in range(2 * BLOCK)]

        async def send() -> None:
            client = AsyncClient()
            url = replicas.urls[0]
            for prompt in (tokens, tokens):
                await client.post(url, "/v1/completions", completion_body(" ".join(prompt)))
            chat = {"model": "m", "messages": [{"role": "user", "content": " ".join(other)}]}
            out = await client.post(url, "/v1/chat/completions", json.dumps(chat).encode())
            assert json.loads(out)["choices"][0]["message"]["role"] == "assistant"
            replicas.configure(service_ms=20)
            await asyncio.gather(
                *(client.post(url, "/v1/completions", completion_body("x")) for _ in range(4))
            )
            await client.close()

        replicas.reset()
        asyncio.run(send())
        stats = replicas.stats()[0]
        assert stats["requests"] == 7
        assert stats["prompt_tokens"] == 2 * len(tokens) + len(other) + 4
        assert stats["cached_tokens"] == 3 * BLOCK + BLOCK
        assert stats["inflight_area"] >= 4 * 0.020 * 0.9  # sleeps last at least their time
    finally:
        replicas.close()


def test_gateway_that_cannot_start_is_a_row_saying_why(tmp_path: Path) -> None:
    """A gateway whose module is missing exits; start() reports why instead of raising, and
    the table prints its row with the reason and no number."""
    spec = peers_gateways.GatewaySpec("nope round_robin", "nope", "0.*", ("no_such_gw",), "x")
    gw = peers_gateways.start(spec, ["http://127.0.0.1:9"], tmp_path, 0, Path(sys.executable))
    assert gw.proc is None
    assert gw.error.startswith("exited with 1") and "no_such_gw" in gw.error
    row = peers._error_row("latency", spec.label, gw.error, ("added_p50_us", "added_p99_us"))
    line = next(x for x in peers.tables([row]).splitlines() if x.startswith(spec.label))
    assert "not run: exited with 1" in line and line.split()[2:4] == ["-", "-"]
    missing = peers_gateways.start(spec, [], tmp_path, 1, tmp_path / "no-python")
    assert missing.error.startswith("cannot start") and missing.proc is None
