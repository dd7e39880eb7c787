"""The prefix-cache router: longest cached prefix wins, imbalance falls back to least-loaded,
the index stays bounded, exact mode, and the core's guarantees (I1, I3, I6) still hold."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from redis_router import AsyncRequestLoadBalancer, RequestLoadBalancer, get_router_handle
from redis_router.plugins.prefix_cache import (
    AsyncPrefixCacheRouter,
    PrefixCacheRouter,
    chain_hashes,
    sample_depths,
)

from . import invariants

SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(4)}
BLOCK = 32
YAML = Path(__file__).resolve().parents[1] / "plugins" / "prefix_cache.yaml"
_names = itertools.count()


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(blocks * BLOCK)]


@pytest.fixture
def make_pc(server: Any) -> Iterator[Callable[..., PrefixCacheRouter]]:
    """Prefix-cache routers on the test's server, each with a fresh name unless given one."""
    made: list[PrefixCacheRouter] = []

    def make(servers: Any = SERVERS, **kw: Any) -> PrefixCacheRouter:
        kw.setdefault("name", f"pc{next(_names)}")
        lb = PrefixCacheRouter(servers, router_kwargs={"redis": server.url, **kw})
        made.append(lb)
        return lb

    yield make
    for lb in made:
        lb.close()


def index(r: Any, name: str) -> dict[str, dict[str, int]]:
    """The index as redis-cli shows it: block hash -> {replica id: ms it received it}."""
    out = {}
    for h, v in r.hgetall(invariants.prefix(name) + "pc:idx").items():
        parts = v.split("\x1f")
        assert parts[-1] == "" and len(parts) % 2 == 1, f"malformed holders {v!r}"
        out[h] = {parts[k]: int(parts[k + 1]) for k in range(0, len(parts) - 1, 2)}
    return out


def recorded(r: Any, name: str) -> int:
    """pc:n: the hashes the index's writes name, what max_index_blocks bounds."""
    return int(r.get(invariants.prefix(name) + "pc:n") or 0)


def test_chain_hashes_are_stable_and_name_whole_prefixes():
    p = prompt(1, 12)
    depths, hashes = chain_hashes(p, BLOCK, 1024)
    assert depths == sample_depths(12) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    assert hashes[0] == chain_hashes(p[:BLOCK], BLOCK, 1024)[1][0]
    # A different first block changes every later hash: each names its whole prefix.
    other = chain_hashes([p[0] + 1, *p[1:]], BLOCK, 1024)[1]
    assert not set(hashes) & set(other)
    # Fixed bytes in, fixed hash out (never Python's per-process hash()).
    assert chain_hashes(list(range(BLOCK)), BLOCK, 1024)[1] == ["d472fa13e908c400"]


def test_repeated_prompt_follows_its_first_replica(make_pc, r):
    lb = make_pc(rng=random.Random(3))
    p = prompt(2, 20)
    first, _ = lb.acquire_server("grpo-0", prompt_ids=p)
    lb.release_server(first, "grpo-0")
    for k in range(1, 8):
        sid, _ = lb.acquire_server(f"grpo-{k}", prompt_ids=p)
        assert sid == first  # on an idle pool every replica ties: only the prefix decides
        lb.release_server(sid, f"grpo-{k}")
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)


def test_longest_prefix_wins(make_pc):
    lb = make_pc(record_on_acquire=False)
    p = prompt(3, 20)
    assert lb.record_blocks("s1", lb.block_hashes(p[: 8 * BLOCK])) == 8
    assert lb.record_blocks("s2", lb.block_hashes(p)) == len(sample_depths(20))
    for k in range(5):
        sid, _ = lb.acquire_server(f"q{k}", prompt_ids=p + prompt(100 + k, 2))
        assert sid == "s2"
        lb.release_server(sid, f"q{k}")


def test_short_match_below_min_match_is_ignored(make_pc):
    lb = make_pc(record_on_acquire=False, min_match=0.5, rng=random.Random(5))
    shared = prompt(4, 4)
    lb.record_blocks("s0", lb.block_hashes(shared))
    seen = set()
    for k in range(40):
        sid, _ = lb.acquire_server(f"q{k}", prompt_ids=shared + prompt(200 + k, 16))
        seen.add(sid)
        lb.release_server(sid, f"q{k}")
    assert seen == set(SERVERS)  # 4 of 20 blocks: least-loaded spreads them


