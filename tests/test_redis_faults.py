"""Faults the Redis server itself goes through: a stall (SIGSTOP), CLIENT PAUSE, an
out-of-memory spell that refuses heartbeats, a restart from persistence. Liveness is judged on
the time Redis could hear heartbeats, so none of them reclaims the leases of live processes,
and a process that died while Redis listened is still reclaimed."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer
from redis_router.local_server import LocalServer, ServerBinary
from redis_router.scripts import load

from . import invariants
from .conftest import own_server

SERVERS = {"s0": "a", "s1": "b"}


@pytest.fixture
def private(binary: ServerBinary) -> Iterator[LocalServer]:
    """A server of this binary of the test's own (it will be stopped, paused or restarted),
    persistent (AOF fsynced on every write) so that a restart keeps every key."""
    with own_server(binary, persistent=True) as srv:
        yield srv


@contextlib.contextmanager
def stopped(server: LocalServer, seconds: float) -> Iterator[None]:
    """The server process stopped (SIGSTOP) for ``seconds``, then continued."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def _poll(check: Callable[[], bool], limit: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < limit, f"not within {limit:g}s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def _raw(server: LocalServer) -> redis.Redis:
    return invariants.settled(server.client(decode_responses=True))


def _two_live_holders(server: LocalServer, ttl: float) -> tuple[RedisLoadBalancer, ...]:
    a = RedisLoadBalancer(SERVERS, redis=server.url, name="faults", lease_ttl=ttl)
    b = RedisLoadBalancer(redis=server.url, name="faults", lease_ttl=ttl)
    a.acquire_server("ra")
    b.acquire_server("rb")
    return a, b


def _settle(ttl: float) -> None:
    """Long enough for any reaping a pause could cause: the probation (half the ttl) and a few
    heartbeat periods after it."""
    time.sleep(ttl * 1.5)


def test_a_stall_longer_than_lease_ttl_reclaims_no_live_lease(private):
    ttl = 1.0
    a, b = _two_live_holders(private, ttl)
    try:
        with stopped(private, 2.5 * ttl):
            pass
        _settle(ttl)
        assert a.get_total_inflight() == 2
        assert invariants.check(_raw(private), "faults") == {"s0": 1, "s1": 1}
        assert a.release_server(a.request_owner("ra") or "", "ra")
        assert b.release_server(b.request_owner("rb") or "", "rb")
        assert invariants.check(_raw(private), "faults") == {"s0": 0, "s1": 0}
    finally:
        a.close()
        b.close()


def test_a_holder_dead_before_the_stall_is_still_reclaimed(private):
    ttl = 1.0
    a, b = _two_live_holders(private, ttl)
    dead = RedisLoadBalancer(redis=private.url, name="faults", lease_ttl=ttl)
    try:
        dead.acquire_many(["d1", "d2"])
        invariants.silence(dead)  # its heartbeats stop, as if the process had died
        # Reclaimed while Redis listens (the live keepers beat meanwhile) ...
        _poll(lambda: a.get_total_inflight() == 2, 10 * ttl, "the dead holder reclaimed")
        # ... and a stall afterwards changes nothing for the living.
        with stopped(private, 2.5 * ttl):
            pass
        _settle(ttl)
        assert invariants.check(_raw(private), "faults") == {"s0": 1, "s1": 1}
    finally:
        for lb in (a, b, dead):
            lb.close()


@pytest.mark.slow
def test_a_holder_that_dies_during_the_stall_is_reclaimed_after_its_probation(private):
    ttl = 1.0
    a, b = _two_live_holders(private, ttl)
    dead = RedisLoadBalancer(redis=private.url, name="faults", lease_ttl=ttl)
    try:
        dead.acquire_many(["d1", "d2"])
        with stopped(private, 2.5 * ttl):
            invariants.silence(dead)
        started = time.monotonic()
        _poll(lambda: a.get_total_inflight() == 2, 10 * ttl, "the dead holder reclaimed")
        # Not before the probation after the stall (half the ttl) has passed.
        assert time.monotonic() - started >= ttl / 2 - 0.2
        assert invariants.check(_raw(private), "faults") == {"s0": 1, "s1": 1}
    finally:
        for lb in (a, b, dead):
            lb.close()


def test_client_pause_write_longer_than_lease_ttl_reclaims_no_live_lease(private):
    ttl = 1.0
    a, b = _two_live_holders(private, ttl)
    pauser = _raw(private)
    try:
        pauser.execute_command("CLIENT", "PAUSE", int(2.5 * ttl * 1000), "WRITE")
        time.sleep(2.5 * ttl + 0.1)
        _settle(ttl)
        assert invariants.check(_raw(private), "faults") == {"s0": 1, "s1": 1}
        assert a.release_server(a.request_owner("ra") or "", "ra")
        assert b.release_server(b.request_owner("rb") or "", "rb")
    finally:
        pauser.execute_command("CLIENT", "UNPAUSE")
        a.close()
        b.close()


