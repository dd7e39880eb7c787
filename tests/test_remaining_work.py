"""Remaining-work-aware placement: least_tokens with ``remaining_work=True`` weighs a lease by
its prompt and its expected output, and a renew sets the weight to what is left."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from redis_router.invoke import ENV
from redis_router.plugins.least_tokens import (
    AsyncLeastTokensRouter,
    LeastTokens,
    LeastTokensRouter,
)

from . import invariants
from .test_least_tokens import check_weights, prompt
from .test_validation import snapshot

TWO = {"a": None, "b": None}


@pytest.fixture
def make_rw(make_lb: Callable[..., Any]) -> Callable[..., LeastTokensRouter]:
    """least_tokens routers with remaining_work on, on the test's server."""

    def make(servers: Any = TWO, **kw: Any) -> LeastTokensRouter:
        kw.setdefault("remaining_work", True)
        return make_lb(servers, cls=LeastTokensRouter, **kw)

    return make


def record_weight(r: Any, name: str, token: str) -> int:
    """The weight a lease's record carries (0 when it carries none)."""
    rec = r.hget(invariants.prefix(name) + "leases", token)
    assert rec is not None, "no such lease"
    _sid, _rid, _holder, *w = rec.split(invariants.SEP)
    return int(w[0]) if w else 0


def test_off_by_default_declares_and_weighs_as_before(make_lb, r):
    lb = make_lb(TWO, cls=LeastTokensRouter)
    assert lb.require_acquire_fields() == ["prompt_ids"]
    assert lb.get_status()["policy"] == {"name": "least_tokens"}
    # Without the option the field is not read, so it is refused as any undeclared keyword.
    with pytest.raises(TypeError, match=r"\['expected_output_tokens'\]"):
        lb.acquire("x", prompt_ids=prompt(100), expected_output_tokens=500)
    lease = lb.acquire("x", prompt_ids=prompt(100))
    assert record_weight(r, lb.name, lease.token) == 100
    assert LeastTokens().request_args({"prompt_ids": prompt(7)}) == ("7",)
    with pytest.raises(ValueError, match="prefill_weight applies only with remaining_work"):
        LeastTokens(prefill_weight=0.5)


def test_weight_at_acquire_with_and_without_expected_output(make_rw, r):
    lb = make_rw(prefill_weight=0.5)
    assert lb.require_acquire_fields() == ["prompt_ids", "expected_output_tokens"]
    assert lb.get_status()["policy"] == {
        "name": "least_tokens",
        "remaining_work": True,
        "prefill_weight": 0.5,
    }
    with_out = lb.acquire("with", prompt_ids=prompt(1001), expected_output_tokens=300)
    without = lb.acquire("without", prompt_ids=prompt(1000))
    only_out = lb.acquire("only", expected_output_tokens=42)
    assert record_weight(r, lb.name, with_out.token) == round(0.5 * 1001) + 300 == 800
    assert record_weight(r, lb.name, without.token) == 500
    assert record_weight(r, lb.name, only_out.token) == 42
    totals = check_weights(r, lb.name)
    assert sum(totals.values()) == 800 + 500 + 42


def test_renew_with_progress_lowers_the_total_and_moves_the_next_session(make_rw, r):
    lb = make_rw(rng=random.Random(3))
    long = lb.acquire("long", prompt_ids=prompt(10), expected_output_tokens=1000)
    other = "b" if long.server_id == "a" else "a"
    short = lb.acquire("short", prompt_ids=prompt(10), expected_output_tokens=200)
    assert short.server_id == other  # 210 < 1010
    assert check_weights(r, lb.name) == {long.server_id: 1010, other: 210}
    # Before any progress a new session goes beside the short one ...
    probe = lb.acquire("probe", prompt_ids=prompt(10), expected_output_tokens=10)
    assert probe.server_id == other
    probe.release().result()
    # ... after the long one reports 950 of its 1000 tokens made, beside the long one.
    assert long.renew(remaining=lb.policy.weigh(prompt(10), 1000 - 950))
    assert record_weight(r, lb.name, long.token) == 60
    assert check_weights(r, lb.name) == {long.server_id: 60, other: 210}
    nxt = lb.acquire("next", prompt_ids=prompt(10), expected_output_tokens=10)
    assert nxt.server_id == long.server_id
    assert check_weights(r, lb.name) == {long.server_id: 80, other: 210}


def test_a_resent_renew_changes_nothing_more(make_rw, r, server):
    lb = make_rw()
    lease = lb.acquire("x", prompt_ids=prompt(100), expected_output_tokens=400)
    assert lease.renew(remaining=250)
    before = check_weights(r, lb.name)
    keys = snapshot(server)
    keys.pop(f"rr:{{{lb.name}}}:owned:{lb._core.holder}".encode())  # the renewal time
    assert lease.renew(remaining=250)  # the same report again (a resend): the same state
    after = snapshot(server)
    after.pop(f"rr:{{{lb.name}}}:owned:{lb._core.holder}".encode())
    assert after == keys
    assert check_weights(r, lb.name) == before
    assert before[lease.server_id] == 250 and sum(before.values()) == 250
    assert record_weight(r, lb.name, lease.token) == 250


