"""Leases: counts are leases (I1), nothing leaks (I2), late releases are no-ops (I6).

Liveness (heartbeats, dead holders, max_lease_age) is in test_liveness.py, resent releases in
test_resend.py."""

from __future__ import annotations

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


def test_a_lease_renewal_restarts_its_age(make_lb, r):
    lb = make_lb(SERVERS, lease_ttl=0.2, max_lease_age=1.0)
    lease = lb.acquire("long")
    for _ in range(6):  # 1.5 s in all: past max_lease_age, never 1 s without a renewal
        time.sleep(0.25)
        assert lease.renew()
    assert lb.get_total_inflight() == 1
    time.sleep(1.5)  # no renewal: the keeper's heartbeat ends it
    assert not lease.renew() and lb.get_total_inflight() == 0
    assert not lease.release()  # already ended: no double decrement
    invariants.check(r, lb.name)


def test_lease_renews_its_age_while_held(make_lb):
    lb = make_lb(SERVERS, lease_ttl=0.2, max_lease_age=0.6)
    with lb.lease("long", renew_every=0.15) as lease:
        time.sleep(1.5)
        assert lb.get_inflight_count(lease.server_id) == 1
    assert lb.get_total_inflight() == 0


def test_retried_acquire_with_same_token_is_not_counted_twice(make_lb, r):
    lb = make_lb(SERVERS)
    first = lb.acquire("req")
    again = lb.acquire("req", token=first.token)  # e.g. the reply was lost and the client retried
    assert again.server_id == first.server_id
    assert lb.get_total_inflight() == 1
    assert first.release() and not again.release()
    invariants.check(r, lb.name)


def test_removing_a_replica_ends_its_leases(make_lb, r):
    lb = make_lb(SERVERS)
    leases = [lb.acquire(f"r{i}") for i in range(6)]
    lb.remove_servers(["s0"])
    assert lb.get_total_inflight() == 3
    for lease in leases:
        assert lease.release().result() == (lease.server_id == "s1")
    lb.add_servers({"s0": "a"})  # back, with no stale leases
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_a_release_without_request_id_ends_the_processs_own_lease(make_lb, r):
    a = make_lb({"s0": "x"})
    b = make_lb(name=a.name)
    a.acquire_server("a1")  # the replica's oldest lease: another process's
    b.acquire_server("b1")
    assert b.release_server("s0")
    assert a.request_owner("a1") == "s0" and b.request_owner("b1") is None
    assert a.release_server("s0", "a1")
    assert invariants.check(r, a.name) == {"s0": 0}


def test_a_release_without_request_id_by_a_process_holding_none_ends_the_oldest(make_lb, r):
    a = make_lb({"s0": "x"})
    reader = make_lb(name=a.name)  # holds nothing on s0 (verl's release by replica)
    a.acquire_server("a1")
    a.acquire_server("a2")
    assert reader.release_server("s0")
    # One of a's two ended (the oldest: both may carry the same millisecond).
    assert [a.request_owner("a1"), a.request_owner("a2")].count("s0") == 1
    assert invariants.check(r, a.name) == {"s0": 1}