def _s0_holding(make_pc: Callable[..., PrefixCacheRouter], tokens: list[int]) -> PrefixCacheRouter:
    """Two idle replicas, s0 recorded as holding ``tokens``; thresholds 2 and 1.5."""
    lb = make_pc(
        {"s0": None, "s1": None},
        record_on_acquire=False,
        balance_abs_threshold=2,
        balance_rel_threshold=1.5,
    )
    lb.record_blocks("s0", lb.block_hashes(tokens))
    return lb


def test_a_prefix_yields_where_its_replica_would_become_a_hot_spot(make_pc, r):
    shared = prompt(6, 12)
    lb = _s0_holding(make_pc, shared)
    # Each request shares 12 of its 16 blocks with what s0 holds (a system prompt).
    got = [lb.acquire_server(f"g{k}", prompt_ids=shared + prompt(40 + k, 4))[0] for k in range(4)]
    # With the request, s0 would carry 1, then 2, over a median (the lower of two counts) of
    # 0: not more than 2 above it. 3 over 0 would be (3 > 0 + 2, 3 > 1.5 * 0): least loaded.
    # Then 3 over a median of 1 is within the thresholds again.
    assert got == ["s0", "s0", "s1", "s0"]
    assert invariants.check(r, lb.name) == {"s0": 3, "s1": 1}


def test_a_repeat_of_a_whole_prompt_yields_only_far_above_the_least_loaded(make_pc, r):
    """A GRPO group's samples repeat one prompt: sent elsewhere, a sample loses all of it, not
    a share, so only the test against the least loaded (by more than 2 x abs) moves one."""
    p = prompt(6, 12)
    lb = _s0_holding(make_pc, p)
    got = [lb.acquire_server(f"g-{k}", prompt_ids=p)[0] for k in range(6)]
    # 4 over 0 is not more than 2 x 2; 5 over 0 is: least loaded. Then 5 over 1 is not (the
    # median test alone would have moved the third: 3 over a median of 0).
    assert got == ["s0"] * 4 + ["s1", "s0"]
    assert invariants.check(r, lb.name) == {"s0": 5, "s1": 1}


def test_a_busy_replica_elsewhere_does_not_scatter_a_group(make_pc, r):
    """The test is on the replica the prefix picks, against the median: one replica loaded far
    above the rest (sticky sessions, another group) does not turn the index off for all."""
    lb = make_pc(rng=random.Random(3))
    lb.drain_servers(["s0", "s1", "s2"])
    for k in range(9):
        lb.acquire_server(f"busy{k}", prompt_ids=prompt(700 + k, 2))
    lb.undrain_servers(["s0", "s1", "s2"])
    shared = prompt(13, 10)
    # 9 vs 0 in flight: the pool's spread is far past the thresholds (4, 1.2), yet the
    # replica of a shared prefix, up to 4 over the median of 0, is no hot spot.
    placed = [
        lb.acquire_server(f"g-{k}", prompt_ids=shared + prompt(800 + k, 2))[0] for k in range(4)
    ]
    assert len(set(placed)) == 1 and placed[0] != "s3"
    fifth = lb.acquire_server("g-4", prompt_ids=shared + prompt(804, 2))[0]
    assert fifth not in {placed[0], "s3"}  # 5 over 0 is
    # A group's samples (one whole prompt, repeated) stay together up to 8 over the least
    # loaded replica (2 x 4), the busy one elsewhere notwithstanding. The group starts on the
    # idle replica; the least loaded then carries the fifth request above.
    p = prompt(14, 10)
    group = [lb.acquire_server(f"h-{k}", prompt_ids=p)[0] for k in range(9)]
    assert len(set(group)) == 1 and group[0] not in {placed[0], fifth, "s3"}
    assert lb.acquire_server("h-9", prompt_ids=p)[0] == fifth  # 10 over 1 is more than 8
    invariants.check(r, lb.name)