def test_renew_without_remaining_keeps_the_weight_and_sends_one_argument(make_rw, r, monkeypatch):
    lb = make_rw()
    lease = lb.acquire("x", prompt_ids=prompt(100), expected_output_tokens=400)
    sent: list[tuple[Any, ...]] = []
    run = lb._run

    def spy(op: Any) -> Any:
        def wrapped() -> Any:
            call = next(op)
            sent.append(call.args)
            try:
                op.send((yield call))
            except StopIteration as stop:
                return stop.value
            raise AssertionError("renew makes one call")

        return run(wrapped())

    monkeypatch.setattr(lb, "_run", spy)
    assert lease.renew()
    assert sent == [(lease.token,)]  # the call as before the option existed
    assert record_weight(r, lb.name, lease.token) == 500
    assert lease.renew(remaining=0)
    assert sent[-1] == (lease.token, "0")
    # A weight of 0 leaves the record as an unweighed lease's, and the total at 0.
    rec = r.hget(invariants.prefix(lb.name) + "leases", lease.token)
    assert rec.count(invariants.SEP) == 2
    assert check_weights(r, lb.name) == {"a": 0, "b": 0}


def test_renew_of_an_ended_lease_returns_false_and_writes_nothing(make_rw, r, server):
    lb = make_rw()
    lease = lb.acquire("x", prompt_ids=prompt(100), expected_output_tokens=400)
    token = lease.token
    assert lease.release().result()
    keys = snapshot(server)
    assert not lease.renew(remaining=50)  # known released here: no round trip
    # The same token from elsewhere (the core's renew reaches the script): gone, nothing written.
    assert lb._run(lb._core.renew(token, 50)) is False
    assert snapshot(server) == keys
    assert check_weights(r, lb.name) == {"a": 0, "b": 0}


def test_release_and_reclaim_subtract_the_renewed_weight(make_rw, r):
    lb = make_rw()
    kept = lb.acquire("kept", prompt_ids=prompt(100), expected_output_tokens=900)
    assert kept.renew(remaining=123)
    assert kept.release().result()
    assert check_weights(r, lb.name) == {"a": 0, "b": 0}
    # A dead process's renewed leases: reclaimed with their renewed weights, not the first.
    dead = make_rw(lease_ttl=0.5)
    leases = [
        dead.acquire(f"dead{i}", prompt_ids=prompt(100), expected_output_tokens=900)
        for i in range(4)
    ]
    for k, lease in enumerate(leases):
        assert lease.renew(remaining=11 * k)
    assert sum(check_weights(r, dead.name).values()) == 11 * (0 + 1 + 2 + 3)
    invariants.silence(dead)  # its process "died": no more heartbeats
    invariants.listen(dead, 0.7)  # other workers are heard meanwhile: it is dead
    assert dead.reap() == 4
    assert check_weights(r, dead.name) == {"a": 0, "b": 0}


def test_removing_a_replica_ends_its_renewed_leases_exactly(make_rw, r):
    lb = make_rw({"a": None, "b": None, "c": None})
    leases = [
        lb.acquire(f"x{i}", prompt_ids=prompt(10), expected_output_tokens=100) for i in range(6)
    ]
    for k, lease in enumerate(leases):
        assert lease.renew(remaining=k * 7)
    check_weights(r, lb.name)
    lb.remove_servers([leases[0].server_id])
    totals = check_weights(r, lb.name)
    assert leases[0].server_id not in totals


BAD = [
    (-1, ValueError, "from 0 to"),
    (True, TypeError, "must be an int"),
    (False, TypeError, "must be an int"),
    (1.5, TypeError, "must be an int"),
    (100.0, TypeError, "must be an int"),
    ("10", TypeError, "must be an int"),
    (2**40 + 1, ValueError, "from 0 to"),
    (10**30, ValueError, "from 0 to"),
]


@pytest.mark.parametrize(("bad", "exc", "why"), BAD, ids=repr)
def test_bad_expected_output_is_refused_before_any_write(make_rw, r, server, bad, exc, why):
    lb = make_rw()
    lb.acquire_server("ok", prompt_ids=prompt(5), expected_output_tokens=5)
    keys = snapshot(server)
    with pytest.raises(exc, match=f"expected_output_tokens must be .*{why}|{why}") as info:
        lb.acquire_server("bad", prompt_ids=prompt(5), expected_output_tokens=bad)
    assert "expected_output_tokens" in str(info.value)
    with pytest.raises(exc, match="expected_output_tokens"):
        lb.acquire_many(["b1", "b2"], expected_output_tokens=[3, bad])
    assert snapshot(server) == keys


