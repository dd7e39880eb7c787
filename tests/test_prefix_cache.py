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
from redis_router.plugins.prefix_cache import (
    AsyncPrefixCacheRouter,
    PrefixCacheRouter,
    chain_hashes,
    sample_depths,
)

from redis_router import AsyncRequestLoadBalancer, RequestLoadBalancer, get_router_handle

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


def index_keys(r: Any, name: str) -> list[str]:
    return list(r.scan_iter(match=invariants.prefix(name) + "pc:b:*", count=1000))


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


def test_imbalance_falls_back_to_least_loaded(make_pc, r):
    lb = make_pc(
        {"s0": None, "s1": None},
        record_on_acquire=False,
        balance_abs_threshold=2,
        balance_rel_threshold=1.5,
    )
    p = prompt(6, 10)
    lb.record_blocks("s0", lb.block_hashes(p))
    got = [lb.acquire_server(f"g{k}", prompt_ids=p)[0] for k in range(4)]
    # Loads 0/0, 1/0, 2/0 are within the thresholds; 3/0 exceeds both (3 > 2, 3 > 1.5 * 0).
    assert got == ["s0", "s0", "s0", "s1"]
    assert invariants.check(r, lb.name) == {"s0": 3, "s1": 1}


def test_index_stays_within_its_size_bound(make_pc, r):
    lb = make_pc(max_index_blocks=20)
    for k in range(30):
        sid, _ = lb.acquire_server(f"q{k}", prompt_ids=prompt(300 + k, 5))
        lb.release_server(sid, f"q{k}")
    p = invariants.prefix(lb.name)
    assert r.zcard(p + "pc:lru") == 20
    assert len(index_keys(r, lb.name)) == 20


def test_index_forgets_blocks_after_its_ttl(make_pc, r):
    lb = make_pc(index_ttl=0.05)
    for k in range(10):
        sid, _ = lb.acquire_server(f"old{k}", prompt_ids=prompt(400 + k, 5))
        lb.release_server(sid, f"old{k}")
    assert len(index_keys(r, lb.name)) == 50
    time.sleep(0.2)
    sid, _ = lb.acquire_server("new", prompt_ids=prompt(500, 3))
    assert r.zcard(invariants.prefix(lb.name) + "pc:lru") == 3  # only the new prompt's
    assert len(index_keys(r, lb.name)) == 3


def test_exact_mode_records_and_evicts(make_pc, r):
    lb = make_pc(record_on_acquire=False)
    p = prompt(7, 12)
    hashes = lb.block_hashes(p)
    assert lb.record_blocks("s3", hashes) == len(hashes)
    assert lb.acquire_server("a", prompt_ids=p)[0] == "s3"
    lb.release_server("s3", "a")
    pfx = invariants.prefix(lb.name)
    assert r.zcard(pfx + "pc:lru") == len(hashes)  # acquire recorded nothing of its own
    assert lb.evict_blocks("s3", hashes) == len(hashes)
    assert r.zcard(pfx + "pc:lru") == 0 and index_keys(r, lb.name) == []
    assert lb.record_blocks("not-a-replica", hashes) == 0  # I6: only pool members
    with pytest.raises(ValueError, match="hex"):
        lb.record_blocks("s3", ["nothex"])
    assert r.zcard(pfx + "pc:lru") == 0  # I8: bad input wrote nothing


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
