"""Liveness decides a lease's life: a live process's leases never expire however long its
requests run; a dead process's are reclaimed about lease_ttl after its last heartbeat; a
lease its process forgot ends after max_lease_age."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, RedisUnavailable, core
from redis_router.core import HEARTBEATS_PER_TTL, OPTION_DEFAULTS, REAP_CHUNK
from redis_router.local_server import LocalServer, first_server_binary
from redis_router.scripts import load

from . import invariants

SERVERS = {"s0": "a", "s1": "b"}
NO_HOLDERS = {
    "live": 0,
    "dead": 0,
    "awaiting_reclaim": 0,
    "unheard": 0,
    "on_probation": 0,
    "probation_ms": 0,
    "unheard_leases": 0,
    "unheard_ms": 0,
    "probation_running": False,
}

HOLDER = """
import sys, time
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer(redis=sys.argv[1], name=sys.argv[2], lease_ttl=float(sys.argv[4]))
for i in range(int(sys.argv[3])):
    lb.acquire_server(f"doomed-{i}")
print("held", flush=True)
time.sleep(120)
"""


def _hold_in_a_process(url: str, name: str, n: int, lease_ttl: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, name, str(n), str(lease_ttl)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _seconds_until_idle(lb: RedisLoadBalancer, limit: float) -> float:
    started = time.monotonic()
    while lb.get_total_inflight() > 0:
        assert time.monotonic() - started < limit, f"still {lb.get_total_inflight()} in flight"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_request_longer_than_lease_ttl_stays_counted(make_lb, r):
    lb = make_lb(SERVERS, lease_ttl=0.4)
    other = make_lb(name=lb.name, lease_ttl=0.4)  # another process's traffic reaps dead holders
    lease = lb.acquire("long-generation")
    for i in range(10):  # 2 s: five times lease_ttl
        time.sleep(0.2)
        other.release_server(*other.acquire_server(f"short-{i}")[:1], f"short-{i}")
        assert other.reap() == 0
        assert lb.get_inflight_count(lease.server_id) == 1
    assert lease.release()
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_asyncio_balancer_keeps_its_leases_alive(server, r):
    async def main() -> None:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="alive", lease_ttl=0.4)
        reaper = RedisLoadBalancer(redis=server.url, name="alive", lease_ttl=0.4)
        async with lb.lease("long") as lease:
            for _ in range(8):
                await asyncio.sleep(0.25)
                assert reaper.reap() == 0
                assert await lb.get_inflight_count(lease.server_id) == 1
        assert await lb.get_total_inflight() == 0
        reaper.close()
        await lb.close()

    asyncio.run(main())
    invariants.check(r, "alive")


def test_sigkilled_process_is_freed_within_lease_ttl(make_lb, server, r):
    lb = make_lb(SERVERS, lease_ttl=1.0)
    lb.release_server(*lb.acquire_server("warm")[:1], "warm")  # its keeper runs from now on
    proc = _hold_in_a_process(server.url, lb.name, 25, 1.0)
    try:
        assert lb.get_total_inflight() == 25
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
    finally:
        proc.kill()
        proc.wait()
    # No explicit reap and no traffic: the living process's heartbeats reclaim them. Bound:
    # lease_ttl after the last heartbeat, plus one heartbeat period of the reclaimer, plus slack.
    waited = _seconds_until_idle(lb, 1.0 + 2 * 1.0 / HEARTBEATS_PER_TTL + 2.0)
    print(f"reclaimed 25 leases {time.monotonic() - killed:.2f} s after SIGKILL ({waited:.2f})")
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}
    assert sum(v["reclaimed"] for v in lb.get_status()["replicas"].values()) == 25


@pytest.mark.slow
def test_default_settings_free_a_sigkilled_process_within_30_seconds() -> None:
    """Measured once, on the first server binary: it takes about 25 s."""
    binary = first_server_binary()
    assert binary is not None and OPTION_DEFAULTS["lease_ttl"] == 20.0
    with LocalServer(binary) as srv, RedisLoadBalancer(SERVERS, redis=srv.url, name="d") as lb:
        lb.release_server(*lb.acquire_server("warm")[:1], "warm")
        proc = _hold_in_a_process(srv.url, lb.name, 10, OPTION_DEFAULTS["lease_ttl"])
        try:
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
        finally:
            proc.kill()
            proc.wait()
        _seconds_until_idle(lb, 30.0)
        print(f"default settings: reclaimed {time.monotonic() - killed:.1f} s after SIGKILL")


def test_acquires_reap_nothing_and_reaping_calls_are_bounded(make_lb, r):
    servers = {f"s{i}": None for i in range(400)}
    lb = make_lb(servers, lease_ttl=5.0)
    dead = make_lb(name=lb.name, lease_ttl=0.2)
    dead.acquire_many([f"d{i}" for i in range(400)])  # one on every replica
    invariants.silence(dead)  # the process stops sending heartbeats (as if it hung or died)
    time.sleep(0.4)
    before = _commands(r)
    lb.acquire_server("fresh")  # pays nothing for the crash: no reaping on the hot path
    assert _commands(r) - before <= 30
    assert lb.get_total_inflight() == 401
    # Redis heard heartbeats all along (no pause: the dead holder is dead, not on probation).
    secs, micros = r.time()
    clock = invariants.prefix(lb.name) + "clock"
    r.hset(clock, "heard", secs * 1000 + micros // 1000)
    r.hdel(clock, "since", "till")
    reclaimed, examined, limbo, _ = r.eval(
        load("reap").source, 1, invariants.prefix(lb.name), REAP_CHUNK, 30000, 200
    )
    assert int(limbo) == 0
    assert examined == REAP_CHUNK and reclaimed == REAP_CHUNK - 1  # the holder, then leases
    assert lb.reap() == 400 - reclaimed  # call after call, each as short
    assert sum(invariants.check(r, lb.name).values()) == 1  # only "fresh" is left


def _commands(r: redis.Redis) -> int:
    """Commands the server has run (scripts' own calls included), from INFO commandstats."""
    stats = r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def test_a_forgotten_lease_ends_after_max_lease_age(make_lb, r, caplog):
    lb = make_lb(SERVERS, lease_ttl=0.2, max_lease_age=0.5)
    forgotten = lb.acquire("forgotten")
    with caplog.at_level(logging.WARNING, logger="redis_router"):
        _seconds_until_idle(lb, 0.5 + 2 * 0.2 + 1.0)
        time.sleep(0.1)
    assert "max_lease_age" in caplog.text and forgotten.token in caplog.text
    assert not forgotten.release()
    assert sum(v["reclaimed"] for v in lb.get_status()["replicas"].values()) == 1
    invariants.check(r, lb.name)


def test_closing_a_balancer_lets_its_leases_go_at_once(make_lb, r):
    lb = make_lb(SERVERS, lease_ttl=60.0)
    other = make_lb(name=lb.name)
    lb.acquire_many(["a", "b", "c"])
    lb.close()
    assert other.get_total_inflight() == 0  # ended by close() itself, not left to a reaper
    assert other.reap() == 0
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}
    assert other.get_status()["holders"] == NO_HOLDERS