@pytest.mark.parametrize(("bad", "exc", "why"), BAD, ids=repr)
def test_bad_remaining_is_refused_before_any_write(make_rw, r, server, bad, exc, why):
    lb = make_rw()
    lease = lb.acquire("ok", prompt_ids=prompt(5), expected_output_tokens=5)
    keys = snapshot(server)
    with pytest.raises(exc, match=f"remaining must be .*{why}|{why}") as info:
        lease.renew(remaining=bad)
    assert "remaining" in str(info.value)
    assert snapshot(server) == keys
    assert record_weight(r, lb.name, lease.token) == 10


def test_a_prompt_and_output_beyond_the_limit_are_refused(make_rw, server):
    lb = make_rw()
    keys = snapshot(server)
    with pytest.raises(ValueError, match=r"expected_output_tokens .* at most"):
        lb.acquire_server("x", prompt_ids=prompt(10), expected_output_tokens=2**40)
    assert snapshot(server) == keys


@pytest.mark.parametrize(
    ("value", "exc"),
    [
        (-0.1, ValueError),
        (1000.5, ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("1", TypeError),
    ],
    ids=repr,
)
def test_bad_prefill_weight_is_refused(value, exc):
    with pytest.raises(exc, match="prefill_weight must be a number from 0 to 1000"):
        LeastTokens(remaining_work=True, prefill_weight=value)


def test_asyncio_twin_weighs_renews_and_refuses_the_same(server, r):
    async def go() -> None:
        lb = AsyncLeastTokensRouter(
            TWO, redis=server.url, name="rw-async", remaining_work=True, rng=random.Random(3)
        )
        try:
            assert lb.require_acquire_fields() == ["prompt_ids", "expected_output_tokens"]
            long = await lb.acquire("long", prompt_ids=prompt(10), expected_output_tokens=1000)
            short = await lb.acquire("short", prompt_ids=prompt(10), expected_output_tokens=200)
            assert short.server_id != long.server_id
            assert await long.renew(remaining=60)
            assert await long.renew(remaining=60)  # resent: the same
            assert record_weight(r, lb.name, long.token) == 60
            nxt = await lb.acquire("next", prompt_ids=prompt(10), expected_output_tokens=10)
            assert nxt.server_id == long.server_id
            keys = snapshot(server)
            with pytest.raises(TypeError, match="remaining must be an int"):
                await long.renew(remaining=True)
            with pytest.raises(ValueError, match="expected_output_tokens must be an int"):
                await lb.acquire("bad", expected_output_tokens=-3)
            assert snapshot(server) == keys
            assert await long.release()
            assert not await long.renew(remaining=5)
            assert check_weights(r, lb.name) == {long.server_id: 20, short.server_id: 210}
        finally:
            await lb.destroy()
            await lb.close()

    asyncio.run(go())


def test_evalsha_path_gives_the_same_weights(make_rw, r, monkeypatch):
    """The EVALSHA path (forced here; Redis 6.2 takes it by itself) renews as FCALL does."""
    monkeypatch.setenv(ENV, "eval")
    lb = make_rw()
    lease = lb.acquire("x", prompt_ids=prompt(10), expected_output_tokens=90)
    assert lb._scripts.mode == "evalsha"
    assert lease.renew(remaining=40) and lease.renew(remaining=40)
    assert record_weight(r, lb.name, lease.token) == 40
    assert check_weights(r, lb.name)[lease.server_id] == 40
    assert lease.release().result()
    assert not lease.renew(remaining=1)
    assert check_weights(r, lb.name) == {"a": 0, "b": 0}


def test_renew_moves_the_engine_aware_token_scores_with_the_weight(make_rw, r):
    """With engine scoring pinned, least_tokens ranks P wscore: a renew changes it by the same
    amount as the weighted total (I12, checked by invariants.check), and placement sees it."""
    from redis_router import EngineLoad

    lb = make_rw(engine_scoring={"kv_weight": 0.0}, rng=random.Random(5))
    long = lb.acquire("long", prompt_ids=prompt(10), expected_output_tokens=1000)
    other = "b" if long.server_id == "a" else "a"
    short = lb.acquire("short", prompt_ids=prompt(10), expected_output_tokens=200)
    assert short.server_id == other
    lb.report_engine_load({sid: EngineLoad(running=1, waiting=0) for sid in TWO})
    p = invariants.prefix(lb.name)
    before = float(r.zscore(p + "wscore", long.server_id))
    invariants.check(r, lb.name)
    assert long.renew(remaining=60)
    assert float(r.zscore(p + "wscore", long.server_id)) == before - 950
    invariants.check(r, lb.name)
    assert lb.acquire_server("next", prompt_ids=prompt(10), expected_output_tokens=10)[0] == (
        long.server_id
    )
    invariants.check(r, lb.name)
