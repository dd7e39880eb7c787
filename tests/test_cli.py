"""`redis-router` as an operator runs it: a subprocess against a real server, checked through
the library (status, steering, sessions, reap, errors that fit on one line)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from redis_router import NoCapacity, cli

from . import invariants

SERVERS = {f"s{i}": {"url": f"http://10.0.0.{i}:8000"} for i in range(4)}
CLI = [sys.executable, "-m", "redis_router.cli"]
UNREACHABLE = "redis://:hunter2-secret@127.0.0.1:1/0"  # port 1: nothing listens


def run_cli(
    *args: str, redis: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """`python -m redis_router.cli [--redis URL] ARGS`, captured as text."""
    head = ["--redis", redis] if redis else []
    return subprocess.run(
        [*CLI, *head, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_without_redis_url(),
    )


def env_without_redis_url() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "REDIS_URL"}


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("redis-router: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def sigint_as_in_a_shell() -> None:
    """For a child's preexec_fn: SIGINT's default disposition, which a background job's children
    would otherwise inherit as ignored (then Python installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_cli(*args: str) -> subprocess.Popen[str]:
    """A long-running `python -m redis_router.cli ARGS`, stoppable with SIGINT or SIGTERM however
    pytest itself was started."""
    return subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_without_redis_url(),
        preexec_fn=sigint_as_in_a_shell,
    )


def watchdog(proc: subprocess.Popen, seconds: float = 60) -> threading.Timer:
    """Kill a long-running subprocess if the test hangs reading it."""
    timer = threading.Timer(seconds, proc.kill)
    timer.daemon = True
    timer.start()
    return timer


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows of the status table by replica id (columns split on runs of 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("REPLICA"))
    rows = {}
    for line in lines[start + 1 :]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells
        if cells[0] == "TOTAL":
            break
    return rows


def busy_balancer(make_lb: Any) -> Any:
    """4 replicas with leases and sessions; s1 draining with requests in flight, s3 drained."""
    lb = make_lb({"s1": SERVERS["s1"]}, sticky_ttl=120)
    lb.acquire_server("chat-a")  # on s1, the only replica yet
    lb.add_servers({sid: meta for sid, meta in SERVERS.items() if sid != "s1"})
    for i in range(6):
        lb.acquire_server(f"req-{i}")
    assert lb.acquire_server("chat-a")[0] == "s1"  # a sticky hit
    while lb.get_inflight_count("s3"):
        lb.release_server("s3")
    lb.drain_servers(["s1", "s3"])
    return lb


# -- status ---------------------------------------------------------------------------------


