"""Leases: counts are leases (I1), nothing leaks (I2), late releases are no-ops (I6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from . import invariants

SERVERS = {"s0": "a", "s1": "b"}


def test_release_ends_that_requests_lease(make_lb, r):
    lb = make_lb(SERVERS)
    sid, _ = lb.acquire_server("x")
    lb.acquire_server("y")
    assert lb.release_server(sid, "x")
    assert not lb.release_server(sid, "x")  # twice: no-op, no negative count
    invariants.check(r, lb.name)
    assert lb.get_total_inflight() == 1


def test_release_without_request_id_ends_the_oldest_lease(make_lb, r):
    lb = make_lb({"only": "a"})
    lb.acquire_server("first")
    time.sleep(0.01)
    lb.acquire_server("second")
    assert lb.release_server("only")
    p = invariants.prefix(lb.name)
    assert [f.split("\x1f")[1] for f in r.hvals(p + "leases")] == ["second"]
    assert lb.release_server("only") and not lb.release_server("only")
    assert invariants.check(r, lb.name) == {"only": 0}


def test_unknown_replica_release_is_a_no_op(make_lb, r):
    lb = make_lb(SERVERS)
    assert not lb.release_server("never-registered", "x")
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_same_request_twice_holds_two_leases(make_lb, r):
    lb = make_lb({"only": "a"})
    a, b = lb.acquire("dup"), lb.acquire("dup")
    assert lb.get_inflight_count("only") == 2
    assert a.release() and not a.release()
    assert lb.get_inflight_count("only") == 1
    assert lb.release_server("only", "dup")
    assert not b.release()  # already ended by request id
    assert invariants.check(r, lb.name) == {"only": 0}


def test_lease_context_manager_releases_exactly_once(make_lb, r):
    lb = make_lb(SERVERS)
    try:
        with lb.lease("ctx") as lease:
            assert lb.get_inflight_count(lease.server_id) == 1
            raise RuntimeError("the request failed")
    except RuntimeError:
        pass
    assert lb.get_total_inflight() == 0
    assert not lease.release()
    invariants.check(r, lb.name)


def test_expired_leases_are_reclaimed_by_reap(make_lb, r):
    lb = make_lb(SERVERS, lease_ttl=0.5)
    for i in range(30):
        lb.acquire_server(f"r{i}")
    assert lb.reap() == 0
    time.sleep(0.6)
    assert lb.reap() == 30
    assert lb.reap() == 0  # each exactly once
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}
    assert lb.get_status()["replicas"]["s0"]["reclaimed"] == 15


def test_expired_leases_are_reclaimed_by_later_calls_in_bounded_steps(make_lb, r):
    lb = make_lb(SERVERS, lease_ttl=0.5)
    for i in range(40):
        lb.acquire_server(f"r{i}")
    time.sleep(0.6)
    lease = lb.acquire("fresh")  # reclaims at most 16 (REAP_BUDGET) before taking its own
    assert lb.get_total_inflight() == 40 - 16 + 1
    assert not lb.release_server("s0", "nobody")  # releases do not reap (acquires do)
    assert lb.get_total_inflight() == 40 - 16 + 1
    lease.release()
    for _ in range(2):
        lb.release_server(lb.acquire_server("fresh")[0], "fresh")
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_renewed_lease_outlives_its_ttl(make_lb, r):
    lb = make_lb(SERVERS, lease_ttl=1.0)
    lease = lb.acquire("long")
    for _ in range(4):  # 1.2 s in all: past the ttl, but never 1 s without a renewal
        time.sleep(0.3)
        assert lease.renew()
    assert lb.reap() == 0 and lb.get_total_inflight() == 1
    time.sleep(1.1)
    assert lb.reap() == 1 and not lease.renew()
    assert not lease.release()  # already reclaimed: no double decrement
    invariants.check(r, lb.name)


def test_lease_renews_itself_while_held(make_lb):
    lb = make_lb(SERVERS, lease_ttl=1.0)
    with lb.lease("long", renew_every=0.25) as lease:
        time.sleep(1.5)
        assert lb.reap() == 0
        assert lb.get_inflight_count(lease.server_id) == 1
    assert lb.get_total_inflight() == 0


def test_retried_acquire_with_same_token_is_not_counted_twice(make_lb, r):
    lb = make_lb(SERVERS)
    first = lb.acquire("req", token="tok-1")
    again = lb.acquire("req", token="tok-1")  # e.g. the reply was lost and the client retried
    assert again.server_id == first.server_id
    assert lb.get_total_inflight() == 1
    assert first.release() and not again.release()
    invariants.check(r, lb.name)


HOLDER = """
import sys, time
from redis_router import RedisLoadBalancer
lb = RedisLoadBalancer(redis=sys.argv[1], name=sys.argv[2], lease_ttl=1.0)
for i in range(int(sys.argv[3])):
    lb.acquire_server(f"doomed-{i}")
print("held", flush=True)
time.sleep(60)
"""


def test_sigkilled_holder_never_leaves_replicas_busy(make_lb, server, r):
    lb = make_lb(SERVERS, lease_ttl=1.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, server.url, lb.name, "25"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        assert lb.get_total_inflight() == 25
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    time.sleep(1.2)
    # no explicit reap: ordinary traffic reclaims the dead holder's leases
    for i in range(4):
        with lb.lease(f"alive-{i}"):
            pass
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}
    assert sum(v["reclaimed"] for v in lb.get_status()["replicas"].values()) == 25


def test_removing_a_replica_ends_its_leases(make_lb, r):
    lb = make_lb(SERVERS)
    leases = [lb.acquire(f"r{i}") for i in range(6)]
    lb.remove_servers(["s0"])
    assert lb.get_total_inflight() == 3
    for lease in leases:
        assert lease.release() == (lease.server_id == "s1")
    lb.add_servers({"s0": "a"})  # back, with no stale leases
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}