def test_a_replica_without_the_prefix_is_not_left_idle(make_pc, r):
    """Three replicas hold a shared prefix, the fourth never received it: the median is a
    holder's count, so only the second test (more than 4 x 4 over the least loaded) hands
    the fourth a request."""
    lb = make_pc(record_on_acquire=False, rng=random.Random(9))
    p = prompt(14, 10)
    for sid in ("s0", "s1", "s2"):
        lb.record_blocks(sid, lb.block_hashes(p))
    got = [lb.acquire_server(f"q{k}", prompt_ids=p + prompt(900 + k, 2))[0] for k in range(49)]
    assert "s3" not in got[:48] and got[48] == "s3"  # 17 over 0 is more than 16
    assert invariants.check(r, lb.name) == {"s0": 16, "s1": 16, "s2": 16, "s3": 1}


def test_index_stays_within_its_size_bound(make_pc, r):
    lb = make_pc(max_index_blocks=20)
    for k in range(30):
        sid, _ = lb.acquire_server(f"q{k}", prompt_ids=prompt(300 + k, 5))
        lb.release_server(sid, f"q{k}")
    p = invariants.prefix(lb.name)
    assert recorded(r, lb.name) == 20 and len(index(r, lb.name)) == 20
    assert r.zcard(p + "pc:lru") == 4  # one write per never-seen prompt, the newest kept
    newest = {h for k in range(26, 30) for h in lb.block_hashes(prompt(300 + k, 5))}
    assert set(index(r, lb.name)) == newest


def test_index_forgets_blocks_after_its_ttl(make_pc, r):
    lb = make_pc(index_ttl=0.05)
    for k in range(10):
        sid, _ = lb.acquire_server(f"old{k}", prompt_ids=prompt(400 + k, 5))
        lb.release_server(sid, f"old{k}")
    assert len(index(r, lb.name)) == 50
    time.sleep(0.2)
    sid, _ = lb.acquire_server("new", prompt_ids=prompt(500, 3))
    assert r.zcard(invariants.prefix(lb.name) + "pc:lru") == 1  # only the new prompt's
    assert len(index(r, lb.name)) == 3 and recorded(r, lb.name) == 3


def test_exact_mode_records_and_evicts(make_pc, r):
    lb = make_pc(record_on_acquire=False)
    p = prompt(7, 12)
    hashes = lb.block_hashes(p)
    assert lb.record_blocks("s3", hashes) == len(hashes)
    assert lb.acquire_server("a", prompt_ids=p)[0] == "s3"
    lb.release_server("s3", "a")
    assert recorded(r, lb.name) == len(hashes)  # acquire recorded nothing of its own
    assert set(index(r, lb.name)) == set(hashes)
    assert lb.evict_blocks("s3", hashes) == len(hashes)
    assert index(r, lb.name) == {}
    assert lb.record_blocks("not-a-replica", hashes) == 0  # I6: only pool members
    with pytest.raises(ValueError, match="hex"):
        lb.record_blocks("s3", ["nothex"])
    assert index(r, lb.name) == {}  # I8: bad input wrote nothing


def test_sticky_session_stays_although_another_replica_has_more(make_pc, r):
    lb = make_pc(record_on_acquire=False)
    turn1 = prompt(8, 10)
    home, _ = lb.acquire_server("session", prompt_ids=turn1)
    lb.release_server(home, "session")
    turn2 = turn1 + prompt(9, 10)
    other = next(s for s in SERVERS if s != home)
    lb.record_blocks(other, lb.block_hashes(turn2))
    sid, _ = lb.acquire_server("session", prompt_ids=turn2)
    assert sid == home  # I3: only a session's first turn is balanced
    lb.release_server(sid, "session")
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)


def test_concurrent_use_keeps_the_invariants(make_pc, r):
    lb = make_pc(rng=random.Random(11), balance_abs_threshold=1, balance_rel_threshold=1.1)
    rng = random.Random(12)
    prompts = [prompt(600 + k, 6) for k in range(5)]
    held: list[tuple[str, str]] = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            sid, rid = held.pop(rng.randrange(len(held)))
            lb.release_server(sid, rid)
        else:
            rid = f"r{rng.randrange(60)}"
            held.append((lb.acquire_server(rid, prompt_ids=rng.choice(prompts))[0], rid))
    counts = invariants.check(r, lb.name)
    assert sum(counts.values()) == len(held)


