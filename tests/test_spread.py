"""spread_sessions: among the least loaded replicas, a new session goes to one with the fewest
pinned sessions (live sticky entries naming it), so sessions thinking between turns, which
hold no lease, are seen. The counts (P pinned, I13) follow entries as they are written,
re-pinned, ended (end_session), cleared, and as their time buckets expire.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from redis_router import AsyncRedisLoadBalancer, ConfigMismatch

from . import invariants

EIGHT = {f"s{i}": None for i in range(8)}


def _pinned(r, lb) -> dict[str, int]:
    got = r.hgetall(invariants.prefix(lb.name) + "pinned")
    return {k: int(v) for k, v in got.items() if k != "@" and int(v)}


def _turn(lb, rid: str) -> str:
    """One turn of session ``rid``, ended before the next call: the session holds no lease."""
    sid, _ = lb.acquire_server(rid)
    assert lb.release_server(sid, rid).result()
    return sid


def test_new_sessions_go_where_no_session_is_pinned(make_lb, r):
    lb = make_lb(EIGHT, spread_sessions=True, rng=random.Random(7))
    # Every replica is idle at each pick; only the pinned sessions tell them apart.
    placed = [_turn(lb, f"a{k}") for k in range(8)]
    assert sorted(placed) == sorted(EIGHT)
    assert _pinned(r, lb) == dict.fromkeys(EIGHT, 1)
    # A second round: again one each, and sticky turns stay where they were.
    assert sorted(_turn(lb, f"b{k}") for k in range(8)) == sorted(EIGHT)
    assert [_turn(lb, f"a{k}") for k in range(8)] == placed
    invariants.check(r, lb.name)


def test_off_by_default_no_counts_are_kept(make_lb, r):
    lb = make_lb(EIGHT, rng=random.Random(7))
    for k in range(8):
        _turn(lb, f"a{k}")
    assert r.exists(invariants.prefix(lb.name) + "pinned") == 0
    assert lb.get_status()["spread_sessions"] is False
    assert lb.end_session("a0") == 1  # ending works without the counts, and makes none
    assert r.exists(invariants.prefix(lb.name) + "pinned") == 0
    invariants.check(r, lb.name)


def test_load_comes_first_pinned_sessions_only_break_its_ties(make_lb, r):
    lb = make_lb({"s0": None, "s1": None}, spread_sessions=True, rng=random.Random(3))
    a, b = _turn(lb, "a"), _turn(lb, "b")
    assert {a, b} == {"s0", "s1"}
    c = _turn(lb, "c")  # tied at 0 sessions in flight and 1 pinned: either
    other = b if c == a else a
    # c's replica has 2 pinned sessions and nothing in flight; the other 1 pinned and 1 in
    # flight: the new session goes to the less loaded one, pinned sessions notwithstanding.
    lb.acquire_server("a" if other == a else "b")
    assert lb.acquire_server("d")[0] == c
    invariants.check(r, lb.name)


def test_a_batch_places_as_one_request_at_a_time(make_lb, r):
    lb = make_lb(EIGHT, spread_sessions=True, rng=random.Random(11))
    first = {_turn(lb, f"a{k}") for k in range(4)}
    assert len(first) == 4
    got = [sid for sid, _ in lb.acquire_many([f"b{k}" for k in range(4)])]
    assert set(got) == set(EIGHT) - first  # each to a replica nothing is pinned to
    assert _pinned(r, lb) == dict.fromkeys(EIGHT, 1)
    invariants.check(r, lb.name)


def test_a_large_tie_compares_a_window_of_it(make_lb, r):
    servers = {f"s{i:02d}": None for i in range(40)}
    lb = make_lb(servers, spread_sessions=True, rng=random.Random(5))
    for k in range(40):
        _turn(lb, f"a{k}")
    pinned = _pinned(r, lb)
    # Each pick compares 8 of the 40 tied replicas, so it is not perfect, but no replica is
    # picked while a replica of its window holds fewer sessions: far from 40 random picks
    # (whose busiest replica holds 4 or more with probability ~0.5).
    assert max(pinned.values()) <= 2 and sum(pinned.values()) == 40
    invariants.check(r, lb.name)


def test_ended_sessions_free_their_place(make_lb, r):
    lb = make_lb(EIGHT, spread_sessions=True, rng=random.Random(2))
    where = {f"a{k}": _turn(lb, f"a{k}") for k in range(8)}
    assert lb.end_session("a3", "a5", "never-seen") == 2
    assert lb.end_session("a3") == 0  # a resent copy (or a second end) changes nothing
    freed = {where["a3"], where["a5"]}
    assert set(_pinned(r, lb)) == set(EIGHT) - freed
    invariants.check(r, lb.name)
    assert {_turn(lb, "b0"), _turn(lb, "b1")} == freed
    # The ended id is a new session now: balanced, not a sticky hit.
    g = lb.acquire("a3")
    assert not g.sticky
    g.release()
    invariants.check(r, lb.name)


def test_end_session_checks_its_ids_before_writing(make_lb, r):
    lb = make_lb(EIGHT, spread_sessions=True, rng=random.Random(2))
    _turn(lb, "a")
    before = _pinned(r, lb)
    with pytest.raises(TypeError, match=r"request_ids\[1\]"):
        lb.end_session("a", 17)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"request_ids\[0\]"):
        lb.end_session("")
    assert _pinned(r, lb) == before
    assert lb.end_session() == 0
    assert lb.acquire_server("a")[0] in EIGHT  # still sticky: nothing was ended
    assert _pinned(r, lb) == before


def test_a_repin_moves_the_count(make_lb, r):
    lb = make_lb({"s0": None}, spread_sessions=True, affinity_margin=1)
    for _ in range(3):
        assert lb.acquire_server("a")[0] == "s0"  # three turns of a in flight on s0
    lb.add_servers({"s1": None})
    assert _pinned(r, lb) == {"s0": 1}
    assert lb.acquire_server("a")[0] == "s1"  # s0 exceeds s1 by more than the margin
    assert _pinned(r, lb) == {"s1": 1}
    invariants.check(r, lb.name)


def test_a_removed_replica_keeps_its_sessions_until_they_move(make_lb, r):
    lb = make_lb({"s0": None, "s1": None}, spread_sessions=True, rng=random.Random(1))
    a = _turn(lb, "a")
    lb.remove_servers([a])
    assert _pinned(r, lb) == {a: 1}  # the entry still names it (and would, were it re-added)
    invariants.check(r, lb.name)
    assert _turn(lb, "a") != a  # its next turn is placed anew, and its count follows
    assert set(_pinned(r, lb)) == {"s0", "s1"} - {a}
    invariants.check(r, lb.name)


@pytest.mark.parametrize("how", ["clear", "bump"])
def test_forgetting_sticky_sessions_forgets_the_counts(make_lb, r, how):
    lb = make_lb(EIGHT, spread_sessions=True, rng=random.Random(4))
    for k in range(6):
        _turn(lb, f"a{k}")
    if how == "clear":
        assert lb.clear_sticky_cache()["cleared_entries"] == 6
    else:
        assert lb.bump_weight_version(sticky=True)["sticky_entries_forgotten"] == 6
    assert _pinned(r, lb) == {}
    invariants.check(r, lb.name)
    _turn(lb, "b")
    assert sum(_pinned(r, lb).values()) == 1
    invariants.check(r, lb.name)


def test_expired_buckets_leave_the_counts(make_lb, r):
    # sticky_ttl 2 s: buckets of 0.5 s; an entry expires 2-2.5 s after its last turn.
    lb = make_lb({"s0": None, "s1": None}, spread_sessions=True, sticky_ttl=2.0)
    t0 = time.monotonic()
    old = _turn(lb, "old")
    time.sleep(1.0)
    young = _turn(lb, "young")
    assert young != old  # the other was free of pinned sessions
    assert _pinned(r, lb) == {old: 1, young: 1}
    time.sleep(max(0.0, t0 + 2.6 - time.monotonic()))  # "old" has expired, "young" not
    if time.monotonic() - t0 > 2.9:
        pytest.skip("the machine stalled past young's expiry: nothing to compare")
    # The next new session's pick sees the bucket gone: the counts are made again from the
    # live buckets, so "old"'s replica is free and takes it.
    assert _turn(lb, "new") == old
    if time.monotonic() - t0 < 2.9:
        assert _pinned(r, lb) == {old: 1, young: 1}
        invariants.check(r, lb.name)


def test_every_process_must_agree(make_lb):
    a = make_lb(EIGHT, spread_sessions=True)
    late = make_lb(name=a.name)  # constructed before anything was pinned
    a.acquire_server("x")
    with pytest.raises(ConfigMismatch, match=r"spread_sessions=False, .* spread_sessions=True"):
        late.acquire_server("y")
    with pytest.raises(ConfigMismatch, match="spread_sessions=False"):
        make_lb(name=a.name)


def test_bad_option_is_refused_before_anything_is_written(server, make_lb):
    with pytest.raises(TypeError, match="spread_sessions"):
        make_lb(EIGHT, spread_sessions="yes")


def test_asyncio_twin(server, r):
    async def run() -> tuple[str, str, int]:
        lb = AsyncRedisLoadBalancer(
            {"s0": None, "s1": None}, redis=server.url, name="spread-aio", spread_sessions=True
        )
        try:
            a, _ = await lb.acquire_server("a")
            await lb.release_server(a, "a")
            b, _ = await lb.acquire_server("b")
            await lb.release_server(b, "b")
            return a, b, await lb.end_session("a", "b")
        finally:
            await lb.close()

    a, b, ended = asyncio.run(run())
    assert a != b  # b went where no session was pinned
    assert ended == 2
    invariants.check(r, "spread-aio")