def test_an_out_of_memory_spell_that_refuses_heartbeats_reclaims_no_live_lease(private):
    ttl = 1.0
    a, b = _two_live_holders(private, ttl)
    r = _raw(private)
    try:
        with out_of_memory(r):
            with pytest.raises(redis.exceptions.ResponseError, match=r"OOM|maxmemory"):
                beat = a._core.heartbeat_args("x", lease_ms=1000)
                r.eval(load("heartbeat").source, 1, invariants.prefix("faults"), *beat)
            time.sleep(2.5 * ttl)
        _settle(ttl)
        assert invariants.check(r, "faults") == {"s0": 1, "s1": 1}
        assert a.release_server(a.request_owner("ra") or "", "ra")
        assert b.release_server(b.request_owner("rb") or "", "rb")
    finally:
        a.close()
        b.close()


def test_a_persistent_restart_longer_than_lease_ttl_reclaims_no_live_lease(private):
    ttl = 1.0
    a, b = _two_live_holders(private, ttl)
    try:
        private.stop()
        time.sleep(2.5 * ttl)
        private.start()
        _settle(ttl)
        assert invariants.check(_raw(private), "faults") == {"s0": 1, "s1": 1}
        assert a.release_server(a.request_owner("ra") or "", "ra")
        assert b.release_server(b.request_owner("rb") or "", "rb")
    finally:
        a.close()
        b.close()


def test_asyncio_holders_survive_a_stall(private):
    import asyncio

    ttl = 1.0

    async def main() -> None:
        a = AsyncRedisLoadBalancer(SERVERS, redis=private.url, name="faults", lease_ttl=ttl)
        b = AsyncRedisLoadBalancer(redis=private.url, name="faults", lease_ttl=ttl)
        try:
            await a.acquire_server("ra")
            await b.acquire_server("rb")
            assert private.pid is not None
            os.kill(private.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5 * ttl)
            finally:
                os.kill(private.pid, signal.SIGCONT)
            await asyncio.sleep(1.5 * ttl)
            assert await a.get_total_inflight() == 2
            assert await b.release_server(await b.request_owner("rb") or "", "rb")
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
    assert sum(invariants.check(_raw(private), "faults").values()) == 0  # closed: all let go


HOLD_ALL = """
import sys, time
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer(redis=sys.argv[1], name="faults", lease_ttl=float(sys.argv[2]))
lb.acquire_many(["d0", "d1"])
print("held", flush=True)
time.sleep(120)
"""