def test_status_shows_live_and_dead_holders(make_lb, r):
    watcher = make_lb(SERVERS, lease_ttl=0.2)  # only reads: no keeper, so it reaps nothing
    holder = make_lb(name=watcher.name, lease_ttl=0.2)
    holder.acquire_many(["y", "z"])
    assert watcher.get_status()["holders"] == {**NO_HOLDERS, "live": 1}
    holder._keeper.stop()  # as if the process hung
    time.sleep(0.4)
    # Nobody was heard since: Redis itself may have been paused, so it is on probation,
    # shown as unheard (not live), with its leases and how long since it was heard.
    seen = watcher.get_status()["holders"]
    assert (seen["live"], seen["unheard"], seen["dead"]) == (0, 1, 0), seen
    assert seen["on_probation"] == 1 and seen["unheard_leases"] == 2
    assert seen["unheard_ms"] >= 350  # slept 0.4 s since it was last heard (ms rounding)
    # Another process's heartbeats (reaping nothing: budget 0) are heard past the probation.
    listener = watcher._core.heartbeat_args(lease_ms=200, budget=0)
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        r.eval(load("heartbeat").source, 1, invariants.prefix(watcher.name), *listener)
        time.sleep(0.02)
    assert watcher.get_status()["holders"] == {
        **NO_HOLDERS,
        "live": 1,
        "dead": 1,
        "awaiting_reclaim": 2,
    }


