"""prefix_cache routing on the exact KV-block index (kv_block_size set): replicas whose
KV-events stream is exact are judged by what their engine reported (batches applied through
the index's own script, kv_index_apply.lua), the others by the approximate record; on every
server binary."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from redis_router.kv_events import BlockRemoved
from redis_router.plugins.prefix_cache import PrefixCacheRouter, PrefixSettings

from . import exact_index, invariants
from .exact_index import BLOCK, KV_BLOCK, SERVERS, Engine, prompt

_names = itertools.count()


@pytest.fixture
def make_pc(server: Any) -> Iterator[Callable[..., PrefixCacheRouter]]:
    with exact_index.routers(server.url, name="pcx") as make:
        yield make


@pytest.fixture
def engines(r: Any) -> Callable[..., dict[str, Engine]]:
    def make(*sids: str, stale: float = 10.0) -> dict[str, Engine]:
        return exact_index.engines(r, "pcx", sids, stale)

    return make


def route(lb: PrefixCacheRouter, tokens: list[int], *, keep: bool = False) -> str:
    rid = f"q{next(_names)}"
    sid, _ = lb.acquire_server(rid, prompt_ids=tokens)
    if not keep:
        lb.release_server(sid, rid)
    return sid


def test_exact_replicas_route_by_the_blocks_their_engine_reported(make_pc, engines):
    lb = make_pc(kv_event_lag=0)  # acquires' own records never count for exact replicas
    es = engines(*SERVERS)
    prompts = {sid: prompt(k) for k, sid in enumerate(SERVERS)}
    for sid, p in prompts.items():
        es[sid].store(p)
    for _ in range(3):
        for sid, p in prompts.items():
            assert route(lb, p) == sid


def test_an_eviction_the_engine_reported_moves_the_prompt(make_pc, engines):
    lb = make_pc(kv_event_lag=0)
    es = engines("s0", "s1", "s2", "s3")
    p = prompt(1)
    hashes = es["s0"].store(p)
    assert route(lb, p) == "s0"  # also leaves an approximate record for s0
    es["s0"].publish(BlockRemoved(hashes))
    es["s1"].store(p)
    assert {route(lb, p) for _ in range(4)} == {"s1"}


def test_a_degraded_replica_falls_back_to_its_approximate_record(make_pc, engines, r):
    lb = make_pc()
    es = engines("s0", "s1", stale=0.2)
    p = prompt(2)
    es["s0"].store(p)  # s0's engine holds p, but no subscriber will vouch for it
    lb.record_blocks("s2", lb.block_hashes(p))  # s2 has no stream: approximate
    time.sleep(0.3)
    secs, micros = r.time()
    assert int(r.hget(invariants.prefix("pcx") + "kv:exact", "s0")) < secs * 1000 + micros // 1000
    assert {route(lb, p) for _ in range(4)} == {"s2"}


def test_an_exact_replica_ignores_its_approximate_records_older_than_the_lag(make_pc, engines):
    lb = make_pc(kv_event_lag=1.0)
    engines(*SERVERS)  # every replica exact, none reported anything
    p = prompt(3)
    first = route(lb, p, keep=True)
    # Sent to `first` a moment ago: its events are not in yet, the record stands in.
    assert {route(lb, p, keep=True) for _ in range(3)} == {first}
    time.sleep(1.1)
    # The engine never reported p: past the lag, nothing holds it and least-loaded decides.
    assert route(lb, p) != first


def test_the_deepest_prefix_wins_across_both_indexes(make_pc, engines):
    lb = make_pc(kv_event_lag=0, min_match=0.25, record_on_acquire=False)
    es = engines("s0", "s1")
    p = prompt(4)  # 8 blocks of 32 tokens, 16 engine blocks
    es["s0"].store(p[: 4 * BLOCK])  # exact: half the prompt
    lb.record_blocks("s2", lb.block_hashes(p[: 6 * BLOCK]))  # approximate: three quarters
    assert {route(lb, p) for _ in range(3)} == {"s2"}
    es["s1"].store(p)  # exact: all of it
    assert {route(lb, p) for _ in range(3)} == {"s1"}


def test_equal_depths_pool_their_holders_least_loaded_first(make_pc, engines):
    lb = make_pc(kv_event_lag=0)
    es = engines("s0", "s1")
    p = prompt(5)
    es["s0"].store(p)
    lb.record_blocks("s2", lb.block_hashes(p))  # not exact: the approximate record counts
    on_s0, on_s2 = prompt(50), prompt(51)
    es["s0"].store(on_s0)
    lb.record_blocks("s2", lb.block_hashes(on_s2))
    assert route(lb, on_s0, keep=True) == "s0"
    assert route(lb, p) == "s2"  # s0 and s2 hold all of p: the less loaded wins
    assert route(lb, on_s2, keep=True) == "s2"
    assert route(lb, on_s2, keep=True) == "s2"
    assert route(lb, p) == "s0"


def test_several_workers_route_identically(make_pc, engines):
    workers = [make_pc(kv_event_lag=0) for _ in range(3)]
    es = engines(*SERVERS)
    prompts = [prompt(10 + k) for k in range(8)]
    for k, p in enumerate(prompts):
        es[f"s{k % 4}"].store(p[: (k % 3 + 1) * 4 * KV_BLOCK] + p[200:])
        es[f"s{(k + 1) % 4}"].store(p)
    for p in prompts:
        assert len({route(w, p) for w in workers}) == 1


def test_imbalance_still_overrides_the_exact_index(make_pc, engines):
    lb = make_pc(kv_event_lag=0, balance_abs_threshold=2, balance_rel_threshold=1.0)
    es = engines(*SERVERS)
    p = prompt(6)
    es["s0"].store(p)
    # Prompts that share p and go on (8 of their 10 blocks cached on s0).
    assert route(lb, p + prompt(60, 2 * BLOCK), keep=True) == "s0"
    # s0 would carry 2 over a median of 0: not hot yet
    assert route(lb, p + prompt(61, 2 * BLOCK), keep=True) == "s0"
    # 3 over 0 would be: least-loaded wins
    assert route(lb, p + prompt(62, 2 * BLOCK), keep=True) != "s0"


def test_a_whole_prompt_repeated_yields_only_far_above_the_least_loaded(make_pc, engines):
    lb = make_pc(kv_event_lag=0, balance_abs_threshold=2, balance_rel_threshold=1.0)
    es = engines(*SERVERS)
    p = prompt(6)
    es["s0"].store(p)
    # A GRPO group's samples: the engine holds all of each; 4 over 0 is not more than 2 x 2
    # (the median test alone would have moved the third).
    assert [route(lb, p, keep=True) for _ in range(4)] == ["s0"] * 4
    assert route(lb, p, keep=True) != "s0"  # 5 over 0 is


def test_off_by_default_and_bad_options_are_refused(server):
    assert PrefixSettings().kv_block_size is None
    with pytest.raises(ValueError, match="kv_block_size"):
        PrefixSettings(kv_block_size=0)
    with pytest.raises(TypeError, match="kv_block_size"):
        PrefixSettings(kv_block_size="16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_event_lag"):
        PrefixSettings(kv_event_lag=-1)


def test_bad_prompt_writes_nothing(make_pc, engines, r):
    lb = make_pc()
    engines("s0")
    keys = sorted(r.keys("rr:{pcx}:*"))
    dump = {k: r.dump(k) for k in keys}
    with pytest.raises(TypeError, match="prompt_ids"):
        lb.acquire_server("bad", prompt_ids="hello")
    with pytest.raises(TypeError, match="prompt_ids"):
        lb.acquire_server("bad", prompt_ids=[1, "x", 3])
    assert sorted(r.keys("rr:{pcx}:*")) == keys
    assert {k: r.dump(k) for k in keys} == dump


def test_token_ids_no_engine_could_cache_route_on_the_approximate_index(make_pc, engines):
    lb = make_pc()
    engines("s0")
    p = [-1, *prompt(7)[1:]]  # a negative id: no exact hashes, the approximate index still works
    first = route(lb, p, keep=True)
    assert route(lb, p) == first


def test_the_asyncio_twin_routes_on_the_exact_index_too(server, make_pc, engines):
    import asyncio

    from redis_router.plugins.prefix_cache import AsyncPrefixCacheRouter

    make_pc()  # registers the replicas
    es = engines("s0", "s1", "s2", "s3")
    prompts = {sid: prompt(20 + k) for k, sid in enumerate(SERVERS)}
    for sid, p in prompts.items():
        es[sid].store(p)

    async def main() -> list[str]:
        lb = AsyncPrefixCacheRouter(
            SERVERS,
            router_kwargs={"redis": server.url, "name": "pcx", "kv_block_size": KV_BLOCK,
                           "kv_event_lag": 0},
        )  # fmt: skip
        try:
            out = []
            for k, p in enumerate(prompts.values()):
                sid, _ = await lb.acquire_server(f"a{k}", prompt_ids=p)
                await lb.release_server(sid, f"a{k}")
                out.append(sid)
            return out
        finally:
            await lb.close()

    assert asyncio.run(main()) == list(prompts)


def test_without_any_healthy_stream_the_approximate_index_routes(make_pc, r):
    lb = make_pc()
    p = prompt(8)
    lb.record_blocks("s1", lb.block_hashes(p))
    assert r.hlen(invariants.prefix("pcx") + "kv:exact") == 0
    assert {route(lb, p) for _ in range(4)} == {"s1"}


def test_exact_hashes_continued_from_remembered_prefixes_equal_fresh_ones():
    """A repeated, extended or diverging prompt resumes from a remembered prefix: the hashes it
    sends are those block_hashes computes from scratch."""
    from redis_router.kv_events import block_hashes
    from redis_router.plugins.prefix_cache import PrefixCache, sample_depths

    rng = random.Random(3)
    base = [rng.randrange(50_000) for _ in range(3000)]
    prompts = [base[:1000], base[:1000], base, base[:2500] + [7] * 300, base[:37], base[:5]]
    prompts += [[rng.randrange(50_000) for _ in range(rng.randrange(1, 2000))] for _ in range(20)]
    prompts += [[*p[: rng.randrange(1, len(p) + 1)], 1, 2, 3] for p in prompts[:10]]
    for kbs, bs in ((16, 32), (16, 16), (32, 16), (12, 32)):
        policy = PrefixCache(block_size=bs, kv_block_size=kbs, max_prompt_blocks=64)
        for p in prompts:
            _, _, _, got, info = policy.request_args({"prompt_ids": p})
            chain = block_hashes(p[: 64 * bs], kbs)
            n = len(chain)
            want = "".join(chain[d - 1] for d in sample_depths(n))
            assert got == want, (kbs, bs, len(p))
            assert info.split()[1:] == [str(n), str(min(len(p), 64 * bs) // bs)]
    assert policy._exact is not None and policy._exact.memo  # prefixes were remembered


def test_token_ids_past_uint32_give_no_exact_hashes():
    from redis_router.plugins.prefix_cache import PrefixCache

    policy = PrefixCache(kv_block_size=16)
    _, hexed, _, kv, info = policy.request_args({"prompt_ids": [2**32, *range(100)]})
    assert hexed and kv == "" and info.split()[1] == "0"