def test_draining_and_removed_replicas_are_never_chosen_by_prefix(make_pc, r):
    lb = make_pc(record_on_acquire=False, rng=random.Random(13))
    p, q = prompt(10, 10), prompt(11, 10)
    lb.record_blocks("s0", lb.block_hashes(p))
    lb.record_blocks("s1", lb.block_hashes(q))
    lb.drain_servers(["s0"])
    lb.remove_servers(["s1"])
    for k in range(20):
        for name, ids in (("p", p), ("q", q)):
            sid, _ = lb.acquire_server(f"{name}{k}", prompt_ids=ids)
            assert sid in {"s2", "s3"}
            lb.release_server(sid, f"{name}{k}")
    invariants.check(r, lb.name)


def test_requests_without_prompt_are_least_loaded(make_pc, r):
    lb = make_pc({"s0": None, "s1": None})
    first, _ = lb.acquire_server("busy")
    sid, _ = lb.acquire_server("plain")  # no prompt_ids: the core's rule
    assert sid != first
    assert invariants.check(r, lb.name) == {"s0": 1, "s1": 1}


def test_destroy_removes_the_index_too(make_pc, r):
    lb = make_pc()
    lb.acquire_server("a", prompt_ids=prompt(12, 4))
    lb.destroy()
    assert list(r.scan_iter(match=invariants.prefix(lb.name) + "*")) == []


def test_yaml_config_builds_the_router(server, monkeypatch):
    monkeypatch.setenv("REDIS_URL", server.url)
    lb = get_router_handle(SERVERS, router_config_path=str(YAML))
    try:
        assert isinstance(lb, PrefixCacheRouter) and isinstance(lb, RequestLoadBalancer)
        assert lb.require_acquire_fields() == ["prompt_ids"]
        assert lb.settings.block_size == 32
        sid, _ = lb.acquire_server("y", prompt_ids=prompt(13, 4))
        assert sid in SERVERS
    finally:
        lb.destroy()
        lb.close()


def test_bad_options_raise_before_connecting():
    with pytest.raises(ValueError, match="block_size"):
        PrefixCacheRouter(router_kwargs={"redis": "redis://127.0.0.1:1/0", "block_size": 0})
    with pytest.raises(TypeError, match="both"):
        PrefixCacheRouter(block_size=8, router_kwargs={"block_size": 16})
    with pytest.raises(TypeError, match="prompt_ids"):
        chain_hashes("not tokens", BLOCK, 10)  # type: ignore[arg-type]


def test_async_twin_shares_the_index(make_pc, server):
    sync = make_pc(record_on_acquire=False)
    p = prompt(14, 10)
    sync.record_blocks("s2", sync.block_hashes(p))

    async def go() -> str:
        lb = AsyncPrefixCacheRouter(router_kwargs={"redis": server.url, "name": sync.name})
        assert isinstance(lb, AsyncRequestLoadBalancer)
        try:
            async with lb.lease("async-1", prompt_ids=p) as lease:
                return lease.server_id
        finally:
            await lb.close()

    assert asyncio.run(go()) == "s2"


def test_a_repeated_prompt_is_read_not_rewritten(make_pc, r):
    lb = make_pc(rng=random.Random(15))
    p = prompt(16, 40)
    first, _ = lb.acquire_server("a", prompt_ids=p)
    before = (index(r, lb.name), r.zrange(invariants.prefix(lb.name) + "pc:lru", 0, -1))
    assert set(before[0]) == set(lb.block_hashes(p)) and recorded(r, lb.name) == len(before[0])
    for k in range(5):  # within index_ttl / 16 of the write: the index is only read
        assert lb.acquire_server(f"b{k}", prompt_ids=p)[0] == first
        lb.release_server(first, f"b{k}")
    assert (index(r, lb.name), r.zrange(invariants.prefix(lb.name) + "pc:lru", 0, -1)) == before
    # An extension (a session's next turn) writes only the blocks it adds.
    longer = p + prompt(17, 24)
    assert lb.acquire_server("a", prompt_ids=longer)[0] == first  # sticky
    added = set(lb.block_hashes(longer)) - set(lb.block_hashes(p))
    assert recorded(r, lb.name) == len(before[0]) + len(added)


def test_evicting_an_old_write_keeps_blocks_renewed_since(make_pc, r):
    lb = make_pc(record_on_acquire=False, max_index_blocks=12)
    shared = prompt(18, 8)
    tail = [prompt(19 + k, 8) for k in range(2)]
    lb.record_blocks("s0", lb.block_hashes(shared + tail[0]))  # 10 hashes
    time.sleep(0.005)
    lb.record_blocks("s1", lb.block_hashes(shared))  # 8 more: 18 > 12, s0's write goes
    held = index(r, lb.name)
    assert recorded(r, lb.name) == 8 and set(held) == set(lb.block_hashes(shared))
    assert all(set(v) == {"s1"} for v in held.values())
    assert lb.acquire_server("q", prompt_ids=shared + tail[1])[0] == "s1"


