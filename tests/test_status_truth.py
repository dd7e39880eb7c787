"""What status, the exporter, health and load say matches what happened: a replica whose
requests fail shows failing (ejection on or off) with its streak and last error; worker
processes that died show unheard, not live, and `reap --wait` reclaims them; a replica
registered by a plain URL string is probed and scraped like one registered as {"url": ...}.
Faults are real: replicas and workers are processes the tests start and kill."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from redis_router import RedisLoadBalancer, health
from redis_router.cli import main as cli

from . import invariants
from .test_cli import run_cli
from .test_engine_load import VLLM_TEXT, Endpoints
from .test_exporter import exporter
from .test_health import Replica

SERVERS = {f"s{i}": {"url": f"http://10.0.0.{i}:8000"} for i in range(3)}


@pytest.fixture
def endpoints() -> Any:
    e = Endpoints()
    yield e
    e.close()


def scrape_all(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by name and its labels but balancer."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "balancer"))
            out[(s.name, labels)] = s.value
    return out


def _script_commands(r: Any) -> int:
    """Commands the server ran inside scripts and outside them, less the script calls and
    the INFO calls that read them."""
    stats = r.info("commandstats")
    skip = {"cmdstat_info", "cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_evalsha"}
    skip |= {"cmdstat_eval", "cmdstat_config", "cmdstat_ping", "cmdstat_client"}
    return sum(int(v["calls"]) for k, v in stats.items() if k not in skip)


# -- failing replicas, ejection off --------------------------------------------------------


def test_a_killed_replica_shows_failing_with_its_streak_and_last_error(
    make_lb, server, r, tmp_path
):
    reps = {}
    for sid in ("r0", "r1"):
        (tmp_path / sid).mkdir()
        reps[sid] = Replica(tmp_path / sid).start()
    try:
        lb = make_lb({sid: {"url": rep.url} for sid, rep in reps.items()})  # ejection off
        reps["r1"].kill()
        failed, n = 0, 0
        while failed < 10:
            assert n < 400, "r1 got too few of 400 requests"
            lease = lb.acquire(f"req-{n}")
            n += 1
            if lease.server_id == "r1":
                lease.fail()  # the request to the dead replica failed
                failed += 1
            else:
                lease.release()
        seen = lb.get_status()["replicas"]
        assert seen["r1"]["failing"] and seen["r1"]["failures_in_a_row"] == 10
        assert seen["r1"]["last_error"] == "request failed"
        assert 0 <= seen["r1"]["last_error_age"] < 60
        assert not seen["r0"]["failing"] and seen["r0"]["last_error"] is None

        text = run_cli("--name", lb.name, "status", redis=server.url).stdout
        row = next(line for line in text.splitlines() if line.startswith("r1 "))
        assert row.split()[1] == "failing", text
        assert "failing r1: 10 failures in a row, the last " in text
        assert text.rstrip().count("request failed") == 1
        js = json.loads(run_cli("--name", lb.name, "status", "--json", redis=server.url).stdout)
        got = js["replicas"]["r1"]
        assert (got["state"], got["failures_in_a_row"], got["last_error"]) == (
            "failing",
            10,
            "request failed",
        )
        assert js["replicas"]["r0"]["state"] == "active" and js["totals"]["failing"] == 1
        with exporter(server.url, lb.name) as running:
            m = scrape_all(running.url)
        failing = (("reason", "request failed"), ("replica", "r1"))
        assert m[("redis_router_failing", failing)] == 1
        assert m[("redis_router_failing", (("reason", ""), ("replica", "r0")))] == 0
        assert m[("redis_router_failures_in_a_row", (("replica", "r1"),))] == 10
        assert ("redis_router_last_error_age_seconds", (("replica", "r1"),)) in m

        # Back up: one success ends the streak; the last error is kept.
        reps["r1"].start()
        lb.drain_servers(["r0"])
        lb.acquire("back").release()
        seen = lb.get_status()["replicas"]["r1"]
        assert not seen["failing"] and seen["failures_in_a_row"] == 0
        assert seen["last_error"] == "request failed" and seen["failures"] == 10
        invariants.check(r, lb.name)
    finally:
        for rep in reps.values():
            rep.kill()


def test_a_success_ends_the_streak_and_a_release_pays_no_health_command(make_lb, r):
    lb = make_lb({"a": None, "b": None}, lease_ttl=60.0)  # ejection off (the default)
    lb.drain_servers(["b"])
    for ok in (False, False, True, False, False, False):
        lease = lb.acquire(f"x-{time.monotonic_ns()}")
        assert lease.server_id == "a"
        lease.release() if ok else lease.fail()
    r.ping()  # reads the releases' replies
    assert lb.get_status()["replicas"]["a"]["failures_in_a_row"] == 3
    lb.undrain_servers(["b"])
    lb.drain_servers(["a"])

    def release_cost() -> int:
        """Commands of one successful release on b (the fewest of 3: a heartbeat of the
        keeper may fall in one)."""
        costs = []
        for _ in range(3):
            lease = lb.acquire(f"y-{time.monotonic_ns()}")
            r.ping()
            before = _script_commands(r)
            lease.release().result()
            costs.append(_script_commands(r) - before)
        return min(costs)

    with_streak = release_cost()  # a's streak exists
    lb.undrain_servers(["a"])
    lb.drain_servers(["b"])
    lb.acquire("z").release()  # a success on a ends its streak
    r.ping()
    assert lb.get_status()["replicas"]["a"]["failures_in_a_row"] == 0
    lb.undrain_servers(["b"])
    lb.drain_servers(["a"])
    without = release_cost()
    # No health command: a streak elsewhere costs a successful release nothing.
    assert with_streak == without, (with_streak, without)
    invariants.check(r, lb.name)


def test_a_reclaimed_lease_neither_ends_nor_extends_a_streak(make_lb, r):
    lb = make_lb({"a": None})  # ejection off
    crashed = make_lb(name=lb.name, lease_ttl=0.5)
    lost = crashed.acquire("dies-with-it")
    lb.acquire("f1").fail()
    invariants.silence(crashed)  # as if its process died
    invariants.listen(lb, 0.8)  # others are heard: it is dead, not on probation
    assert lb.reap() == 1
    lb.acquire("f2").fail()
    seen = lb.get_status()["replicas"]["a"]
    assert seen["failures_in_a_row"] == 2 and seen["reclaimed"] == 1, seen
    assert lost.server_id == "a"
    invariants.check(r, lb.name)


def test_health_once_says_why_and_status_keeps_the_last_error(make_lb, server, endpoints, capsys):
    endpoints.serve("/ok/health", "ok")
    endpoints.serve("/bad/health", "down", status=503)
    lb = make_lb({"ok": {"url": endpoints.base + "/ok"}, "bad": {"url": endpoints.base + "/bad"}})
    for _ in range(2):
        assert cli(["health", "--redis", server.url, "--name", lb.name, "--once"]) == 0
    out = capsys.readouterr().out
    assert "bad: failing: HTTP 503" in out and "ok: ok" in out
    seen = lb.get_status()["replicas"]["bad"]
    assert seen["failing"] and seen["failures_in_a_row"] == 2
    assert seen["last_error"] == "health check: HTTP 503"


def test_a_reason_keeps_no_credentials_and_is_bounded():
    said = health.reason("GET http://alice:s3cret@10.0.0.1/health:\n refused " + "x" * 500)
    assert "s3cret" not in said and "alice" not in said and "\n" not in said
    assert len(said) == health.MAX_REASON


# -- worker processes that died ------------------------------------------------------------

HOLDER = """
import sys, time
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer(redis=sys.argv[1], name=sys.argv[2], lease_ttl=0.4)
for i in range(int(sys.argv[3])):
    lb.acquire_server(f"{sys.argv[4]}-{i}")
