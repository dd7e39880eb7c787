"""Replica health: failed requests and failed probes eject a replica for every worker, for a
time that grows with repeated ejections, never more than a share of the pool; the replica
comes back when its time is up. The replicas are real HTTP servers the tests start and kill."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_router import ConfigMismatch, RedisLoadBalancer
from redis_router.cli import main as cli
from redis_router.core import Call
from redis_router.errors import ReplicaEjected
from redis_router.scripts import load

from . import invariants


class Replica:
    """A tiny HTTP server in its own process answering GET /health; kill() ends only it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "health").write_text("ok")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"],
            cwd=self.root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self.alive():
            assert time.monotonic() < deadline, "replica did not start"
            time.sleep(0.02)
        return self

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=0.5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # only the process this test started, by its handle
            self.proc.wait()
            self.proc = None


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[dict[str, Replica]]:
    made: dict[str, Replica] = {}
    for i in range(3):
        root = tmp_path / f"r{i}"
        root.mkdir()
        made[f"r{i}"] = Replica(root).start()
    yield made
    for rep in made.values():
        rep.kill()


def serve(lb: RedisLoadBalancer, rid: str, timeout: float = 0.5) -> tuple[str, bool]:
    """One request: acquire, call the replica, report the outcome. (replica, succeeded)."""
    lease = lb.acquire(rid)
    try:
        with urllib.request.urlopen(lease.handle["url"] + "/health", timeout=timeout):
            pass
    except OSError:
        lease.fail()
        return lease.server_id, False
    lease.release()
    return lease.server_id, True


EJECT = {"eject_after": 3, "eject_for": 1.0, "eject_max": 4.0}


def test_a_killed_replica_is_ejected_for_every_worker_and_comes_back(make_lb, r, replicas):
    meta = {sid: {"url": rep.url} for sid, rep in replicas.items()}
    workers = [make_lb(meta, name="h", **EJECT) for _ in range(4)]
    stop, log = threading.Event(), []
    lock = threading.Lock()

    def work(k: int) -> None:
        n = 0
        while not stop.is_set():
            sid, ok = serve(workers[k], f"w{k}-{n}")  # new sessions only: balanced each time
            with lock:
                log.append((time.monotonic(), k, sid, ok))
            n += 1
            time.sleep(0.005)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    killed_at = time.monotonic()
    replicas["r1"].kill()
    p = invariants.prefix("h")
    while r.zscore(p + "ejected", "r1") is None:
        assert time.monotonic() - killed_at < 5, "never ejected"
        time.sleep(0.002)
    ejected_at = time.monotonic()
    replicas["r1"].start()  # back up before its ejection ends
    while time.monotonic() - ejected_at < 2.0:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    failed = [e for e in log if e[2] == "r1" and not e[3]]
    # Every worker stopped sending to r1 at once: no more failures than the threshold plus
    # the requests that were already on their way (one per other worker).
    assert 3 <= len(failed) <= 3 + len(workers) - 1, failed
    later = [e for e in log if e[0] > ejected_at + 0.01 and e[2] == "r1"]
    assert later, "r1 never came back"
    back_after = later[0][0] - ejected_at
    assert 1.0 - 0.05 <= back_after < 1.8, back_after
    during = [e for e in log if ejected_at + 0.01 < e[0] < ejected_at + 0.95 and e[2] == "r1"]
    assert during == [], "a worker reached r1 while it was ejected"
    status = workers[0].get_status()["replicas"]["r1"]
    assert status["failures"] == len(failed) and status["ejections_in_a_row"] == 1
    print(
        f"\nr1 killed: ejected for all 4 workers {(ejected_at - killed_at) * 1000:.0f} ms later "
        f"after {len(failed)} failed requests (threshold 3); back {back_after:.2f} s after "
        "its ejection (eject_for 1 s)"
    )
    invariants.check(r, "h")


