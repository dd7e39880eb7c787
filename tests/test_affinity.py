"""Affinity tolerance: a sticky session yields to overload by a margin and/or a ratio.

A sticky session's next turn stays on its replica while that replica (taking new sessions) is
within the margin of the least loaded; beyond it, the turn is placed by the policy anew and the
move is counted for the replica left. Every process must use the same settings.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from redis_router import AsyncRedisLoadBalancer, ConfigMismatch

from . import invariants


def _pile_on(lb, n: int) -> None:
    """Put n requests in flight on the only replica, as later turns of session 'a'."""
    for _ in range(n):
        assert lb.acquire_server("a")[0] == "s0"


@pytest.mark.parametrize("held", [1, 2, 3, 4])
def test_sticky_turn_stays_within_the_margin_and_moves_beyond_it(make_lb, r, held):
    lb = make_lb({"s0": None}, affinity_margin=2)
    _pile_on(lb, held)  # s0 carries `held` requests of session a
    lb.add_servers({"s1": None})  # s1 is idle: s0 exceeds it by `held`
    sid, _ = lb.acquire_server("a")
    assert sid == ("s1" if held > 2 else "s0")
    repins = lb.get_status()["replicas"]["s0"]["repins"]
    assert repins == (1 if held > 2 else 0)
    if held > 2:  # the session now lives on s1: its next turn is a plain sticky hit there
        assert lb.acquire_server("a")[0] == "s1"
    invariants.check(r, lb.name)


@pytest.mark.parametrize(
    ("margin", "ratio", "moves"),
    [
        (None, 2.0, True),  # 3 > 2 * 1
        (None, 3.0, False),  # 3 is not above 3 * 1
        (1, 3.0, False),  # the margin is exceeded (3 - 1 > 1), the ratio is not: both must be
        (1, 2.0, True),
        (2, 2.0, False),  # 3 - 1 is not above 2
    ],
)
def test_ratio_and_margin_must_both_be_exceeded(make_lb, r, margin, ratio, moves):
    lb = make_lb({"s0": None}, affinity_margin=margin, affinity_ratio=ratio)
    _pile_on(lb, 3)
    lb.add_servers({"s1": None})
    lb.drain_servers(["s0"])
    assert lb.acquire_server("b")[0] == "s1"  # s1 carries 1
    lb.undrain_servers(["s0"])
    assert lb.acquire_server("a")[0] == ("s1" if moves else "s0")
    invariants.check(r, lb.name)


def test_a_draining_replica_keeps_its_sticky_sessions(make_lb, r):
    lb = make_lb({"s0": None}, affinity_margin=0)
    _pile_on(lb, 3)
    lb.add_servers({"s1": None})
    lb.drain_servers(["s0"])
    assert lb.acquire_server("a")[0] == "s0"
    assert lb.get_status()["replicas"]["s0"]["repins"] == 0
    invariants.check(r, lb.name)


def test_a_moved_session_goes_where_the_policy_places_it(make_lb, r):
    """With a seeded tie-break, two idle replicas tie: the moved turn takes one of them."""
    lb = make_lb({"s0": None}, affinity_margin=1, rng=random.Random(7))
    _pile_on(lb, 2)
    lb.add_servers({"s1": None, "s2": None})
    first = lb.acquire_server("a")[0]
    assert first in ("s1", "s2")
    again = make_lb({"s0": None}, affinity_margin=1, rng=random.Random(7))
    _pile_on(again, 2)
    again.add_servers({"s1": None, "s2": None})
    assert again.acquire_server("a")[0] == first  # same seed, same choice
    invariants.check(r, lb.name)


def test_off_by_default_and_under_full_determinism(make_lb, r):
    for kw in ({}, {"affinity_margin": 0, "full_determinism": True}):
        lb = make_lb({"s0": None}, **kw)
        _pile_on(lb, 4)
        lb.add_servers({"s1": None})
        assert lb.acquire_server("a")[0] == "s0"
        assert r.hget(invariants.prefix(lb.name) + "config", "affinity_margin") == ""
        assert not r.exists(invariants.prefix(lb.name) + "repins")
        invariants.check(r, lb.name)


def test_status_reports_the_options_and_the_repins(make_lb):
    lb = make_lb({"s0": None}, affinity_margin=0, affinity_ratio=1.5)
    _pile_on(lb, 2)
    lb.add_servers({"s1": None})
    lb.acquire_server("a")
    status = lb.get_status()
    assert (status["affinity_margin"], status["affinity_ratio"]) == (0, 1.5)
    assert {sid: x["repins"] for sid, x in status["replicas"].items()} == {"s0": 1, "s1": 0}


def test_coalesced_async_batch_moves_as_one_at_a_time(server, make_lb, r):
    """Turns coalesced into one call route as the same turns made one after another."""

    async def run(name: str, coalesce: bool) -> list[str]:
        lb = AsyncRedisLoadBalancer(
            {"s0": None},
            redis=server.url,
            name=name,
            affinity_margin=1,
            rng=random.Random(3),
            coalesce=coalesce,
        )
        try:
            for _ in range(3):
                await lb.acquire_server("a")
            await lb.add_servers({"s1": None, "s2": None})
            if coalesce:
                got = await asyncio.gather(*(lb.acquire_server(x) for x in "aabab"))
            else:
                got = [await lb.acquire_server(x) for x in "aabab"]
            return [sid for sid, _ in got]
        finally:
            await lb.close()

    one = asyncio.run(run("aff-one", False))
    batch = asyncio.run(run("aff-batch", True))
    assert one == batch
    assert one[0] != "s0"  # s0 carried 3 against 0: the first turn moved
    assert r.hget(invariants.prefix("aff-one") + "repins", "s0") == "1"
    assert r.hget(invariants.prefix("aff-batch") + "repins", "s0") == "1"
    invariants.check(r, "aff-one")
    invariants.check(r, "aff-batch")


def test_every_process_must_use_the_same_affinity(make_lb, r):
    lb = make_lb({"s0": None}, affinity_margin=2)
    late = make_lb(name=lb.name)  # constructed before anything was pinned
    lb.acquire_server("a")
    with pytest.raises(ConfigMismatch, match=r"affinity_margin=off.*already use 2"):
        make_lb(name=lb.name)  # setup() reads the pinned settings
    with pytest.raises(ConfigMismatch, match=r"affinity_ratio=1\.5.*already use off"):
        make_lb(name=lb.name, affinity_margin=2, affinity_ratio=1.5)
    with pytest.raises(ConfigMismatch, match="affinity_margin=off"):
        late.acquire_server("b")  # its first acquire registers it: refused, nothing written
    assert lb.get_total_inflight() == 1
    same = make_lb(name=lb.name, affinity_margin=2)
    assert same.acquire_server("a")[0] == "s0"
    invariants.check(r, lb.name)


@pytest.mark.parametrize(
    ("kw", "error", "text"),
    [
        ({"affinity_margin": -1}, ValueError, "affinity_margin must be in"),
        ({"affinity_margin": 1.5}, TypeError, "affinity_margin must be an int"),
        ({"affinity_margin": True}, TypeError, "affinity_margin must be an int"),
        ({"affinity_ratio": 0.5}, ValueError, "affinity_ratio must be in"),
        ({"affinity_ratio": float("nan")}, ValueError, "affinity_ratio must be in"),
        ({"affinity_ratio": "2"}, TypeError, "affinity_ratio must be a number"),
    ],
)
def test_bad_affinity_options_name_the_argument(make_lb, r, kw, error, text):
    with pytest.raises(error, match=text):
        make_lb({"s0": None}, **kw)
    assert r.dbsize() == 0