def test_deepest_held_block_wins_even_if_shallower_ones_went(make_pc):
    lb = make_pc(record_on_acquire=False)
    p = prompt(21, 16)
    hashes = lb.block_hashes(p)
    lb.record_blocks("s1", hashes[:10])  # 12 of 16 blocks
    lb.record_blocks("s3", hashes)
    lb.evict_blocks("s3", hashes[:4])  # exact mode dropped s3's first blocks only
    for k in range(4):
        sid, _ = lb.acquire_server(f"q{k}", prompt_ids=p)
        assert sid == "s3"
        lb.release_server(sid, f"q{k}")


def test_a_batch_routes_as_one_acquire_after_another(make_pc, r):
    lb = make_pc(rng=random.Random(22))
    p = prompt(23, 12)
    got = lb.acquire_many([f"g{k}" for k in range(4)], prompt_ids=[p] * 4)
    assert len({sid for sid, _ in got}) == 1  # the first's write steers the other three
    assert recorded(r, lb.name) == len(lb.block_hashes(p))  # one write for the group
    assert invariants.check(r, lb.name)[got[0][0]] == 4


def test_base_lease_forwards_prompt_and_renews(make_pc, server, r):
    lb = make_pc(record_on_acquire=False, lease_ttl=1)
    p = prompt(24, 10)
    lb.record_blocks("s2", lb.block_hashes(p))
    with lb.lease("l", renew_every=0.05, prompt_ids=p) as lease:
        assert lease.server_id == "s2"
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)

    async def go() -> str:
        alb = AsyncPrefixCacheRouter(router_kwargs={"redis": server.url, "name": lb.name})
        try:
            async with alb.lease("al", renew_every=0.05, prompt_ids=p) as held:
                return held.server_id
        finally:
            await alb.close()

    assert asyncio.run(go()) == "s2"
    assert invariants.check(r, lb.name) == dict.fromkeys(SERVERS, 0)


@pytest.mark.parametrize(
    "ids, error",
    [
        ([1] * BLOCK + [2**64], ValueError),  # beyond 64 bits
        ([2**63] * BLOCK, ValueError),
        ([-(2**63) - 1], ValueError),  # however short: checked before anything is sent
        ([2**40, 1.5], TypeError),  # a wide id beside something that is no int
        ([2**40, "7"], TypeError),
    ],
)
def test_token_ids_no_64_bit_int_holds_are_refused_naming_prompt_ids(make_pc, r, ids, error):
    lb = make_pc(kv_block_size=16)
    before = sorted(r.keys("*"))
    with pytest.raises(error, match="prompt_ids") as info:
        lb.acquire_server("x", prompt_ids=ids)
    assert type(info.value) in (ValueError, TypeError)  # no OverflowError
    with pytest.raises(error, match="prompt_ids"):
        lb.acquire_many(["y", "z"], prompt_ids=[prompt(1, 2), ids])
    with pytest.raises(error, match="prompt_ids"):
        lb.block_hashes(ids)
    assert sorted(r.keys("*")) == before  # nothing written, not even the settings


def test_wide_token_ids_within_64_bits_still_route(make_pc):
    lb = make_pc()
    ids = [2**63 - 1 - i for i in range(2 * BLOCK)]
    first = lb.acquire_server("a", prompt_ids=ids)[0]
    assert lb.acquire_server("b", prompt_ids=ids)[0] == first  # found by its prefix


@pytest.mark.parametrize(
    "option, value",
    [
        ("block_size", 2**64),
        ("kv_block_size", 2**64),
        ("max_index_blocks", 2**70),
        ("kv_event_lag", 1e306),
        ("balance_abs_threshold", 1e306),
        ("balance_rel_threshold", 1e306),
    ],
)
def test_huge_options_are_refused_naming_them(option, value):
    with pytest.raises(ValueError, match=option):
        PrefixCacheRouter(router_kwargs={"redis": "redis://127.0.0.1:1/0", option: value})
