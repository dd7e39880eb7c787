"""The engines' own load: `redis-router load` scrapes vLLM's and SGLang's Prometheus endpoints
and stores one report per replica (P engine, P engine_at), which status and the exporter show
with its age. Real servers (the fixtures' three), real HTTP endpoints on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from redis_router import AsyncRedisLoadBalancer, EngineLoad
from redis_router.cli import main as cli
from redis_router.engine_metrics import SGLANG, VLLM, Unusable, parse

pytest.importorskip("prometheus_client")

# As vLLM writes it (prometheus_client's text format): two data-parallel engines, labelled
# engine="0" and engine="1", beside metrics the reporter ignores.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.3
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 8128.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.91
"""

# As SGLang (started with --enable-metrics) writes it.
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Llama-3.1-8B",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Llama-3.1-8B",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Llama-3.1-8B",tp_rank="0"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="Llama-3.1-8B",tp_rank="0"} 0.0075
"""


def vllm_text(running: float, waiting: float, kv: float) -> str:
    """One vLLM engine's load gauges, written by prometheus_client as vLLM writes them."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    for name, value in ((VLLM.running, running), (VLLM.waiting, waiting), (VLLM.kv_usage, kv)):
        gauge = Gauge(name, name, ["model_name", "engine"], registry=registry)
        gauge.labels("m", "0").set(value)
    return generate_latest(registry).decode()