FORKED = """
import os, sys, time
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer({"s0": "a"}, redis=sys.argv[1], name=sys.argv[2], lease_ttl=0.3)
lb.acquire_server("parent")
pid = os.fork()
if pid == 0:
    lb.acquire_server("child")
    print(lb._core.holder, flush=True)
    time.sleep(1.5)  # the child lives on, its keeper beating; the parent exits at once
    print(lb.get_inflight_count("s0"), flush=True)
    os._exit(0)
print(lb._core.holder, flush=True)
os._exit(0)  # dies without closing: its lease goes after lease_ttl
"""


def test_a_forked_child_holds_its_leases_under_its_own_holder(server, r):
    out = subprocess.run(
        [sys.executable, "-c", FORKED, server.url, "forked"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    holders, count = out[:2], out[2]
    assert len(set(holders)) == 2, out
    assert count == "1", out  # the parent's lease was reclaimed; the child's lives on


def _raw_state(server: Any, name: str) -> dict[bytes, bytes]:
    with server.client() as raw:
        return {k: raw.dump(k) for k in raw.keys(invariants.prefix(name).encode() + b"*")}


def _restore(server: Any, state: dict[bytes, bytes]) -> None:
    with server.client() as raw:
        for k, v in state.items():
            raw.restore(k, 0, v, replace=True)


def test_a_release_lost_in_a_failover_is_ended_by_reconciling(make_lb, server, r, monkeypatch):
    monkeypatch.setattr(core, "RECONCILE_GRACE_MS", 200)
    lb = make_lb(SERVERS, lease_ttl=30.0)
    kept, lost = lb.acquire("kept"), lb.acquire("lost")
    before_release = _raw_state(server, lb.name)
    assert lost.release()
    _restore(server, before_release)  # the new master never saw the release (async replication)
    assert lb.get_total_inflight() == 2  # counted, though nobody holds it
    time.sleep(0.3)
    assert lb._run(lb._core.reconcile()) == 1  # what the keeper runs once per lease_ttl
    assert lb.get_total_inflight() == 1 and kept.release()  # the lease still held stays
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_a_release_that_failed_in_an_outage_is_ended_by_reconciling(make_lb, r, monkeypatch):
    monkeypatch.setattr(core, "RECONCILE_GRACE_MS", 200)
    lb = make_lb(SERVERS, lease_ttl=30.0)
    lease = lb.acquire("x")
    real_send = lb._send
    lb._outbox = None  # the release takes the ordinary path, where the test drops it

    def dropped(call: Any) -> Any:
        raise redis.exceptions.ConnectionError("injected: connection dropped")

    monkeypatch.setattr(lb, "_send", dropped)
    with pytest.raises(RedisUnavailable):
        lease.release()  # the caller gives up; Redis still counts the lease
    assert lb._core.releasing == set()  # no longer on its way: reconciling may end it
    monkeypatch.setattr(lb, "_send", real_send)
    assert lb.get_total_inflight() == 1
    assert lb._run(lb._core.reconcile()) == 0  # younger than the grace: left alone
    time.sleep(0.3)
    assert lb._run(lb._core.reconcile()) == 1
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_reconciling_never_ends_a_lease_the_process_holds(make_lb, r, monkeypatch):
    monkeypatch.setattr(core, "RECONCILE_GRACE_MS", 100)
    lb = make_lb(SERVERS, lease_ttl=0.2)
    leases = [lb.acquire(f"held-{i}") for i in range(5)]
    by_request = lb.acquire_server("by-request")
    time.sleep(0.8)  # several heartbeats, each fourth of them reconciling
    assert lb._run(lb._core.reconcile()) == 0
    assert lb.get_total_inflight() == 6
    assert lb.release_server(by_request[0], "by-request")
    assert all(lease.release() for lease in leases)
    assert lb._core.held == {}  # every token the process held is gone from its ledger
    invariants.check(r, lb.name)


def _fails_once(monkeypatch: pytest.MonkeyPatch, lb: Any) -> list[int]:
    """Make the balancer's next heartbeat raise an error no keeper expects; returns the list
    of calls made (the keeper must go on beating after it)."""
    real, calls = lb._core.heartbeat, []

    def heartbeat() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: a bug in one heartbeat")
        return real()

    monkeypatch.setattr(lb._core, "heartbeat", heartbeat)
    return calls


def test_the_thread_keeper_outlives_an_unexpected_error(make_lb, r, monkeypatch, caplog):
    lb = make_lb(SERVERS, lease_ttl=0.4)
    reaper = make_lb(name=lb.name, lease_ttl=0.4)
    lease = lb.acquire("long")
    calls = _fails_once(monkeypatch, lb)
    with caplog.at_level(logging.ERROR, logger="redis_router"):
        time.sleep(1.2)  # three lease_ttl: a stopped keeper's holder would be dead by now
    assert len(calls) >= 3 and "failed unexpectedly" in caplog.text
    assert reaper.reap() == 0 and lb.get_inflight_count(lease.server_id) == 1
    assert lease.release()
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_the_asyncio_keeper_outlives_an_unexpected_error(server, r, monkeypatch, caplog):
    async def main() -> None:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="keeps", lease_ttl=0.4)
        reaper = RedisLoadBalancer(redis=server.url, name="keeps", lease_ttl=0.4)
        try:
            async with lb.lease("long") as lease:
                calls = _fails_once(monkeypatch, lb)
                await asyncio.sleep(1.2)
                assert len(calls) >= 3 and "failed unexpectedly" in caplog.text
                assert reaper.reap() == 0
                assert await lb.get_inflight_count(lease.server_id) == 1
        finally:
            reaper.close()
            await lb.close()

    with caplog.at_level(logging.ERROR, logger="redis_router"):
        asyncio.run(main())
    assert invariants.check(r, "keeps") == {"s0": 0, "s1": 0}


def test_reconciling_tolerates_other_threads_acquiring_and_releasing(make_lb, r, monkeypatch):
    """A sync balancer's keeper reconciles in its own thread while the process's threads
    acquire and release, changing the ledger it compares (a keeper once died of it)."""
    lb = make_lb(SERVERS, lease_ttl=30.0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic(k: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                rid = f"t{k}-{i}"
                lb.release_server(lb.acquire_server(rid)[0], rid)
                i += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=traffic, args=(k,)) for k in range(4)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, as a loaded process does
    try:
        for t in threads:
            t.start()
        for _ in range(20):
            # tokens held locally long ago that Redis no longer has: reconciling forgets them,
            # walking the whole ledger while the other threads change it
            lb._core.held.update((f"gone-{j}", 0.0) for j in range(20_000))
            lb._core.latest.update(((f"s{j}", f"gone-{j}"), f"gone-{j}") for j in range(5_000))
            assert lb._run(lb._core.reconcile()) == 0
            assert not any(t.startswith("gone-") for t in list(lb._core.held))
    finally:
        sys.setswitchinterval(old)
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert lb._core.held == {} and lb._core.latest == {}
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_reconciling_leaves_alone_a_lease_whose_release_is_on_its_way(make_lb, r, monkeypatch):
    """The keeper reconciles after a release took its lease off the ledger but before Redis
    ran it: the lease is not the process's forgotten one, and the release must end it."""
    monkeypatch.setattr(core, "RECONCILE_GRACE_MS", 100)
    lb = make_lb(SERVERS, lease_ttl=30.0)
    sid, _ = lb.acquire_server("long")
    token = lb.acquire("long-too").token
    time.sleep(0.3)  # both older than the grace: reconciling compares them
    real_send, reconciled = lb._send, []
    lb._outbox = None  # the ordinary path, where the test runs reconcile before the release

    def keeper_first(call: Any) -> Any:
        if call.script.name == "release":
            reconciled.append(lb._run(lb._core.reconcile()))
        return real_send(call)

    monkeypatch.setattr(lb, "_send", keeper_first)
    assert lb.release_server(sid, "long")  # by request id: a hint names the lease
    assert lb._run(lb._core.release_many([(sid, None, token)])) == [True]  # by token
    assert reconciled == [0, 0] and lb._core.releasing == set()
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_asyncio_reconciling_leaves_alone_a_coalesced_release_in_flight(server, r, monkeypatch):
    monkeypatch.setattr(core, "RECONCILE_GRACE_MS", 100)

    async def main() -> list[int]:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="inflight") as lb:
            got = await asyncio.gather(*(lb.acquire_server(f"q{i}") for i in range(8)))
            await asyncio.sleep(0.3)
            real_send, reconciled = lb._send, []
            lb._pipe = None  # releases go through _send, where the test runs reconcile first

            async def keeper_first(call: Any) -> Any:
                if call.script.name == "release":
                    reconciled.append(await lb._run(lb._core.reconcile()))
                return await real_send(call)

            monkeypatch.setattr(lb, "_send", keeper_first)
            done = await asyncio.gather(
                *(lb.release_server(sid, f"q{i}") for i, (sid, _) in enumerate(got))
            )
            assert all(done) and lb._core.releasing == set()
            return reconciled

    assert asyncio.run(main()) == [0]  # one coalesced release call
    assert invariants.check(r, "inflight") == {"s0": 0, "s1": 0}


def test_a_holder_declared_dead_is_reported_but_not_after_its_own_destroy(make_lb, r, caplog):
    lb = make_lb(SERVERS, lease_ttl=0.4)
    lb.acquire("x")
    with caplog.at_level(logging.WARNING, logger="redis_router"):
        r.zrem(f"rr:{{{lb.name}}}:holders", lb._core.holder)  # as another keeper's reap would
        time.sleep(0.3)  # a few heartbeats (every 0.1 s)
        assert caplog.text.count("had been declared dead") == 1
        caplog.clear()
        lb.acquire("y")
        assert lb.destroy() > 0
        time.sleep(0.3)
        assert "had been declared dead" not in caplog.text
        assert lb._core.held == {} and lb._core.latest == {}


def test_heartbeats_answered_across_the_processs_own_destroy_report_nothing(make_lb, r):
    """The keeper's heartbeat can run on the server before the destroy and be answered after
    it, or run after it and be answered before the destroy's own reply is read: neither, nor
    the heartbeats after, reports the holder as declared dead."""
    lb = make_lb(SERVERS, lease_ttl=60.0)  # the keeper stays out of the way: beats by hand
    core = lb._core
    lb.acquire("x")

    before = core.heartbeat()  # runs before the destroy, answered after it
    ran_before = lb._exec(next(before))
    destroy = core.destroy()
    destroyed = lb._exec(next(destroy))
    with pytest.raises(StopIteration) as answered:
        before.send(ran_before)
    assert answered.value.value.registered_anew is False

    during = core.heartbeat()  # runs after the destroy, answered before its reply is read
    with pytest.raises(StopIteration) as answered:
        during.send(lb._exec(next(during)))
    assert answered.value.value.registered_anew is False
    with pytest.raises(StopIteration) as done:
        destroy.send(destroyed)
    assert done.value.value > 0

    assert lb._run(core.heartbeat()).registered_anew is False
    r.zrem(f"rr:{{{lb.name}}}:holders", core.holder)  # now as another keeper's reap would
    assert lb._run(core.heartbeat()).registered_anew is True