def test_the_health_command_ejects_a_dead_replica_and_it_returns(make_lb, r, replicas, server):
    meta = {sid: {"url": rep.url} for sid, rep in replicas.items()}
    lb = make_lb(meta, name="a", **EJECT)
    lb.acquire("pins-the-settings").release()
    command = ["health", "--redis", server.url, "--name", "a", "--interval", "0.1"]
    checker = subprocess.Popen(
        [sys.executable, "-m", "redis_router", *command, "--timeout", "0.5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.3)
        replicas["r2"].kill()
        killed_at = time.monotonic()
        p = invariants.prefix("a")
        while r.zscore(p + "ejected", "r2") is None:
            assert time.monotonic() - killed_at < 5, "never ejected"
            time.sleep(0.01)
        ejected_after = time.monotonic() - killed_at
        why = lb.get_status()["replicas"]["r2"]["ejected_why"]
        assert why.startswith("3 failed health checks")
        assert {lb.acquire(f"s{i}").server_id for i in range(12)} == {"r0", "r1"}
        replicas["r2"].start()
        while r.zscore(p + "ejected", "r2") is not None:
            assert time.monotonic() - killed_at < 10, "never restored"
            time.sleep(0.01)
        back_after = time.monotonic() - killed_at - ejected_after
    finally:
        checker.kill()  # the checker this test started
        out, _ = checker.communicate()
    assert "r2: ejected until" in out
    assert "r2" in r.zrange(p + "load", 0, -1)
    # about 3 probe rounds (0.1 s apart) to eject; restored when eject_for (1 s) ends
    assert ejected_after < 2.0 and 0.9 <= back_after < 2.0
    print(
        f"\nhealth command: ejected {ejected_after:.2f} s after the kill, back {back_after:.2f} s"
    )
    invariants.check(r, "a")


def test_the_health_command_once_reports_each_replica(make_lb, replicas, server, capsys):
    meta = {sid: {"health_url": rep.url + "/health"} for sid, rep in replicas.items()}
    make_lb(meta, name="once")
    replicas["r0"].kill()
    assert cli(["health", "--redis", server.url, "--name", "once", "--once"]) == 0
    out = capsys.readouterr().out
    assert "ejection is off" in out
    assert "r0: failing" in out and "r1: ok" in out and "r2: ok" in out


def test_never_more_than_the_share_of_the_pool_is_ejected(make_lb, r):
    lb = make_lb({f"r{i}": None for i in range(4)}, eject_after=1, max_ejected=0.5)
    for sid in ("r0", "r1", "r2", "r3"):
        _on(lb, sid).fail()
    p = invariants.prefix(lb.name)
    assert set(r.zrange(p + "ejected", 0, -1)) == {"r0", "r1"}
    assert r.hget(p + "fails", "r2") == "1"  # its streak waits for room
    invariants.check(r, lb.name)


def test_a_success_ends_the_streak(make_lb, r):
    lb = make_lb({"a": None, "b": None}, eject_after=3)
    p = invariants.prefix(lb.name)
    for succeeded in (False, False, True, False, False):
        lease = _on(lb, "a")
        lease.release() if succeeded else lease.fail()
    assert r.zscore(p + "ejected", "a") is None
    assert r.hget(p + "fails", "a") == "2"
    _on(lb, "a").fail()
    assert r.zscore(p + "ejected", "a") is not None
    invariants.check(r, lb.name)


def _on(lb: RedisLoadBalancer, sid: str):
    """A lease on replica sid (others drained for the moment)."""
    others = [s for s in lb.get_all_servers() if s != sid]
    lb.drain_servers(others)
    try:
        return lb.acquire(f"on-{sid}-{time.monotonic_ns()}")
    finally:
        lb.undrain_servers(others)


def test_ejection_time_grows_with_repeated_ejections_up_to_the_cap(make_lb, r):
    lb = make_lb({"a": None, "b": None}, eject_after=1, eject_for=0.2, eject_max=0.5)
    p = invariants.prefix(lb.name)
    lengths = []
    for _ in range(4):
        lease = _on(lb, "a")
        before = int(r.time()[0]) * 1000 + int(r.time()[1]) // 1000
        lease.fail()
        until = float(r.zscore(p + "ejected", "a"))
        lengths.append(round((until - before) / 100) / 10)
        while r.zscore(p + "ejected", "a") is not None:
            lb.acquire_server(f"tick{time.monotonic_ns()}")  # an acquire ends a due ejection
            time.sleep(0.02)
    assert lengths == [0.2, 0.4, 0.5, 0.5]
    invariants.check(r, lb.name)


def test_an_ejected_replicas_sticky_session_moves(make_lb, r):
    lb = make_lb({"a": None, "b": None}, eject_after=1)
    first = _on(lb, "a")
    rid = first.request_id
    first.fail()
    turn = lb.acquire(rid)
    assert turn.server_id == "b" and not turn.sticky
    invariants.check(r, lb.name)


def test_release_server_with_failed_reports_the_failure(make_lb, r):
    lb = make_lb({"a": None, "b": None}, eject_after=2)
    lease = _on(lb, "a")
    assert lb.release_server("a", lease.request_id, failed=True)
    p = invariants.prefix(lb.name)
    assert r.hget(p + "fails", "a") == "1" and r.hget(p + "failures", "a") == "1"
    assert lb.get_status()["replicas"]["a"]["failures_in_a_row"] == 1


def test_a_resent_failed_release_counts_once(make_lb, r):
    lb = make_lb({"a": None, "b": None}, eject_after=2)
    lease = _on(lb, "a")
    call = Call(load("release"), ("a", "", lease.token, "!op-1"))
    assert lb._exec(call) == [lease.token]
    assert lb._exec(call) == [1]  # the resent copy reports the first one's result
    p = invariants.prefix(lb.name)
    assert r.hget(p + "fails", "a") == "1" and r.zscore(p + "ejected", "a") is None


def test_ejection_settings_are_pinned_for_every_process(make_lb):
    lb = make_lb({"a": None}, eject_after=3)
    lb.acquire("x")
    with pytest.raises(ConfigMismatch, match="eject_after=3, eject_for=30s"):
        make_lb(name=lb.name, eject_after=5)


def test_bad_health_options_are_refused_before_anything_is_written(make_lb, r):
    with pytest.raises(ValueError, match="eject_after"):
        make_lb({"a": None}, eject_after=0)
    with pytest.raises(TypeError, match="eject_after"):
        make_lb({"a": None}, eject_after=2.5)
    with pytest.raises(ValueError, match="max_ejected"):
        make_lb({"a": None}, eject_after=2, max_ejected=1.5)
    with pytest.raises(ValueError, match="eject_max"):
        make_lb({"a": None}, eject_after=2, eject_for=10, eject_max=5)
    assert r.keys("*") == []
    lb = make_lb({"a": None})
    with pytest.raises(TypeError, match="failed"):
        lb.release_server("a", failed="yes")


def test_async_fail_ejects_as_the_sync_one(server, r):
    import asyncio

    from redis_router import AsyncRedisLoadBalancer

    async def main() -> set[str]:
        lb2 = AsyncRedisLoadBalancer(
            {"a": None, "b": None}, redis=server.url, name="af", eject_after=2
        )
        await lb2.drain_servers(["b"])
        for i in range(2):
            lease = await lb2.acquire(f"x{i}")
            await lease.fail()
        await lb2.undrain_servers(["b"])
        got = {(await lb2.acquire_server(f"y{i}"))[0] for i in range(4)}
        await lb2.close()
        return got

    assert asyncio.run(main()) == {"b"}
    assert r.zscore(invariants.prefix("af") + "ejected", "a") is not None


def test_with_ejected_sticky_wait_a_session_waits_for_its_replica(make_lb, r):
    lb = make_lb({"a": None, "b": None}, eject_after=1, eject_for=0.5, ejected_sticky="wait")
    lb.drain_servers(["b"])
    lb.acquire("chat").release()  # pinned to a
    lb.undrain_servers(["b"])
    _on(lb, "a").fail()  # a ejected for 0.5 s
    before = invariants.check(r, lb.name)
    with pytest.raises(ReplicaEjected) as refused:
        lb.acquire("chat")
    assert refused.value.server_id == "a" and 0 < refused.value.seconds_left <= 0.5
    with pytest.raises(ReplicaEjected):
        lb.acquire_many(["fresh", "chat"])  # a batch is refused whole, before any write
    assert invariants.check(r, lb.name) == before
    assert lb.acquire("fresh").server_id == "b"  # new sessions go elsewhere meanwhile
    started = time.monotonic()
    turn = lb.acquire("chat", wait=3)
    waited = time.monotonic() - started
    assert turn.server_id == "a" and turn.sticky
    assert 0.3 <= waited < 2.0, waited
    with pytest.raises(ReplicaEjected, match="for 0"):
        _on(lb, "a").fail()
        lb.acquire("chat", wait=0.1)  # ejected again (1 s now); waiting 0.1 s is not enough
    invariants.check(r, lb.name)


def test_async_sticky_session_waits_for_its_ejected_replica(server, r):
    import asyncio

    from redis_router import AsyncRedisLoadBalancer

    async def main() -> tuple[str, float]:
        lb = AsyncRedisLoadBalancer(
            {"a": None, "b": None},
            redis=server.url,
            name="aw",
            eject_after=1,
            eject_for=0.4,
            ejected_sticky="wait",
        )
        await lb.drain_servers(["b"])
        await (await lb.acquire("chat")).release()
        lease = await lb.acquire("other")
        await lb.undrain_servers(["b"])
        await lease.fail()
        started = time.monotonic()
        turn = await lb.acquire("chat", wait=3)
        waited = time.monotonic() - started
        await turn.release()
        await lb.close()
        return turn.server_id, waited

    sid, waited = asyncio.run(main())
    assert sid == "a" and 0.25 <= waited < 2.0, waited
    invariants.check(r, "aw")


def test_ejected_sticky_must_be_move_or_wait(make_lb, r):
    with pytest.raises(ValueError, match="ejected_sticky"):
        make_lb({"a": None}, eject_after=1, ejected_sticky="stay")
    assert r.keys("*") == []