class Endpoints:
    """A loopback HTTP server whose paths answer what a test sets: (text, delay s, status)."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[str, float, int]] = {}
        self.auth: list[str | None] = []
        endpoints = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoints.auth.append(self.headers.get("Authorization"))
                text, delay, status = endpoints.answers.get(self.path, ("", 0.0, 404))
                time.sleep(delay)
                body = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the reporter gave up on a slow answer
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def serve(self, path: str, text: str, delay: float = 0.0, status: int = 200) -> str:
        self.answers[path] = (text, delay, status)
        return self.base + path

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def endpoints() -> Iterator[Endpoints]:
    e = Endpoints()
    yield e
    e.close()


def stored(r: Any, name: str) -> dict[str, list[int]]:
    """P engine as integers: id -> [at_ms, running, waiting, kv_permille, leases_at]."""
    return {k: [int(x) for x in v.split()] for k, v in r.hgetall(f"rr:{{{name}}}:engine").items()}


def until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


# -- parsing ------------------------------------------------------------------------------


def test_vllm_text_is_summed_over_its_engines_and_kv_usage_averaged():
    kind, load = parse(VLLM_TEXT)
    assert kind == "vllm"
    assert (load.running, load.waiting) == (5, 4)
    assert load.kv_usage == pytest.approx(0.4)


def test_sglang_text_is_read_by_its_own_names():
    kind, load = parse(SGLANG_TEXT)
    assert kind == "sglang"
    assert load == EngineLoad(7, 2, 0.28)


def test_text_written_by_prometheus_client_parses_back():
    assert parse(vllm_text(3, 1, 0.25)) == ("vllm", EngineLoad(3, 1, 0.25))


def test_without_a_kv_gauge_the_usage_is_unknown():
    text = "\n".join(line for line in VLLM_TEXT.splitlines() if "kv_cache" not in line)
    assert parse(text)[1].kv_usage is None


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>Not Found</body></html>",
        "vllm:num_requests_running{engine=0 3\n",  # a broken label set
        "\x00\x01\x02 binary",
        "",
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n",
    ],
    ids=["html", "broken-labels", "binary", "empty", "other-metrics"],
)
def test_garbage_gives_no_load(text):
    with pytest.raises(Unusable):
        parse(text)


@pytest.mark.parametrize(
    ("running", "waiting", "kv", "why"),
    [
        (-1, 0, 0.5, "not a count"),
        (float("nan"), 0, 0.5, "not a count"),
        (2.5, 0, 0.5, "not a count"),
        (1, float("inf"), 0.5, "not a count"),
        (1, 0, 1.5, "out of [0, 1]"),
        (1, 0, -0.1, "out of [0, 1]"),
        (1, 0, float("nan"), "out of [0, 1]"),
        (1e12, 0, 0.5, "more than"),
    ],
)
def test_lying_figures_give_no_load(running, waiting, kv, why):
    with pytest.raises(Unusable, match=why.replace("[", r"\[").replace("]", r"\]")):
        parse(vllm_text(running, waiting, kv))


def test_a_missing_request_gauge_gives_no_load():
    text = "\n".join(line for line in VLLM_TEXT.splitlines() if "waiting" not in line)
    with pytest.raises(Unusable, match="no vllm:num_requests_waiting"):
        parse(text)


# -- storage ------------------------------------------------------------------------------


def test_a_report_is_stamped_with_redis_clock_and_the_lease_count(make_lb, r):
    lb = make_lb({"a": None, "b": None})
    lb.drain_servers(["b"])
    lb.acquire_server("s1")
    lb.acquire_server("s2")
    before = int(r.time()[0]) * 1000
    assert lb.report_engine_load({"a": EngineLoad(3, 1, 0.4204), "b": EngineLoad(0, 0)}) == 2
    after = (int(r.time()[0]) + 1) * 1000
    got = stored(r, lb.name)
    assert got["a"][1:] == [3, 1, 420, 2]  # both sessions on a: b drains
    assert got["b"][1:] == [0, 0, -1, 0]
    assert before <= got["a"][0] <= after
    at = dict(r.zrange(f"rr:{{{lb.name}}}:engine_at", 0, -1, withscores=True))
    assert at == {"a": got["a"][0], "b": got["b"][0]}


def test_reports_for_ids_not_in_the_pool_are_skipped(make_lb, r):
    lb = make_lb({"a": None})
    assert lb.report_engine_load({"ghost": EngineLoad(1, 1, 0.1), "a": EngineLoad(2, 0)}) == 1
    assert set(stored(r, lb.name)) == {"a"}
    assert r.zscore(f"rr:{{{lb.name}}}:engine_at", "ghost") is None


def test_removing_a_replica_deletes_its_report_and_destroy_both_keys(make_lb, r):
    lb = make_lb({"a": None, "b": None})
    lb.report_engine_load({"a": EngineLoad(1, 0, 0.1), "b": EngineLoad(2, 0, 0.2)})
    assert lb.remove_servers(["a"]) == 1
    assert set(stored(r, lb.name)) == {"b"}
    assert r.zrange(f"rr:{{{lb.name}}}:engine_at", 0, -1) == ["b"]
    lb.destroy()
    assert r.exists(f"rr:{{{lb.name}}}:engine", f"rr:{{{lb.name}}}:engine_at") == 0


def test_the_two_keys_hold_the_same_replicas_all_in_the_pool(make_lb, r):
    lb = make_lb({"a": None, "b": None, "c": None})
    lb.report_engine_load({sid: EngineLoad(1, 0) for sid in ("a", "b", "c", "gone")})
    lb.remove_servers(["b"])
    lb.add_servers({"b": None, "d": None})  # back, without a report
    lb.report_engine_load({"d": EngineLoad(2, 1, 0.5)})
    p = f"rr:{{{lb.name}}}:"
    reports = stored(r, lb.name)
    at = {sid: int(score) for sid, score in r.zrange(p + "engine_at", 0, -1, withscores=True)}
    assert set(reports) == {"a", "c", "d"} <= set(r.hkeys(p + "servers"))
    assert at == {sid: fields[0] for sid, fields in reports.items()}


@pytest.mark.parametrize(
    ("loads", "error", "says"),
    [
        ([("a", EngineLoad(1, 1))], TypeError, "loads must be a mapping"),
        ({"a": (1, 1, 0.5)}, TypeError, "EngineLoad"),
        ({"": EngineLoad(1, 1)}, ValueError, "server"),
    ],
)
def test_bad_reports_raise_and_write_nothing(make_lb, r, loads, error, says):
    lb = make_lb({"a": None})
    good = {"a": EngineLoad(1, 1, 0.5)}
    with pytest.raises(error, match=says):
        lb.report_engine_load({**good, **loads} if isinstance(loads, dict) else loads)
    assert r.exists(f"rr:{{{lb.name}}}:engine", f"rr:{{{lb.name}}}:engine_at") == 0


@pytest.mark.parametrize(
    ("args", "error", "says"),
    [
        ((-1, 0), ValueError, "running must be in"),
        ((0, 10**9), ValueError, "waiting must be in"),
        ((1.0, 0), TypeError, "running must be an int"),
        ((True, 0), TypeError, "running must be an int"),
        ((1, 0, 1.01), ValueError, r"kv_usage must be a finite fraction in \[0, 1\]"),
        ((1, 0, math.nan), ValueError, "kv_usage"),
        ((1, 0, "0.5"), TypeError, "kv_usage must be a float"),
    ],
)
def test_engine_load_refuses_figures_no_engine_could_mean(args, error, says):
    with pytest.raises(error, match=says):
        EngineLoad(*args)


def test_a_forged_engine_load_is_refused_before_anything_is_written(make_lb, r):
    lb = make_lb({"a": None})
    forged = EngineLoad(1, 1)
    object.__setattr__(forged, "running", -5)
    with pytest.raises(ValueError, match=r"loads\['a'\].running"):
        lb.report_engine_load({"a": forged})
    assert r.exists(f"rr:{{{lb.name}}}:engine") == 0


def test_the_asyncio_twin_reports_as_the_sync_one(server, r):
    async def main() -> tuple[int, dict[str, Any]]:
        alb = AsyncRedisLoadBalancer({"a": None, "b": None}, redis=server.url, name="aio")
        try:
            n = await alb.report_engine_load({"a": EngineLoad(4, 2, 0.5), "x": EngineLoad(1, 1)})
            return n, await alb.get_status()
        finally:
            await alb.close()

    n, status = asyncio.run(main())
    assert n == 1
    engine = status["replicas"]["a"]["engine"]
    assert (engine["running"], engine["waiting"], engine["kv_usage"]) == (4, 2, 0.5)
    assert "engine" not in status["replicas"]["b"]


def test_status_shows_each_report_and_its_age(make_lb):
    lb = make_lb({"a": None, "b": None})
    lb.report_engine_load({"a": EngineLoad(3, 1, 0.42)})
    time.sleep(0.2)
    replicas = lb.get_status()["replicas"]
    a = replicas["a"]["engine"]
    assert {k: a[k] for k in ("running", "waiting", "kv_usage", "leases_at")} == {
        "running": 3,
        "waiting": 1,
        "kv_usage": 0.42,
        "leases_at": 0,
    }
    assert 0.15 <= a["age_s"] < 5
    assert "engine" not in replicas["b"]


# -- the reporter -------------------------------------------------------------------------


def load_cmd(server: Any, name: str, *extra: str) -> list[str]:
    return ["load", "--redis", server.url, "--name", name, *extra]


def reporter(server: Any, name: str, **kw: Any) -> subprocess.Popen[str]:
    """`redis-router load` in a process of its own, a round every 0.1 s."""
    command = [sys.executable, "-m", "redis_router.cli", *load_cmd(server, name)]
    return subprocess.Popen([*command, "--interval", "0.1", "--timeout", "1"], text=True, **kw)


def test_one_round_reports_both_engines_in_one_call(make_lb, r, server, endpoints, capsys):
    lb = make_lb(
        {
            "v": {"url": endpoints.base + "/v"},  # url + --path
            "s": {"metrics_url": endpoints.serve("/sglang", SGLANG_TEXT)},
            "plain": None,  # no URL: not scraped
        }
    )
    endpoints.serve("/v/metrics", VLLM_TEXT)
    assert cli(load_cmd(server, lb.name, "--once")) == 0
    got = stored(r, lb.name)
    assert got["v"][1:4] == [5, 4, 400]
    assert got["s"][1:4] == [7, 2, 280]
    assert got["v"][0] == got["s"][0]  # one script call, one clock reading
    assert "plain" not in got
    out = capsys.readouterr().out
    assert "v: vllm: running 5, waiting 4, KV cache 40.0%" in out
    assert "s: sglang: running 7, waiting 2, KV cache 28.0%" in out


def test_each_data_parallel_rank_gets_its_own_engines_figures_from_one_scrape(
    make_lb, r, server, endpoints, capsys
):
    """A server routed per rank (dp_size): its ranks share one endpoint, scraped once a round,
    and each rank's report is the figures vLLM labels with its engine index."""
    url = endpoints.serve("/dp", VLLM_TEXT)
    lb = make_lb(
        {
            "moe": {"metrics_url": url, "dp_size": 2},
            "wide": {"metrics_url": endpoints.serve("/wide", VLLM_TEXT), "dp_size": 3},
            "sg": {"metrics_url": endpoints.serve("/sg", SGLANG_TEXT), "dp_size": 2},
        }
    )
    before = len(endpoints.auth)
    assert cli(load_cmd(server, lb.name, "--once")) == 0
    assert len(endpoints.auth) - before == 3  # one GET per endpoint, not one per rank
    got = stored(r, lb.name)
    assert got["moe#dp0"][1:4] == [3, 4, 500]
    assert got["moe#dp1"][1:4] == [2, 0, 300]
    assert got["wide#dp1"][1:4] == [2, 0, 300]
    # No figures of a rank, or an engine that does not label its ranks: no report, and why.
    assert not {"wide#dp2", "sg#dp0", "sg#dp1"} & set(got)
    out = capsys.readouterr().out
    assert 'wide#dp2: no report (no figures labelled engine="2" (data-parallel rank))' in out
    assert "sg#dp0: no report (per-rank figures are read from vLLM's 'engine' label" in out