print("held", flush=True)
time.sleep(120)
"""


def _holders(server: Any, name: str, n: int, each: int) -> list[subprocess.Popen[str]]:
    procs = []
    for k in range(n):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, server.url, name, str(each), f"p{k}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        procs.append(proc)
    return procs


def _unheard_line(status: str) -> str | None:
    return next((line for line in status.splitlines() if " unheard for " in line), None)


def test_processes_killed_holding_leases_show_unheard_and_reap_wait_reclaims(make_lb, server, r):
    lb = make_lb(SERVERS)  # registers the pool; never acquires, so no holder of its own
    procs = _holders(server, lb.name, 3, 2)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)  # only the processes this test started
        proc.wait()
    killed = time.monotonic()
    time.sleep(0.8)  # past their lease_ttl (0.4 s): unheard since
    status = run_cli("--name", lb.name, "status", redis=server.url).stdout
    line = _unheard_line(status)
    assert line and line.startswith("3 process(es) unheard for "), status
    assert "holding 6 lease(s)" in line
    age = float(re.search(r"unheard for ([\d.]+)s", line).group(1))  # type: ignore[union-attr]
    assert 0.8 <= age <= time.monotonic() - killed + 2.0, line
    holders = lb.get_status()["holders"]
    assert (holders["live"], holders["unheard"], holders["unheard_leases"]) == (0, 3, 6)
    with exporter(server.url, lb.name) as running:
        m = scrape_all(running.url)
    assert m[("redis_router_holders", (("state", "unheard"),))] == 3
    assert m[("redis_router_holders", (("state", "live"),))] == 0
    assert m[("redis_router_leases_unheard", ())] == 6
    assert m[("redis_router_holders_unheard_seconds", ())] >= 0.8

    started = time.monotonic()
    proc = run_cli("--name", lb.name, "reap", "--wait", redis=server.url)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert "reclaimed 6 lease(s) of dead processes" in proc.stdout, proc.stdout + proc.stderr
    # Their probation is half their lease_ttl (0.2 s), plus a CLI start and a few calls.
    assert took < 10, took
    status = run_cli("--name", lb.name, "status", redis=server.url).stdout
    assert _unheard_line(status) is None and "await reclaim" not in status, status
    holders = lb.get_status()["holders"]
    assert (holders["live"], holders["unheard"], holders["dead"]) == (0, 0, 0)
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)


EXITS = """
import os, sys
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer(redis=sys.argv[1], name=sys.argv[2], lease_ttl=0.4)
with lb.lease("session-42") as lease:
    pass
