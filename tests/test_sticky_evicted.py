"""Eviction-aware stickiness (prefix_cache's ``sticky_min_cached``): a sticky turn whose replica
no longer holds enough of its prompt, by the exact KV-events index, is placed anew by the
policy and counted as a re-pin; with the events published through the index's own script
(kv_index_apply.lua), on every server binary."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from redis_router.errors import ConfigMismatch
from redis_router.kv_events import BlockRemoved
from redis_router.plugins.prefix_cache import PrefixCacheRouter

from . import exact_index, invariants
from .exact_index import BLOCK, KV_BLOCK, SERVERS, Engine, prompt


@pytest.fixture
def make_pc(server: Any) -> Iterator[Callable[..., PrefixCacheRouter]]:
    with exact_index.routers(server.url, name="evict", kv_event_lag=0) as make:
        yield make


@pytest.fixture
def engines(r: Any) -> Callable[..., dict[str, Engine]]:
    def make(*sids: str, stale: float = 10.0, name: str = "evict") -> dict[str, Engine]:
        return exact_index.engines(r, name, sids, stale)

    return make


def turn(lb: PrefixCacheRouter, rid: str, tokens: list[int]) -> tuple[str, bool]:
    """One turn of session ``rid``, released at once: (replica, sticky hit)."""
    lease = lb.acquire(rid, prompt_ids=tokens)
    lease.release()
    return lease.server_id, lease.sticky


def repins(r: Any, name: str = "evict") -> dict[str, int]:
    return {k: int(v) for k, v in r.hgetall(invariants.prefix(name) + "repins").items()}


def test_a_turn_whose_replica_evicted_its_prompt_moves_to_the_replica_holding_it(
    make_pc, engines, r
):
    lb = make_pc(sticky_min_cached=0.5)
    es = engines(*SERVERS)
    p = prompt(1)
    first, _ = turn(lb, "sess", p)
    hashes = es[first].store(p)
    assert turn(lb, "sess", p) == (first, True)  # held: sticky
    es[first].publish(BlockRemoved(hashes))
    other = next(s for s in SERVERS if s != first)
    es[other].store(p)
    assert turn(lb, "sess", p) == (other, False)  # placed anew, on the replica holding it
    assert repins(r) == {first: 1}
    assert turn(lb, "sess", p) == (other, True)  # pinned to its new replica from then on
    assert lb.get_status()["replicas"][first]["repins"] == 1
    invariants.check(r, lb.name)


def test_the_share_decides_how_much_of_the_prompt_must_still_be_cached(make_pc, engines, r):
    p = prompt(2)  # 16 engine blocks
    for name, share, stays in (("half", 0.5, True), ("most", 0.9, False)):
        lb = make_pc(name=name, sticky_min_cached=share)
        es = engines(*SERVERS, name=name)
        first, _ = turn(lb, "sess", p)
        hashes = es[first].store(p)
        es[first].publish(BlockRemoved(hashes[10:]))  # the tail goes first: 10 of 16 left
        other = next(s for s in SERVERS if s != first)
        es[other].store(p)  # all of it
        assert turn(lb, "sess", p) == ((first, True) if stays else (other, False)), name
        assert repins(r, name) == ({} if stays else {first: 1})


def test_an_evicted_session_on_the_least_loaded_replica_stays_and_is_no_re_pin(make_pc, engines, r):
    lb = make_pc(sticky_min_cached=0.5)
    es = engines(*SERVERS)
    p = prompt(3)
    first, _ = turn(lb, "sess", p)
    hashes = es[first].store(p)
    es[first].publish(BlockRemoved(hashes))
    for k, sid in enumerate(s for s in SERVERS if s != first):  # the others busier
        es[sid].store(prompt(200 + k))
        assert lb.acquire_server(f"pin{k}", prompt_ids=prompt(200 + k))[0] == sid
    assert turn(lb, "sess", p) == (first, False)  # placed anew: the least loaded is its own
    assert repins(r) == {}


def test_a_replica_whose_index_is_not_exact_keeps_its_sessions(make_pc, engines, r):
    lb = make_pc(sticky_min_cached=0.5)
    es = engines(*SERVERS, stale=0.3)
    p = prompt(4)
    first, _ = turn(lb, "sess", p)
    hashes = es[first].store(p)
    es[first].publish(BlockRemoved(hashes))
    time.sleep(0.4)  # no subscriber vouched for any stream since: none is exact
    secs, micros = r.time()
    deadline = int(r.hget(invariants.prefix("evict") + "kv:exact", first))
    assert deadline < secs * 1000 + micros // 1000
    assert turn(lb, "sess", p) == (first, True)
    assert repins(r) == {}


def test_a_recent_record_stands_in_for_events_not_arrived_yet(make_pc, engines, r):
    lb = make_pc(sticky_min_cached=0.5, kv_event_lag=1.0)
    es = engines(*SERVERS)  # every replica exact, none reports p
    p = prompt(5)
    first, _ = turn(lb, "sess", p)
    assert turn(lb, "sess", p) == (first, True)  # sent a moment ago: its events may be on the way
    for k in range(3):  # `first` the busiest, so a re-pin leaves it
        es[first].store(prompt(300 + k))
        assert lb.acquire_server(f"hot{k}", prompt_ids=prompt(300 + k))[0] == first
    time.sleep(1.1)
    moved, sticky = turn(lb, "sess", p)  # past the lag: the engine never reported p
    assert moved != first and not sticky
    assert repins(r) == {first: 1}
    invariants.check(r, lb.name)


def test_a_batch_moves_the_evicted_sessions_and_keeps_the_others(make_pc, engines, r):
    lb = make_pc(sticky_min_cached=0.5)
    es = engines(*SERVERS)
    ps = {f"a{k}": prompt(10 + k) for k in range(6)}
    first = lb.acquire_many(list(ps), prompt_ids=list(ps.values()))
    placed = {rid: sid for rid, (sid, _) in zip(ps, first, strict=True)}
    for rid, sid in placed.items():
        lb.release_server(sid, rid)
    held = {rid: es[sid].store(ps[rid]) for rid, sid in placed.items()}
    gone = {"a0", "a3"}
    for rid in gone:
        es[placed[rid]].publish(BlockRemoved(held[rid]))
        es[next(s for s in SERVERS if s != placed[rid])].store(ps[rid])
    got = lb.acquire_many(list(ps), prompt_ids=list(ps.values()))
    for (sid, _), rid in zip(got, ps, strict=True):
        assert (sid == placed[rid]) is (rid not in gone), rid
    assert sum(repins(r).values()) == 2
    invariants.check(r, lb.name)


def test_a_resent_acquire_of_a_re_pinned_turn_is_counted_once(make_pc, engines, r):
    lb = make_pc(sticky_min_cached=0.5)
    es = engines(*SERVERS)
    p = prompt(6)
    first, _ = turn(lb, "sess", p)
    es[first].publish(BlockRemoved(es[first].store(p)))
    other = next(s for s in SERVERS if s != first)
    es[other].store(p)
    lease = lb.acquire("sess", prompt_ids=p)
    again = lb.acquire("sess", token=lease.token, prompt_ids=p)  # the same call, resent
    assert (lease.server_id, again.server_id) == (other, other)
    assert repins(r) == {first: 1}
    assert invariants.check(r, lb.name)[other] == 1
    lease.release()


def test_the_setting_is_pinned_and_shown(make_pc, r):
    a = make_pc(sticky_min_cached=0.5)
    a.acquire_server("x", prompt_ids=prompt(7))
    assert r.hget(invariants.prefix("evict") + "config", "sticky_min_cached") == "0.5"
    assert a.get_status()["sticky_min_cached"] == 0.5
    assert a.get_status()["policy"]["sticky_min_cached"] == 0.5
    for other in ({"sticky_min_cached": 0.75}, {}):
        with pytest.raises(ConfigMismatch, match="sticky_min_cached"):
            make_pc(**other)


def test_off_by_default_and_off_under_full_determinism(make_pc, r):
    lb = make_pc()
    lb.acquire_server("x", prompt_ids=prompt(9))
    assert lb.get_status()["sticky_min_cached"] is None
    assert r.hget(invariants.prefix("evict") + "config", "sticky_min_cached") == ""
    det = make_pc(name="det", sticky_min_cached=0.5, full_determinism=True)
    det.acquire_server("x", prompt_ids=prompt(9))
    assert r.hget(invariants.prefix("det") + "config", "sticky_min_cached") == ""


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        (0, ValueError, r"\(0, 1\]"),
        (-0.5, ValueError, "sticky_min_cached"),
        (1.5, ValueError, "sticky_min_cached"),
        (float("nan"), ValueError, "sticky_min_cached"),
        ("0.5", TypeError, "sticky_min_cached must be a number"),
        (True, TypeError, "sticky_min_cached must be a number"),
    ],
)
def test_bad_values_are_refused_naming_the_option_and_write_nothing(server, r, value, error, says):
    with pytest.raises(error, match=says):
        PrefixCacheRouter(
            SERVERS, redis=server.url, name="bad", kv_block_size=KV_BLOCK, sticky_min_cached=value
        )
    assert r.keys("*") == []


def test_the_approximate_index_alone_is_refused(server, r):
    with pytest.raises(ValueError, match="sticky_min_cached needs kv_block_size"):
        PrefixCacheRouter(SERVERS, redis=server.url, name="bad", sticky_min_cached=0.5)
    with pytest.raises(TypeError, match="sticky_min_cached"):
        from redis_router import RedisLoadBalancer

        RedisLoadBalancer(SERVERS, redis=server.url, name="bad", sticky_min_cached=0.5)
    assert r.keys("*") == []


def test_random_turns_stay_exactly_while_their_replica_holds_the_prompt(make_pc, engines, r):
    """Seeded random sessions, turns (one at a time and in batches, the script's two paths;
    some leases kept), and engines caching and evicting whole prompts: a turn is a sticky hit
    exactly when its replica still holds its prompt, every move off a replica is one re-pin
    of it, and the invariants hold throughout."""
    rng = random.Random(11)
    lb = make_pc(sticky_min_cached=0.5)
    es = engines(*SERVERS)
    prompts = {f"u{k}": prompt(500 + k) for k in range(10)}
    cached: dict[tuple[str, str], list[int]] = {}  # (replica, session) -> engine hashes
    where: dict[str, str] = {}  # session -> its replica
    kept: list[tuple[str, str]] = []
    moves: dict[str, int] = {}
    for step in range(150):
        op = rng.random()
        if op < 0.3:  # an engine caches or evicts a session's prompt
            sid, rid = rng.choice(list(SERVERS)), rng.choice(list(prompts))
            if (sid, rid) in cached:
                es[sid].publish(BlockRemoved(cached.pop((sid, rid))))
            else:
                cached[(sid, rid)] = es[sid].store(prompts[rid])
            continue
        if op < 0.4 and kept:
            lb.release_server(*kept.pop(rng.randrange(len(kept))))
            continue
        rids = rng.sample(list(prompts), rng.choice((1, 1, 3)))
        fields = [{"prompt_ids": prompts[x]} for x in rids]
        for g in lb._run(lb._core.acquire(rids, None, fields)):
            old = where.get(g.request_id)
            held = old is not None and (old, g.request_id) in cached
            assert g.sticky is held, (step, g, old)
            if old is not None and g.server_id != old:
                moves[old] = moves.get(old, 0) + 1
            where[g.request_id] = g.server_id
            if rng.random() < 0.5:
                kept.append((g.server_id, g.request_id))
            else:
                lb.release_server(g.server_id, g.request_id)
        invariants.check(r, lb.name)
    assert repins(r) == moves and moves  # some sessions moved
    for sid, rid in kept:
        lb.release_server(sid, rid)
    assert set(invariants.check(r, lb.name).values()) == {0}


def test_the_asyncio_twin_moves_an_evicted_session_too(server, make_pc, engines, r):
    import asyncio

    from redis_router.plugins.prefix_cache import AsyncPrefixCacheRouter

    make_pc(sticky_min_cached=0.5)  # registers the replicas, pins the setting
    es = engines(*SERVERS)
    p = prompt(12)

    async def main() -> list[tuple[str, bool]]:
        lb = AsyncPrefixCacheRouter(
            SERVERS,
            router_kwargs={"redis": server.url, "name": "evict", "kv_block_size": KV_BLOCK,
                           "block_size": BLOCK, "kv_event_lag": 0, "sticky_min_cached": 0.5},
        )  # fmt: skip
        try:
            out = []
            for k in range(3):
                lease = await lb.acquire("sess", prompt_ids=p)
                await lease.release()
                out.append((lease.server_id, lease.sticky))
                if k == 0:
                    es[lease.server_id].publish(BlockRemoved(es[lease.server_id].store(p)))
                    es[next(s for s in SERVERS if s != lease.server_id)].store(p)
            return out
        finally:
            await lb.close()

    (first, _), second, third = asyncio.run(main())
    other = next(s for s in SERVERS if s != first)
    assert (second, third) == ((other, False), (other, True))
    assert repins(r) == {first: 1}