def test_a_slow_endpoint_gets_no_report_and_the_others_still_do(
    make_lb, r, server, endpoints, capsys
):
    lb = make_lb(
        {
            "fast": {"metrics_url": endpoints.serve("/fast", VLLM_TEXT)},
            "slow": {"metrics_url": endpoints.serve("/slow", VLLM_TEXT, delay=2.0)},
        }
    )
    started = time.monotonic()
    assert cli(load_cmd(server, lb.name, "--once", "--timeout", "0.3")) == 0
    assert time.monotonic() - started < 1.5  # the round did not wait for the slow one
    assert set(stored(r, lb.name)) == {"fast"}
    assert "slow: no report (timed out after 0.3 s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (("<html>oops</html>", 0.0, 200), "not Prometheus text"),
        (("# TYPE up gauge\nup 1\n", 0.0, 200), "no engine load metrics"),
        (("", 0.0, 503), "HTTP 503"),
        ((VLLM_TEXT.replace("} 3.0", "} -3.0"), 0.0, 200), "not a count of requests"),
        ((VLLM_TEXT.replace("} 0.5", "} 1.7"), 0.0, 200), "out of [0, 1]"),
        ((VLLM_TEXT.replace("} 0.5", "} NaN"), 0.0, 200), "out of [0, 1]"),
    ],
    ids=["garbage", "other-metrics", "http-error", "negative", "kv-above-1", "kv-nan"],
)
def test_a_bad_endpoint_gets_no_report_and_one_line_says_why(
    make_lb, r, server, endpoints, capsys, answer, why
):
    endpoints.answers["/bad"] = answer
    lb = make_lb(
        {
            "good": {"metrics_url": endpoints.serve("/good", SGLANG_TEXT)},
            "bad": {"metrics_url": endpoints.base + "/bad"},
        }
    )
    assert cli(load_cmd(server, lb.name, "--once")) == 0
    assert set(stored(r, lb.name)) == {"good"}
    lines = [line for line in capsys.readouterr().out.splitlines() if " bad: " in line]
    assert len(lines) == 1 and "no report" in lines[0] and why in lines[0], lines