def test_status_table_shows_each_replica_as_the_library_sees_it(server, make_lb):
    lb = busy_balancer(make_lb)
    proc = run_cli("--name", lb.name, "status", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    status = lb.get_status()["replicas"]
    assert set(rows) == {*SERVERS, "TOTAL"}
    for sid, r in status.items():
        state = "active" if not r["draining"] else ("drained" if not r["inflight"] else "draining")
        assert rows[sid][1] == state
        numbers = [int(c) for c in rows[sid][2:9]]
        assert numbers == [
            r["inflight"],
            r["live_leases"],
            r["sticky_sessions"],
            r["acquires"],
            r["sticky_hits"],
            r["reclaimed"],
            r["repins"],
        ]
        assert rows[sid][9] == "-"  # no capacity declared
        assert json.loads(rows[sid][10]) == r["metadata"]
    assert rows["s3"][1] == "drained" and rows["s1"][1] == "draining"
    assert int(rows["TOTAL"][2]) == lb.get_total_inflight()
    assert "2 active, 0 full, 0 ejected, 1 draining, 1 drained" in proc.stdout
    assert "servers remove s3`" in proc.stdout  # what to do next with a drained replica


def test_status_json_is_the_same_data(server, make_lb):
    lb = busy_balancer(make_lb)
    proc = run_cli("--name", lb.name, "status", "--json", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    status = lb.get_status()
    assert snap["balancer"] == lb.name and snap["sticky_ttl"] == 120
    assert list(snap["replicas"]) == sorted(SERVERS)
    for sid, r in status["replicas"].items():
        got = snap["replicas"][sid]
        assert {k: got[k] for k in r} == r
    assert snap["replicas"]["s3"]["state"] == "drained"
    assert snap["replicas"]["s1"]["state"] == "draining"
    assert snap["totals"]["inflight"] == status["total_inflight"]
    assert snap["totals"]["sticky_sessions"] == status["sticky_sessions"]
    assert (snap["totals"]["active"], snap["totals"]["draining"]) == (2, 1)


def keyspace(r) -> dict[str, Any]:
    """Every key with its serialized value, and the key count, as Redis reports them."""
    keys = {k: r.dump(k) for k in r.scan_iter("*", count=1000)}
    return {"dbsize": r.dbsize(), "keys": keys}


def run_read_only(args: list[str], url: str, name: str) -> None:
    """Run a read-only command to the point where it has read the balancer at least twice."""
    head = ["--redis", url, "--name", name]
    if args[0] == "exporter":
        proc = popen_cli(*head, "exporter", "--port", "0", "--addr", "127.0.0.1")
        timer = watchdog(proc)
        try:
            assert proc.stdout is not None
            metrics = re.search(r"(http://\S+/metrics)", proc.stdout.readline())
            assert metrics, proc.stderr
            for _ in range(2):
                with urllib.request.urlopen(metrics.group(1), timeout=10) as resp:
                    assert b"redis_router_up" in resp.read()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
            timer.cancel()
    elif "--watch" in args:
        proc = popen_cli(*head, *args, "--interval", "0.05")
        timer = watchdog(proc)
        try:
            assert proc.stdout is not None
            frames = 0
            for line in proc.stdout:
                frames += line.startswith(("balancer ", "{", "redis-router: error"))
                if frames == 3:
                    break
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
            timer.cancel()
    else:
        run_cli("--name", name, *args, redis=url)


READ_ONLY = [["status"], ["status", "--json"], ["status", "--watch"], ["exporter"]]


@pytest.mark.parametrize("args", READ_ONLY, ids=lambda a: "-".join(a))
def test_read_only_commands_change_nothing_in_redis(server, make_lb, r, args):
    lb = make_lb(SERVERS, sticky_ttl=45)
    held = [lb.acquire(f"chat-{i}") for i in range(3)]
    held[0].release()
    lb.drain_servers(["s3"])
    lb.close()  # nothing of this process writes from here on
    before = keyspace(r)
    assert before["dbsize"] > 0 and r.hget(f"rr:{{{lb.name}}}:config", "sticky_ttl_ms")
    run_read_only(args, server.url, lb.name)
    assert keyspace(r) == before


@pytest.mark.parametrize("args", READ_ONLY, ids=lambda a: "-".join(a))
def test_read_only_commands_on_an_empty_redis_create_nothing(server, r, args):
    run_read_only(args, server.url, "default")
    assert r.dbsize() == 0


def test_status_of_an_unknown_balancer_fails_without_creating_it(server, make_lb, r):
    lb = make_lb(SERVERS)
    proc = run_cli("--name", "ghost", "status", redis=server.url)
    line = assert_one_line_error(proc, "'ghost'", "--name")
    assert lb.name in line  # names the balancers that do exist
    assert r.keys("rr:{ghost}*") == []


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_health_loop_stops_cleanly_on_ctrl_c_and_on_sigterm(server, make_lb, stop):
    lb = make_lb(SERVERS)
    proc = popen_cli("--redis", server.url, "--name", lb.name, "health", "--interval", "0.05")
    timer = watchdog(proc)
    try:
        assert proc.stdout is not None
        assert "ejection is off" in proc.stdout.readline()  # it is running its loop
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=30)
    finally:
        timer.cancel()
    assert proc.returncode == 0
    assert "Traceback" not in err


def test_a_one_shot_command_stopped_by_sigterm_exits_143(server):
    """SIGTERM during a command that is not a loop: no traceback, the shell's 128 + 15."""
    code = (
        "import os, signal, sys, threading\n"
        "from redis_router import cli\n"
        "from redis_router.cli import status\n"
        "def slow(args):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    threading.Event().wait(30)\n"
        "status.run = slow\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "--redis", server.url, "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without_redis_url(),
    )
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_status_watch_redraws_live_until_interrupted(server, make_lb, stop):
    lb = make_lb(SERVERS)
    proc = popen_cli(
        "--redis", server.url, "--name", lb.name, "status", "--watch", "--interval", "0.1"
    )
    timer = watchdog(proc)
    try:
        frames: list[list[str]] = []
        acquired = False
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("balancer "):
                frames.append([])
                if len(frames) == 2 and not acquired:
                    lb.acquire_server("live")
                    acquired = True
            elif frames:
                frames[-1].append(line)
            if acquired and any(
                row.startswith("TOTAL") and row.split()[3] == "1" for row in frames[-1]
            ):
                break  # a later frame shows the request acquired after the watch started
        assert len(frames) >= 3
        assert all(row.split()[3] == "0" for f in frames[:2] for row in f if row[:5] == "TOTAL")
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=30)
    finally:
        timer.cancel()
    assert proc.returncode == 0
    assert "Traceback" not in err


# -- steering -------------------------------------------------------------------------------


