"""The least-tokens plugin: balancing by in-flight prompt tokens, with the core's leases."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from redis_router import (
    AsyncRequestLoadBalancer,
    RequestLoadBalancer,
    RouterClient,
    get_router_handle,
)
from redis_router.plugins.least_tokens import AsyncLeastTokensRouter, LeastTokensRouter

from . import invariants

SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(4)}
YAML = "plugins/least_tokens.yaml"


@pytest.fixture
def make_lt(make_lb: Callable[..., Any]) -> Callable[..., LeastTokensRouter]:
    """Least-tokens routers on the test's server (conftest's make_lb with this class)."""

    def make(servers: Any = SERVERS, **kw: Any) -> LeastTokensRouter:
        return make_lb(servers, cls=LeastTokensRouter, **kw)

    return make


def check_weights(r: Any, name: str) -> dict[str, int]:
    """I1 via invariants.check, and: every replica's weighted total equals the sum of the
    weights of its live leases (a weight lives in its lease's record, so it cannot outlive
    it). Returns the totals."""
    counts = invariants.check(r, name)
    p = invariants.prefix(name)
    expected = dict.fromkeys(counts, 0)
    for record in r.hvals(p + "leases"):
        sid, _rid, _holder, *weight = record.split(invariants.SEP)
        expected[sid] += sum(int(w) for w in weight)
    totals = {sid: int(score) for sid, score in r.zrange(p + "weighted", 0, -1, withscores=True)}
    assert totals == expected, (totals, expected)
    return totals


def prompt(n: int) -> list[int]:
    return [7] * n


def test_satisfies_the_protocol_and_declares_its_fields(make_lt, server):
    lb = make_lt()
    assert isinstance(lb, RequestLoadBalancer)
    assert lb.require_acquire_fields() == ["prompt_ids"]
    assert lb.require_release_fields() == ["request_id"]
    alb = AsyncLeastTokensRouter(SERVERS, redis=server.url, name=lb.name)
    assert isinstance(alb, RequestLoadBalancer)
    assert isinstance(alb, AsyncRequestLoadBalancer)


def test_new_session_goes_to_fewest_tokens_not_fewest_requests(make_lt, r):
    lb = make_lt({"a": None, "b": None})
    big = lb.acquire_server("big", prompt_ids=prompt(1000))
    other = "b" if big[0] == "a" else "a"
    for i in range(3):  # three small requests: the other replica now has more requests
        assert lb.acquire_server(f"small-{i}", prompt_ids=prompt(10))[0] == other
    assert lb.get_inflight_count(other) == 3 > lb.get_inflight_count(big[0]) == 1
    assert lb.acquire_server("next", prompt_ids=prompt(10))[0] == other  # 30 < 1000 tokens
    assert check_weights(r, lb.name) == {big[0]: 1000, other: 40}


def test_idle_pool_ties_spread_evenly(make_lt, r):
    lb = make_lt(rng=random.Random(7))
    seen: dict[str, int] = {}
    for i in range(200):
        sid, _ = lb.acquire_server(f"fan-{i}", prompt_ids=prompt(100))
        seen[sid] = seen.get(sid, 0) + 1
        lb.release_server(sid, f"fan-{i}")
    assert invariants.fair(seen, 200, 4), seen
    assert check_weights(r, lb.name) == dict.fromkeys(SERVERS, 0)


def test_sticky_session_returns_to_its_replica_and_adds_its_weight(make_lt, r):
    lb = make_lt()
    sid, _ = lb.acquire_server("chat", prompt_ids=prompt(5000))
    lb.release_server(sid, "chat")
    for sid2 in SERVERS:  # load every other replica less than this one will be
        if sid2 != sid:
            lb.acquire_server(f"filler-{sid2}", prompt_ids=prompt(1))
    turn2, _ = lb.acquire_server("chat", prompt_ids=prompt(6000))
    turn3, _ = lb.acquire_server("chat", prompt_ids=prompt(7000))
    assert turn2 == turn3 == sid  # sticky, although it is now by far the heaviest
    assert check_weights(r, lb.name)[sid] >= 13000


def test_draining_replica_gets_no_new_sessions_only_sticky_ones(make_lt, r):
    lb = make_lt({"a": None, "b": None, "c": None})
    sid, _ = lb.acquire_server("chat", prompt_ids=prompt(1))
    lb.release_server(sid, "chat")
    lb.drain_servers([sid])  # now the lightest replica (0 tokens), but draining
    for i in range(6):
        assert lb.acquire_server(f"new-{i}", prompt_ids=prompt(50))[0] != sid
    assert lb.acquire_server("chat", prompt_ids=prompt(50))[0] == sid  # sticky still served
    check_weights(r, lb.name)


def test_weights_stay_exact_over_a_mixed_workload(make_lt, r):
    lb = make_lt(rng=random.Random(3))
    rng = random.Random(11)
    live: list[tuple[str, str]] = []
    for i in range(300):
        if live and rng.random() < 0.45:
            sid, rid = live.pop(rng.randrange(len(live)))
            assert lb.release_server(sid, rid)
        else:
            rid = f"req-{rng.randrange(60)}"  # repeats: sticky turns, several leases per id
            sid, _ = lb.acquire_server(rid, prompt_ids=prompt(rng.choice([0, 3, 80, 2000])))
            live.append((sid, rid))
        if i % 50 == 0:
            check_weights(r, lb.name)
    check_weights(r, lb.name)
    for sid, rid in live:
        assert lb.release_server(sid, rid)
    assert check_weights(r, lb.name) == dict.fromkeys(SERVERS, 0)
    assert r.exists(invariants.prefix(lb.name) + "weights") == 0


def test_reclaimed_leases_take_their_weight_with_them(make_lt, r):
    lb = make_lt(lease_ttl=0.5)
    for i in range(5):
        lb.acquire_server(f"lost-{i}", prompt_ids=prompt(100 * (i + 1)))
    assert sum(check_weights(r, lb.name).values()) == 1500
    invariants.silence(lb)  # its process "died": no more heartbeats
    invariants.listen(lb, 0.7)  # other workers are heard meanwhile: it is dead
    assert lb.reap() == 5
    assert check_weights(r, lb.name) == dict.fromkeys(SERVERS, 0)


def test_removing_a_replica_drops_its_weight_and_a_late_release_is_a_noop(make_lt, r):
    lb = make_lt({"a": None, "b": None})
    held = [lb.acquire_server(f"r{i}", prompt_ids=prompt(100)) for i in range(4)]
    gone = held[0][0]
    assert lb.remove_servers([gone]) == 1
    totals = check_weights(r, lb.name)
    assert gone not in totals
    assert not lb.release_server(gone, "r0")
    lb.add_servers({gone: None})  # back, and empty
    assert check_weights(r, lb.name)[gone] == 0


def test_bad_prompt_is_refused_before_anything_is_written(make_lt, r):
    lb = make_lt()
    before = sorted(r.keys("*"))
    with pytest.raises(TypeError, match="prompt_ids"):
        lb.acquire_server("x", prompt_ids="not tokens")
    with pytest.raises(TypeError, match="prompt_ids"):
        lb.acquire_server("x", prompt_ids=42)
    assert sorted(r.keys("*")) == before


def test_full_determinism_routes_like_the_core(make_lt, make_lb):
    lt = make_lt(full_determinism=True)
    core = make_lb(SERVERS, full_determinism=True)
    for i in range(40):
        assert (
            lt.acquire_server(f"d{i}", prompt_ids=prompt(i))[0] == core.acquire_server(f"d{i}")[0]
        )


def test_lease_is_weighed_and_released_once(make_lt, r):
    lb = make_lt()
    with lb.lease("L", prompt_ids=prompt(321)) as lease:
        assert check_weights(r, lb.name)[lease.server_id] == 321
    assert not lease.release()
    assert check_weights(r, lb.name) == dict.fromkeys(SERVERS, 0)


def test_acquire_many_weighs_each_request(make_lt, r):
    lb = make_lt({"a": None, "b": None})
    got = lb.acquire_many(["x", "y", "z"], prompt_ids=[prompt(900), prompt(10), prompt(10)])
    assert got[1][0] == got[2][0] != got[0][0]  # y and z both fit beside x's 900 tokens
    assert sorted(check_weights(r, lb.name).values()) == [20, 900]


def test_loads_from_its_yaml_with_the_url_from_the_environment(server, r, monkeypatch):
    monkeypatch.setenv("REDIS_URL", server.url)
    lb = get_router_handle(SERVERS, YAML, name="lt-yaml")
    try:
        assert type(lb) is LeastTokensRouter
        sid, _ = lb.acquire_server("y", prompt_ids=prompt(12))
        assert check_weights(r, "lt-yaml")[sid] == 12
    finally:
        lb.close()


def test_async_twin_shares_the_balancer_through_router_client(make_lt, server, r):
    lb = make_lt()

    async def main() -> None:
        alb = AsyncLeastTokensRouter(redis=server.url, name=lb.name)
        client = RouterClient(alb)
        async with client.session("a1", prompt_ids=prompt(70), sampling_params={}) as (sid, _):
            assert check_weights(r, lb.name)[sid] == 70
            async with alb.lease("a2", prompt_ids=prompt(5)) as lease:
                assert check_weights(r, lb.name)[lease.server_id] == 5 + 70 * (
                    lease.server_id == sid
                )
        await alb.close()

    asyncio.run(main())
    assert check_weights(r, lb.name) == dict.fromkeys(SERVERS, 0)


# -- the figure: peak outstanding tokens per replica, tokens vs request counts ---------------


def mixed_workload(seed: int, n: int = 600) -> list[tuple[int, int]]:
    """(prompt tokens, duration in steps) per request: 80% short prompts (50-500 tokens), 20%
    long ones (4k-16k). Durations do not depend on length, so holding a long prompt longer
    does not favour either router."""
    rng = random.Random(seed)
    return [
        (
            rng.randint(50, 500) if rng.random() < 0.8 else rng.randint(4000, 16000),
            rng.randint(4, 40),
        )
        for _ in range(n)
    ]


def peak_tokens(lb: RequestLoadBalancer, work: list[tuple[int, int]]) -> tuple[int, float]:
    """Replay the workload (one arrival per step, each request held for its duration) and
    return the peak, over time, of the heaviest replica's outstanding tokens, and its mean."""
    client = RouterClient(lb)
    outstanding = dict.fromkeys(SERVERS, 0)
    running: list[tuple[int, str, str, int]] = []  # (end step, server, request id, tokens)
    peak, total = 0, 0
    for step, (tokens, duration) in enumerate(work):
        for item in [x for x in running if x[0] <= step]:
            running.remove(item)
            _, sid, rid, n = item
            lb.release_server(sid, **({"request_id": rid} if client.fields_sync()[1] else {}))
            outstanding[sid] -= n
        wanted = client.fields_sync()[0]
        fields = {"prompt_ids": prompt(tokens)} if "prompt_ids" in wanted else {}
        sid, _ = lb.acquire_server(f"w{step}", **fields)
        outstanding[sid] += tokens
        running.append((step + duration, sid, f"w{step}", tokens))
        heaviest = max(outstanding.values())
        peak, total = max(peak, heaviest), total + heaviest
    return peak, total / len(work)


def test_peak_outstanding_tokens_is_lower_than_request_count_balancing(make_lt, make_lb, r):
    work = mixed_workload(seed=2024)
    by_tokens = peak_tokens(make_lt(rng=random.Random(5)), work)
    by_count = peak_tokens(make_lb(SERVERS, rng=random.Random(5)), work)
    print(
        f"\npeak outstanding tokens per replica: least-tokens {by_tokens[0]}, request count "
        f"{by_count[0]} ({by_tokens[0] / by_count[0]:.2f}x); mean of the heaviest replica: "
        f"{by_tokens[1]:.0f} vs {by_count[1]:.0f}"
    )
    assert by_tokens[0] < by_count[0]
    assert by_tokens[1] < by_count[1]


class _Endless:
    """A sequence-like object whose length no Python int holds (len() raises OverflowError)."""

    def __len__(self) -> int:
        return 2**64


def test_a_prompt_whose_length_is_no_int_is_refused_naming_prompt_ids(make_lt, r):
    lb = make_lt()
    before = sorted(r.keys("*"))
    with pytest.raises(TypeError, match="prompt_ids"):
        lb.acquire_server("x", prompt_ids=_Endless())
    assert sorted(r.keys("*")) == before