def test_credentials_in_a_metrics_url_are_sent_and_never_printed(
    make_lb, r, server, endpoints, capsys
):
    url = endpoints.serve("/m", VLLM_TEXT).replace("http://", "http://ops:s3cret-pw@")
    lb = make_lb(
        {
            "a": {"metrics_url": url},
            "down": {"metrics_url": "http://ops:s3cret-pw@127.0.0.1:1/metrics"},
        }
    )
    assert cli(load_cmd(server, lb.name, "--once")) == 0
    assert set(stored(r, lb.name)) == {"a"}
    assert any(a and a.startswith("Basic ") for a in endpoints.auth)
    captured = capsys.readouterr()
    assert "down: no report" in captured.out
    assert "s3cret" not in captured.out + captured.err


def test_a_killed_reporter_leaves_reports_whose_age_grows(make_lb, server, endpoints, capsys):
    lb = make_lb({"a": {"metrics_url": endpoints.serve("/a", VLLM_TEXT)}})
    process = reporter(server, lb.name, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until(lambda: "engine" in lb.get_status()["replicas"]["a"])
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    first = lb.get_status()["replicas"]["a"]["engine"]["age_s"]
    time.sleep(0.6)
    later = lb.get_status()["replicas"]["a"]["engine"]
    assert later["age_s"] >= first + 0.5
    assert (later["running"], later["waiting"]) == (5, 4)  # the last report stays
    assert cli(["status", "--redis", server.url, "--name", lb.name]) == 0
    out = capsys.readouterr().out
    assert "engine a: running 5, waiting 4, KV cache 40.0% (reported" in out
    age = float(out.split("(reported ")[1].split(" s ago")[0])
    assert age >= round(later["age_s"], 1)  # shown to a tenth of a second


def test_a_running_reporter_says_when_a_replica_stops_and_starts_reporting(
    make_lb, r, server, endpoints
):
    lb = make_lb({"a": {"metrics_url": endpoints.serve("/a", VLLM_TEXT)}})
    process = reporter(server, lb.name, stdout=subprocess.PIPE)
    try:
        until(lambda: stored(r, lb.name))
        endpoints.serve("/a", "", status=500)
        time.sleep(0.5)
        endpoints.serve("/a", SGLANG_TEXT)
        until(lambda: stored(r, lb.name)["a"][1] == 7)
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=10)
    lines = [line.split(" ", 1)[1] for line in out.splitlines()]
    assert lines == [
        "a: vllm: running 5, waiting 4, KV cache 40.0%",
        "a: no report (HTTP 500)",
        "a: sglang: running 7, waiting 2, KV cache 28.0%",
    ]
    assert process.returncode == 0