def test_servers_add_registers_a_replica_with_json_metadata(server, make_lb):
    lb = make_lb(SERVERS)
    proc = run_cli(
        "--name", lb.name, "servers", "add", "s9", "--meta", '{"url": "http://h:1"}',
        redis=server.url,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "s9" in lb.get_all_servers()
    assert lb.get_status()["replicas"]["s9"]["metadata"] == {"url": "http://h:1"}


def test_servers_add_creates_a_balancer_with_the_given_sticky_ttl(server, r):
    proc = run_cli("--name", "new", "servers", "add", "a", "--sticky-ttl", "30", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert r.hget("rr:{new}:config", "sticky_ttl_ms") == "30000"
    assert invariants.check(r, "new") == {"a": 0}


def test_servers_add_pins_no_sticky_ttl_unless_given(server, r):
    proc = run_cli("--name", "new", "servers", "add", "a", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert r.hget("rr:{new}:config", "sticky_ttl_ms") is None  # the first worker pins its own
    assert invariants.check(r, "new") == {"a": 0}


def test_servers_add_keeps_the_pinned_sticky_ttl_of_a_live_balancer(server, make_lb, r):
    lb = make_lb(SERVERS, sticky_ttl=45)
    lb.acquire_server("a")  # the first acquire pins sticky_ttl
    proc = run_cli(
        "--name", lb.name, "servers", "add", "s9", "--sticky-ttl", "30", redis=server.url
    )
    assert proc.returncode == 0, proc.stderr
    assert r.hget(f"rr:{{{lb.name}}}:config", "sticky_ttl_ms") == "45000"


def test_drained_replica_gets_no_new_sessions_but_keeps_its_sticky_ones(server, make_lb, r):
    lb = make_lb(SERVERS)
    on_s1 = None
    for i in range(200):  # find a session that lives on s1
        sid, _ = lb.acquire_server(f"find-{i}")
        lb.release_server(sid, f"find-{i}")
        if sid == "s1":
            on_s1 = f"find-{i}"
            break
    assert on_s1 is not None
    proc = run_cli("--name", lb.name, "servers", "drain", "s1", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert lb.get_status()["draining_servers"] == ["s1"]
    new = [lb.acquire_server(f"new-{i}")[0] for i in range(20)]
    assert "s1" not in new
    assert lb.acquire_server(on_s1)[0] == "s1"
    invariants.check(r, lb.name)

    proc = run_cli("--name", lb.name, "servers", "undrain", "s1", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert lb.get_status()["draining_servers"] == []


def test_servers_remove_takes_the_replica_out(server, make_lb, r):
    lb = make_lb(SERVERS)
    proc = run_cli("--name", lb.name, "servers", "remove", "s2", "s3", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert lb.get_all_servers() == ["s0", "s1"]
    invariants.check(r, lb.name)


def test_steering_an_unknown_replica_fails_and_changes_nothing(server, make_lb, r):
    lb = make_lb(SERVERS)
    lb.acquire_server("a")
    before = {k: r.dump(k) for k in r.keys("*")}
    for action in ("remove", "drain", "undrain"):
        proc = run_cli("--name", lb.name, "servers", action, "s0", "nope", redis=server.url)
        assert_one_line_error(proc, "'nope'")
    assert {k: r.dump(k) for k in r.keys("*")} == before


def test_sessions_clear_forgets_sticky_sessions(server, make_lb):
    lb = make_lb(SERVERS)
    for i in range(5):
        lease = lb.acquire(f"chat-{i}")
        lease.release()
    assert lb.get_status()["sticky_sessions"] == 5
    proc = run_cli("--name", lb.name, "sessions", "clear", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert "cleared 5 sticky session(s)" in proc.stdout
    assert lb.get_status()["sticky_sessions"] == 0
    assert not lb.acquire("chat-0").sticky  # balanced anew


DIES_HOLDING = """
import os, sys
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer(redis=sys.argv[1], name=sys.argv[2], lease_ttl=0.5)
for i in range(3):
    lb.acquire(f"dead-{i}")
os._exit(0)  # dies holding its leases, without releasing or closing
"""


@pytest.mark.slow
def test_reap_reclaims_the_leases_of_a_dead_worker(server, make_lb, r):
    lb = make_lb(SERVERS)
    subprocess.run([sys.executable, "-c", DIES_HOLDING, server.url, lb.name], check=True)
    time.sleep(0.8)  # past its lease_ttl
    # Nobody was heard since it died, which Redis cannot tell from a pause of its own: the
    # worker is on probation, and a plain reap leaves it.
    status = run_cli("--name", lb.name, "status", redis=server.url).stdout
    assert "1 process(es) unheard for " in status and "holding 3 lease(s)" in status, status
    assert lb.get_total_inflight() == 3
    proc = run_cli("--name", lb.name, "reap", redis=server.url)
    assert proc.returncode == 0 and "reclaimed 0 lease(s)" in proc.stdout, proc.stderr
    assert "probation left" in proc.stderr
    # --wait waits it out, calling so Redis hears it, then reclaims.
    proc = run_cli("--name", lb.name, "reap", "--wait", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert "reclaimed 3 lease(s) of dead processes" in proc.stdout, proc.stderr
    status = run_cli("--name", lb.name, "status", redis=server.url).stdout
    assert "await reclaim" not in status and "unheard" not in status
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)
    assert sum(x["reclaimed"] for x in lb.get_status()["replicas"].values()) == 3


# -- errors and help ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--watch"],
        ["servers", "remove", "s0"],
        ["servers", "add", "s0"],
        ["sessions", "clear"],
        ["reap"],
        ["exporter", "--port", "0"],
    ],
    ids=lambda a: "-".join(a),
)
def test_unreachable_redis_is_one_line_without_the_password(args):
    proc = run_cli(*args, redis=UNREACHABLE)
    line = assert_one_line_error(proc, "cannot reach Redis at redis://:***@127.0.0.1:1/0")
    assert "hunter2" not in proc.stdout + proc.stderr, line


def test_redis_url_from_the_environment_is_used_and_redacted():
    proc = subprocess.run(
        [*CLI, "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env_without_redis_url(), "REDIS_URL": UNREACHABLE},
    )
    assert_one_line_error(proc, "127.0.0.1:1")
    assert "hunter2" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["servers", "add", "s0", "--meta", "{not json"], "--meta is not valid JSON"),
        (["--name", "bad{name}", "status"], "name must be"),
        (["status", "--interval", "0"], "--interval must be > 0"),
    ],
    ids=["bad-json", "bad-name", "bad-interval"],
)
def test_bad_input_is_one_line(args, needle):
    assert_one_line_error(run_cli(*args, redis=UNREACHABLE), needle)


def test_unsupported_url_scheme_is_one_line_without_the_password():
    proc = run_cli("status", redis="redis+nope://:hunter2@h:1")
    assert_one_line_error(proc, "unsupported scheme")
    assert "hunter2" not in proc.stderr


SUBCOMMANDS = [
    *([name] for name in cli.COMMANDS),
    *(["servers", action] for action in ("add", "remove", "drain", "undrain")),
    ["sessions", "clear"],
]


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda a: "-".join(a))
def test_every_subcommand_has_help(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*args, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: redis-router {' '.join(args)}")


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("redis-router")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert all(name in proc.stdout for name in cli.COMMANDS)


def test_global_options_work_after_the_subcommand(server, make_lb):
    lb = make_lb(SERVERS)
    proc = run_cli("status", "--json", "--redis", server.url, "--name", lb.name)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["balancer"] == lb.name


def test_status_shows_full_and_ejected_replicas_and_waiting(server, make_lb):
    lb = make_lb({"a": {"capacity": 1}, "b": None}, eject_after=1)
    lb.drain_servers(["a"])
    lb.acquire("on-b").fail()
    lb.undrain_servers(["a"])
    lb.acquire("fills-a")
    with pytest.raises(NoCapacity):
        lb.acquire("waits", wait=0.1)
    proc = run_cli("--name", lb.name, "status", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["a"][1] == "full" and rows["a"][9] == "1"
    assert rows["b"][1] == "ejected"
    assert "ejected b until" in proc.stdout and "1 failed requests in a row" in proc.stdout
    assert "ejection: eject_after=1, eject_for=30s, eject_max=300s" in proc.stdout
    assert "0 served after waiting" in proc.stdout and "1 gave up" in proc.stdout
    snap = json.loads(run_cli("--name", lb.name, "status", "--json", redis=server.url).stdout)
    assert snap["replicas"]["b"]["ejected_why"] == "1 failed requests in a row"
    assert snap["waiting"]["timed_out"] == 1


def test_servers_add_declares_a_capacity(server, make_lb, r):
    lb = make_lb({"a": None})
    proc = run_cli("--name", lb.name, "servers", "add", "b", "--capacity", "2", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    assert r.hget(invariants.prefix(lb.name) + "capacity", "b") == "2"
    proc = run_cli("--name", lb.name, "servers", "add", "b", "--capacity", "0", redis=server.url)
    assert proc.returncode == 1 and "capacity" in proc.stderr
    assert r.hget(invariants.prefix(lb.name) + "capacity", "b") == "2"  # nothing changed