os._exit(0)  # done, without close()
"""


def test_the_unheard_line_says_whether_their_probation_runs():
    from redis_router.cli.status import hints

    holders = {"unheard": 2, "unheard_ms": 61500, "unheard_leases": 3, "probation_ms": 4200}
    snap = {"balancer": "b", "totals": {"active": 1}, "replicas": {"s0": {"state": "active"}}}
    waiting = hints({**snap, "holders": {**holders, "probation_running": False}})
    assert waiting == [
        "2 process(es) unheard for 61.5s (they exited, or Redis paused), holding 3 lease(s): "
        "on probation, reclaimed 4.2s after a worker or `redis-router --name b reap --wait` "
        "next calls"
    ]
    running = hints({**snap, "holders": {**holders, "probation_running": True}})
    assert running[0].endswith("on probation, reclaimed in 4.2s unless heard again")


def test_processes_that_exited_without_close_are_forgotten_by_reap_wait(make_lb, server, r):
    lb = make_lb(SERVERS)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", EXITS, server.url, lb.name], check=True)
    time.sleep(0.8)
    line = _unheard_line(run_cli("--name", lb.name, "status", redis=server.url).stdout)
    assert line and line.startswith("2 process(es) unheard for ") and "holding 0" in line, line
    proc = run_cli("--name", lb.name, "reap", "--wait", redis=server.url)
    assert proc.returncode == 0 and "reclaimed 0 lease(s)" in proc.stdout, proc.stderr
    status = run_cli("--name", lb.name, "status", redis=server.url).stdout
    assert _unheard_line(status) is None, status
    assert r.zcard(invariants.prefix(lb.name) + "holders") == 0  # forgotten, not left
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)


# -- a replica registered by a plain URL --------------------------------------------------


def test_a_replica_registered_by_a_plain_url_is_probed_and_scraped(
    make_lb, server, r, endpoints, capsys
):
    for sid in ("lib", "cli", "old"):
        endpoints.serve(f"/{sid}/health", "ok")
        endpoints.serve(f"/{sid}/metrics", VLLM_TEXT)
    lb = make_lb({"lib": endpoints.base + "/lib"})  # as the quick start registers
    assert cli(["--redis", server.url, "--name", lb.name, "servers", "add", "cli", "--meta",
                endpoints.base + "/cli"]) == 0  # fmt: skip
    # A pool written by an earlier version: the plain string as stored JSON.
    r.hset(invariants.prefix(lb.name) + "servers", "old", json.dumps(endpoints.base + "/old"))
    capsys.readouterr()
    assert cli(["health", "--redis", server.url, "--name", lb.name, "--once"]) == 0
    out = capsys.readouterr().out
    for sid in ("lib", "cli", "old"):
        assert f"{sid}: ok" in out, out
    assert cli(["load", "--redis", server.url, "--name", lb.name, "--once"]) == 0
    out = capsys.readouterr().out
    for sid in ("lib", "cli"):
        assert f"{sid}: vllm: running" in out, out
    assert "lib: " in out and "no replica names a metrics URL" not in out
    replicas = lb.get_status()["replicas"]
    assert replicas["lib"]["metadata"] == {"url": endpoints.base + "/lib"}
    assert replicas["cli"]["metadata"] == {"url": endpoints.base + "/cli"}
    # The handle stays what was registered, in every process.
    other = RedisLoadBalancer(redis=server.url, name=lb.name)
    try:
        other.drain_servers(["lib", "old"])
        lease = other.acquire("to-cli")
        assert lease.handle == endpoints.base + "/cli"
        lease.release()
    finally:
        other.close()


def test_servers_add_refuses_meta_that_is_neither_json_nor_a_url(make_lb, server):
    lb = make_lb(SERVERS)
    proc = run_cli(
        "--name", lb.name, "servers", "add", "x", "--meta", "ftp://h/", redis=server.url
    )  # fmt: skip
    assert proc.returncode == 1 and "--meta is not valid JSON, nor an http://" in proc.stderr
    assert "x" not in lb.get_all_servers()