def test_the_fake_replica_reports_its_requests_in_flight(make_lb, r, server):
    """End to end: a request held open on redis_router.http.fake_replica shows as running."""
    replica = subprocess.Popen(
        [sys.executable, "-m", "redis_router.http.fake_replica", "--id", "f0", "--delay", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert replica.stdout is not None
        url = replica.stdout.readline().split(" on ")[1].strip()
        lb = make_lb({"f0": {"url": url}})
        request = threading.Thread(
            target=lambda: urllib.request.urlopen(
                urllib.request.Request(
                    url + "/v1/completions",
                    data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                    headers={"Content-Type": "application/json"},
                ),
                timeout=10,
            ).read()
        )
        request.start()
        until(lambda: json.load(urllib.request.urlopen(url + "/stats", timeout=5))["inflight"])
        assert cli(load_cmd(server, lb.name, "--once", "--timeout", "2")) == 0
        assert stored(r, lb.name)["f0"][1:4] == [1, 0, -1]
        request.join(timeout=10)
    finally:
        replica.kill()
        replica.wait(timeout=10)


def test_status_json_and_the_exporter_show_the_figures(make_lb, server):
    from redis_router.cli.common import Balancer, snapshot
    from redis_router.cli.exporter import BalancerCollector
    from redis_router.connection import connect

    lb = make_lb({"a": None, "b": None})
    lb.report_engine_load({"a": EngineLoad(3, 1, 0.42), "b": EngineLoad(0, 2)})
    snap = snapshot(Balancer(connect(server.url), lb.name, server.url))
    json.dumps(snap)
    assert snap["replicas"]["a"]["engine"]["kv_usage"] == 0.42
    collector = BalancerCollector(server.url, lb.name)
    try:
        families = {f.name: f for f in collector.collect()}
    finally:
        collector.close()

    def values(name: str) -> dict[str, float]:
        return {s.labels["replica"]: s.value for s in families[name].samples}

    assert values("redis_router_engine_running") == {"a": 3.0, "b": 0.0}
    assert values("redis_router_engine_waiting") == {"a": 1.0, "b": 2.0}
    assert values("redis_router_engine_kv_usage") == {"a": 0.42}  # b's is unknown
    ages = values("redis_router_engine_report_age_seconds")
    assert set(ages) == {"a", "b"} and all(0 <= age < 5 for age in ages.values())


def test_the_reporter_refuses_bad_options(make_lb, server, capsys):
    lb = make_lb({"a": None})
    assert cli(load_cmd(server, lb.name, "--once", "--timeout", "0")) == 1
    assert "--timeout must be > 0" in capsys.readouterr().err


def test_without_prometheus_client_the_reporter_names_the_extra(make_lb, server, capsys):
    lb = make_lb({"a": None})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
        assert cli(load_cmd(server, lb.name, "--once")) == 1
    assert "pip install prometheus_client" in capsys.readouterr().err


def test_the_engine_names_are_distinct():
    assert len({*VLLM[1:], *SGLANG[1:]}) == 6
