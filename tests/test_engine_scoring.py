"""Engine-aware scoring: least loaded on lease counts plus what the engines report beyond them.

Reports go through the public report_engine_load (as `redis-router load` sends them); every
test ends with the invariants, I12 included (a replica's score is its count plus its extra).
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from redis_router import (
    AsyncRedisLoadBalancer,
    ConfigMismatch,
    EngineLoad,
    EngineScoring,
    RedisLoadBalancer,
)
from redis_router.plugins.prefix_cache import PrefixCacheRouter

from . import invariants

ABC = {"a": None, "b": None, "c": None}


def _placed(lb: RedisLoadBalancer, n: int, tag: str) -> collections.Counter[str]:
    """Where n new sessions go (their leases held)."""
    return collections.Counter(lb.acquire_server(f"{tag}{i}")[0] for i in range(n))


def test_requests_sent_around_the_router_count_as_load(make_lb, r):
    lb = make_lb(ABC, engine_scoring=True)
    # b's engine runs 10 requests this library never leased (another client sends them).
    assert lb.report_engine_load({"b": EngineLoad(running=10, waiting=0)}) == 1
    first = _placed(lb, 20, "s")
    assert first == {"a": 10, "c": 10}  # b's score is 10 until the others reach it
    again = _placed(lb, 3, "t")
    assert again == {"a": 1, "b": 1, "c": 1}  # then all three tie
    assert invariants.check(r, lb.name) == {"a": 11, "b": 1, "c": 11}


def test_the_same_pool_on_counts_alone_ignores_the_report(make_lb, r):
    lb = make_lb(ABC)
    lb.report_engine_load({"b": EngineLoad(running=10, waiting=0)})
    assert _placed(lb, 21, "s") == {"a": 7, "b": 7, "c": 7}
    assert r.exists(invariants.prefix(lb.name) + "escore") == 0
    invariants.check(r, lb.name)


def test_leases_taken_since_a_report_are_not_counted_twice(make_lb, r):
    lb = make_lb(ABC, engine_scoring=True)
    _placed(lb, 3, "s")  # one lease on each
    # Each engine runs exactly the request leased here: nothing beyond the leases.
    lb.report_engine_load({s: EngineLoad(running=1, waiting=0) for s in ABC})
    assert _placed(lb, 6, "t") == {"a": 2, "b": 2, "c": 2}
    invariants.check(r, lb.name)


def test_kv_usage_weighs_as_requests(make_lb, r):
    lb = make_lb(ABC, engine_scoring={"kv_weight": 4.0})
    lb.report_engine_load({"a": EngineLoad(0, 0, kv_usage=1.0), "b": EngineLoad(0, 0, 0.5)})
    # a scores 4, b 2, c 0: c takes 2 before b ties it, then 2 each before a ties them.
    assert _placed(lb, 6, "s") == {"b": 2, "c": 4}
    invariants.check(r, lb.name)


def test_a_replica_past_the_kv_ceiling_takes_no_new_session_while_another_is_below(make_lb, r):
    lb = make_lb({"a": None, "b": None}, engine_scoring={"kv_ceiling": 0.9, "kv_weight": 0.0})
    lb.report_engine_load({"a": EngineLoad(0, 0, kv_usage=0.95)})
    assert _placed(lb, 30, "s") == {"b": 30}
    # Both past it: the ceiling steers, it never refuses (the engines queue).
    lb.report_engine_load({"b": EngineLoad(30, 0, kv_usage=0.97)})
    assert _placed(lb, 30, "t") == {"a": 30}
    assert invariants.check(r, lb.name) == {"a": 30, "b": 30}


def test_a_stale_report_counts_for_nothing(make_lb, r):
    lb = make_lb(ABC, engine_scoring={"ttl": 0.2})
    lb.report_engine_load({"b": EngineLoad(running=50, waiting=0)})
    assert _placed(lb, 4, "s") == {"a": 2, "c": 2}
    time.sleep(0.35)  # the reporter died: its last report ages past the ttl
    assert _placed(lb, 1, "t") == {"b": 1}  # the only replica with the least count now
    p = invariants.prefix(lb.name)
    assert r.hget(p + "eextra", "b") is None and r.zscore(p + "engine_at", "b") is None
    assert r.hget(p + "engine", "b") is not None  # status still shows it, with its age
    assert lb.get_status()["replicas"]["b"]["engine"]["age_s"] >= 0.3
    invariants.check(r, lb.name)


def test_a_sticky_session_moves_off_a_queueing_replica_only_with_a_margin(make_lb, r):
    lb = make_lb({"a": None, "b": None}, engine_scoring=True, affinity_margin=2)
    first = lb.acquire_server("chat")[0]
    other = "b" if first == "a" else "a"
    lb.release_server(first, "chat")
    # Far above the other by the report, but its engine queues nothing: the session stays
    # (its next turn runs at once, on its cache).
    lb.report_engine_load({first: EngineLoad(running=8, waiting=0)})
    assert lb.acquire_server("chat")[0] == first
    lb.release_server(first, "chat")
    # Its engine now queues: the session moves to the other replica.
    lb.report_engine_load({first: EngineLoad(running=8, waiting=3)})
    assert lb.acquire_server("chat")[0] == other
    assert lb.get_status()["replicas"][first]["repins"] == 1
    invariants.check(r, lb.name)


def test_without_a_margin_a_sticky_session_stays_whatever_its_engine_reports(make_lb, r):
    lb = make_lb({"a": None, "b": None}, engine_scoring={"kv_ceiling": 0.5})
    first = lb.acquire_server("chat")[0]
    lb.report_engine_load({first: EngineLoad(running=8, waiting=8, kv_usage=1.0)})
    assert lb.acquire_server("chat")[0] == first
    invariants.check(r, lb.name)


def test_scores_follow_every_count_change(make_lb, r, server):
    lb = make_lb(ABC, engine_scoring=True)
    lb.report_engine_load({"a": EngineLoad(3, 1, 0.25), "c": EngineLoad(0, 2)})
    grants = [(lb.acquire_server(f"s{i}")[0], f"s{i}") for i in range(12)]
    invariants.check(r, lb.name)
    for sid, rid in grants[::2]:
        lb.release_server(sid, rid)
    lb.drain_servers(["b"])
    lb.add_servers({"d": None})
    invariants.check(r, lb.name)
    lb.report_engine_load({"b": EngineLoad(9, 9, 0.9)})
    lb.remove_servers(["a"])
    lb.undrain_servers(["b"])
    with lb.lease("held") as lease:
        assert lease.server_id in ("b", "c", "d")
        invariants.check(r, lb.name)
    # Scores lost (a key deleted by hand): the next acquire makes them again.
    r.delete(invariants.prefix(lb.name) + "escore")
    lb.acquire_server("after")
    counts = invariants.check(r, lb.name)
    assert r.zcard(invariants.prefix(lb.name) + "escore") == len(counts) == 3
    lb.destroy()
    assert r.keys(invariants.prefix(lb.name) + "*") == []


def test_every_process_must_score_alike(make_lb, server):
    lb = make_lb(ABC, engine_scoring={"ttl": 5.0})
    lb.acquire_server("x")  # pins the setting
    with pytest.raises(ConfigMismatch, match="engine_scoring") as caught:
        RedisLoadBalancer(redis=server.url, name=lb.name, engine_scoring=True)
    assert "ttl=5.0" in str(caught.value) and "ttl=10.0" in str(caught.value)
    with pytest.raises(ConfigMismatch, match="engine_scoring"):
        RedisLoadBalancer(redis=server.url, name=lb.name)
    same = RedisLoadBalancer(redis=server.url, name=lb.name, engine_scoring=EngineScoring(5.0))
    assert same.acquire_server("y")[0] in ABC
    assert same.get_status()["engine_scoring"] == {"ttl": 5.0, "kv_weight": 4.0, "kv_ceiling": None}
    same.close()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("yes", TypeError, "engine_scoring must be None, a bool, a mapping"),
        ({"ttl": 0}, ValueError, r"engine_scoring.ttl must be in \[0.1, 3600\]"),
        ({"kv_weight": -1}, ValueError, "engine_scoring.kv_weight"),
        ({"kv_ceiling": 1.5}, ValueError, r"engine_scoring.kv_ceiling must be in \(0, 1\]"),
        ({"kv_ceiling": "high"}, TypeError, "engine_scoring.kv_ceiling must be a number"),
        ({"ttl": float("nan")}, ValueError, "engine_scoring.ttl"),
        ({"weight": 2}, ValueError, "unknown fields.*allowed are ttl, kv_weight, kv_ceiling"),
    ],
)
def test_bad_scoring_options_are_refused_before_any_write(server, r, value, error, match):
    with pytest.raises(error, match=match):
        RedisLoadBalancer(ABC, redis=server.url, name="bad", engine_scoring=value)
    assert r.keys("rr:{bad}:*") == []


def test_prefix_cache_places_prompts_it_has_not_seen_by_engine_scores(make_lb, r):
    lb = make_lb(ABC, cls=PrefixCacheRouter, engine_scoring=True)
    lb.report_engine_load({"a": EngineLoad(20, 0), "b": EngineLoad(20, 0)})
    placed = collections.Counter(
        lb.acquire_server(f"p{i}", prompt_ids=[i] * 64)[0] for i in range(10)
    )
    assert placed == {"c": 10}
    invariants.check(r, lb.name)


def test_asyncio_balancer_scores_alike(server, r):
    async def main() -> collections.Counter[str]:
        async with AsyncRedisLoadBalancer(
            ABC, redis=server.url, name="aeng", engine_scoring=True
        ) as lb:
            assert await lb.report_engine_load({"a": EngineLoad(6, 0)}) == 1
            got = await asyncio.gather(*(lb.acquire_server(f"s{i}") for i in range(12)))
            return collections.Counter(sid for sid, _ in got)

    placed = asyncio.run(main())
    # a scores 6: the others reach it after 6 each, whatever order the batch ran in.
    assert placed == {"b": 6, "c": 6}
    invariants.check(r, "aeng")


def test_no_replica_to_pick_is_refused_as_on_counts(make_lb, r):
    from redis_router import NoCapacity, NoServersAvailable

    lb = make_lb({"a": None, "b": None}, engine_scoring=True)
    lb.report_engine_load({"a": EngineLoad(1, 0)})
    lb.drain_servers(["a", "b"])
    with pytest.raises(NoServersAvailable):
        lb.acquire_server("x")
    lb.undrain_servers(["b"])
    assert lb.acquire_server("x")[0] == "b"  # a drains still: scores skip it
    full = make_lb({"c": {"url": "u", "capacity": 1}}, engine_scoring=True)
    full.acquire_server("held")
    with pytest.raises(NoCapacity):
        full.acquire_server("refused")
    invariants.check(r, lb.name)
    invariants.check(r, full.name)


def test_least_tokens_values_what_its_engine_holds_in_tokens(make_lb, r):
    from redis_router.plugins.least_tokens import LeastTokensRouter

    lb = make_lb(ABC, cls=LeastTokensRouter, engine_scoring={"kv_weight": 0.0})
    # One 100-token lease on each, then b's engine runs 3 requests beyond its lease: worth
    # 300 tokens at b's 100 tokens per lease.
    for i, sid in enumerate(ABC):
        assert lb.acquire_server(f"warm-{sid}", prompt_ids=[i] * 100)[0] in ABC
    lb.report_engine_load({"b": EngineLoad(running=4, waiting=0)})
    p = invariants.prefix(lb.name)
    placed = collections.Counter(
        lb.acquire_server(f"s{i}", prompt_ids=[7] * 50)[0] for i in range(12)
    )
    assert placed == {"a": 6, "c": 6}  # 300 more tokens each before b ties them
    assert float(r.hget(p + "wextra", "b")) == 300.0
    invariants.check(r, lb.name)
    # A stale report counts for nothing here too; removing the replica drops its scores.
    lb.remove_servers(["b"])
    assert r.hget(p + "wextra", "b") is None and r.zscore(p + "wscore", "b") is None
    invariants.check(r, lb.name)


def test_least_tokens_without_scoring_ignores_the_reports(make_lb, r):
    from redis_router.plugins.least_tokens import LeastTokensRouter

    lb = make_lb(ABC, cls=LeastTokensRouter)
    lb.report_engine_load({"b": EngineLoad(running=40, waiting=0)})
    placed = collections.Counter(
        lb.acquire_server(f"s{i}", prompt_ids=[1] * 10)[0] for i in range(9)
    )
    assert placed == {"a": 3, "b": 3, "c": 3}
    assert r.exists(invariants.prefix(lb.name) + "wscore") == 0
    invariants.check(r, lb.name)


def test_reports_written_before_scoring_was_pinned_count_for_both_policies(make_lb, r, server):
    from redis_router.plugins.least_tokens import LeastTokensRouter

    # (least_tokens values the extra at 1 token a request while no lease is weighed)
    for cls, fields in ((RedisLoadBalancer, {}), (LeastTokensRouter, {"prompt_ids": [1]})):
        plain = make_lb(ABC, cls=cls)
        plain.report_engine_load({"b": EngineLoad(running=5, waiting=0)})  # nothing pinned yet
        scored = make_lb(cls=cls, name=plain.name, engine_scoring=True)
        placed = collections.Counter(scored.acquire_server(f"s{i}", **fields)[0] for i in range(4))
        assert placed["b"] == 0, (cls.__name__, placed)
        invariants.check(r, plain.name)