def test_a_restarted_worker_is_not_refused_because_of_its_dead_predecessor(private):
    """Capacities set, a worker SIGKILLed holding every place, a new process later: its first
    acquire reclaims the dead places (after the probation a silence of Redis gives) instead
    of raising NoCapacity on an idle pool."""
    ttl = 1.0
    admin = RedisLoadBalancer(
        {"s0": {"url": "a", "capacity": 1}, "s1": {"url": "b", "capacity": 1}},
        redis=private.url,
        name="faults",
        lease_ttl=ttl,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_ALL, private.url, str(ttl)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        proc.kill()
        proc.wait()
        time.sleep(3 * ttl)  # longer than lease_ttl: nobody listened meanwhile
        fresh = RedisLoadBalancer(redis=private.url, name="faults", lease_ttl=ttl)
        try:
            sid, _ = fresh.acquire_server("first")  # wait_timeout 0: no queueing
            assert sid in ("s0", "s1")
            assert invariants.check(_raw(private), "faults")[sid] == 1
        finally:
            fresh.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        admin.close()


def _evict_the_lease_records(r: redis.Redis, name: str) -> None:
    """Real eviction under allkeys-lru of the balancer's lease records alone: they are the
    least recently used key (written first, then ballast, then every other key touched), and
    memory is set just below what is used."""
    p = invariants.prefix(name)
    time.sleep(2.1)  # the LRU clock ticks in seconds: two ticks apart on a loaded machine
    for i in range(20):
        r.set(f"ballast:{i}", "x" * 20_000)
    time.sleep(2.1)
    r.touch(*[k for k in r.keys(p + "*") if k != p + "leases"])
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-samples", "64")
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory", str(used - 30_000))
    r.set("trigger", "1")  # a write: the server evicts now
    r.config_set("maxmemory", "0")
    gone = [k for k in ("servers", "load", "held:s0", "held:s1") if not r.exists(p + k)]
    assert not r.exists(p + "leases") and not gone, f"eviction took other keys: {gone}"


def test_an_evicting_policy_is_reported_once_and_the_counts_it_broke_heal(private, caplog):
    r = _raw(private)
    # A keeper beats every lease_ttl / 4 and reads the policy at its first beat: this one's
    # comes long after the test (however slow the machine), so only the healer reports it.
    lb = RedisLoadBalancer(SERVERS, redis=private.url, name="faults", lease_ttl=600.0)
    lb.acquire_many([f"x{i}" for i in range(4)])
    _evict_the_lease_records(r, "faults")
    assert r.zscore(invariants.prefix("faults") + "load", "s0") == 2  # counted, no lease
    with caplog.at_level(logging.ERROR, logger="redis_router"):
        healer = RedisLoadBalancer(redis=private.url, name="faults", lease_ttl=0.4)
        try:
            healer.acquire_server("h")  # its keeper: heartbeats, reconcile and heal
            _poll(
                lambda: _counted(r, "faults") == 1,
                10.0,
                "counts repaired to the one lease left",
            )
            healer.release_server(healer.request_owner("h") or "", "h")
        finally:
            healer.close()
    assert caplog.text.count("maxmemory-policy allkeys-lru") == 1  # once per balancer
    assert "repaired" in caplog.text
    # The evicted leases' own process finds nothing to release, and nothing is left counted.
    assert not lb.release_server("s0", "x0")
    lb._run(lb._core.heal())  # its own lease set: entries of lost records leave
    assert invariants.check(r, "faults") == {"s0": 0, "s1": 0}
    lb.close()


def _counted(r: redis.Redis, name: str) -> int:
    """The sum of the replicas' in-flight counts, as the pool's sorted sets hold them."""
    p = invariants.prefix(name)
    return sum(
        int(c)
        for zs in ("load", "draining", "off")
        for _, c in r.zrange(p + zs, 0, -1, withscores=True)
    )


@pytest.mark.slow
def test_default_settings_a_25_second_stall_keeps_the_living_and_frees_the_dead() -> None:
    """Measured once, on the first server binary, with the default lease_ttl (20 s): a process
    SIGKILLed just before a 25 s SIGSTOP of the server is reclaimed after the probation the
    stall gives (half the lease ttl after Redis resumes), a live one keeps its leases."""
    from redis_router.core import OPTION_DEFAULTS
    from redis_router.local_server import first_server_binary

    binary = first_server_binary()
    assert binary is not None and OPTION_DEFAULTS["lease_ttl"] == 20.0
    with LocalServer(binary) as srv, RedisLoadBalancer(SERVERS, redis=srv.url, name="d") as lb:
        lb.acquire_server("live")
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_ALL.replace('"faults"', '"d"'), srv.url, "20.0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        finally:
            proc.kill()
            proc.wait()
        assert lb.get_total_inflight() == 3
        with stopped(srv, 25.0):
            pass
        resumed = time.monotonic()
        took = _poll(lambda: lb.get_total_inflight() == 1, 40.0, "the dead process reclaimed")
        print(f"\n25 s stall, defaults: the dead process reclaimed {took:.1f} s after the server "
              "resumed; the live lease kept")  # fmt: skip
        assert took >= 10.0 - 0.5  # not before its probation (lease_ttl / 2) ended
        assert lb.request_owner("live") is not None
        assert time.monotonic() - resumed < 40.0


@contextlib.contextmanager
def out_of_memory(r: redis.Redis) -> Iterator[None]:
    """noeviction and a maxmemory below what the server uses: every write that may need
    memory (every script that writes, heartbeats included) is refused with OOM until the
    limit is lifted."""
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(used // 2))
    try:
        yield
    finally:
        r.config_set("maxmemory", "0")


def test_an_out_of_memory_spell_is_logged_once_and_close_does_not_raise(
    private, caplog, monkeypatch
):
    # By EVALSHA, which refuses every writing script over maxmemory (a heartbeat loaded as a
    # function is allowed to run there: it keeps its holder alive and frees what it reaps).
    monkeypatch.setenv("REDIS_ROUTER_SCRIPTS", "eval")
    ttl = 0.4
    r = _raw(private)
    a = RedisLoadBalancer(SERVERS, redis=private.url, name="faults", lease_ttl=ttl)
    b = RedisLoadBalancer(redis=private.url, name="faults", lease_ttl=ttl)
    a.acquire_server("ra")
    b.acquire_server("rb")
    with caplog.at_level(logging.DEBUG, logger="redis_router"), out_of_memory(r):
        time.sleep(20 * ttl / 4)  # some 20 heartbeats refused
        b.close()  # its leases go once their deadline passes: no exception
    warned = [
        x for x in caplog.records if x.levelno >= logging.WARNING and x.name == "redis_router"
    ]
    failed = [x for x in warned if "heartbeat failed" in x.getMessage()]
    # Some 20 refused beats each: one line per balancer for the whole spell.
    assert len(failed) == 2, [x.getMessage() for x in warned]
    assert sum("failed again" in x.getMessage() for x in caplog.records) >= 10
    _poll(lambda: any("reach Redis again" in x.getMessage() for x in caplog.records), 5.0,
          "the recovery logged")  # fmt: skip
    _poll(lambda: _counted(r, "faults") == 1, 10 * ttl, "b's lease reclaimed after close")
    assert invariants.check(r, "faults") == {**dict.fromkeys(SERVERS, 0),
                                             a.request_owner("ra") or "": 1}  # fmt: skip
    a.close()
