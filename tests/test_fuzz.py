"""Model-based fuzzing: random operation sequences against a real server and tests/model.py.

A Hypothesis state machine acquires (one, many, retried), releases (by lease, by request,
by replica only), renews, adds, removes, drains, undrains, clears sticky sessions and lets
leases expire, and checks every reply and the counts against the model, plus the invariants
on the raw keys. lease_ttl is short so sequences cross expiries: before a step that could
race an expiry, the machine waits until every lease has surely expired and reaps (exactly
the model's leases must come back). Runs on the first server binary only, in about 30 s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from redis_router import NoServersAvailable, RedisLoadBalancer
from redis_router.core import new_token
from redis_router.local_server import LocalServer, first_server_binary

from . import invariants
from .model import Model, NoServers

LEASE_TTL = 0.5
MARGIN = 0.01  # slack (s) around a lease's expiry for the ms clock and the round trip
STEP = 0.1  # a step that starts later than expiry - STEP - MARGIN waits for expiry first
MIN_OPERATIONS = 10_000
SERVERS = ["s0", "s1", "s2", "{s3}", "ü:4"]
REQUESTS = ["r0", "r1", "r2", "r3", "{r4}", "*:r5", "ß6", "r7"]

BINARY = first_server_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no server binary found")


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LocalServer]:
    assert BINARY is not None
    with LocalServer(BINARY) as s:
        yield s


class Counter:
    operations = 0  # balancer calls made by rules
    sequences = 0
    expiries = 0  # waits past every lease's expiry


class BalancerMachine(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        Counter.sequences += 1
        self.name = f"fz{Counter.sequences}"
        self.lb = RedisLoadBalancer(redis=self.url, name=self.name, lease_ttl=LEASE_TTL)
        self.r = redis.Redis.from_url(self.url, decode_responses=True)
        self.model = Model()
        self.released: list[str] = []  # tokens that once existed, to release again

    def teardown(self) -> None:
        self.lb.destroy()
        self.lb.close()
        self.r.close()

    # -- time ------------------------------------------------------------------------------

    def _deadline(self) -> float:
        """Monotonic time before which no lease of the model can have expired."""
        firsts = [x.set_from for x in self.model.leases.values()]
        return min(firsts) + LEASE_TTL - MARGIN if firsts else float("inf")

    def _ready(self) -> None:
        """Start of every rule: if a lease could expire during the step, let all expire."""
        if time.monotonic() + STEP > self._deadline():
            self._expire_all()

    def _call(self, fn: Any, *args: Any, **kw: Any) -> tuple[Any, float, float]:
        """Run one balancer call; no lease of the model may have expired by its end."""
        Counter.operations += 1
        t0 = time.monotonic()
        out = fn(*args, **kw)
        t1 = time.monotonic()
        assert t1 < self._deadline(), "a step outlasted STEP: raise it (machine too slow)"
        return out, t0, t1

    def _expire_all(self) -> None:
        if self.model.leases:
            last = max(x.set_by for x in self.model.leases.values())
            time.sleep(max(0.0, last + LEASE_TTL + MARGIN - time.monotonic()))
            Counter.expiries += 1
        Counter.operations += 1
        assert self.lb.reap() == len(self.model.leases)
        self.released += list(self.model.leases)
        self.model.leases.clear()

    # -- rules -----------------------------------------------------------------------------

    @initialize(ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=4))
    def start(self, ids: list[str]) -> None:
        self._ready()
        assert self._call(self.lb.add_servers, dict.fromkeys(ids))[0] == self.model.add(ids)

    @rule(rid=st.sampled_from(REQUESTS))
    def acquire(self, rid: str) -> None:
        self._ready()
        self._acquire_many([rid])

    @rule(rids=st.lists(st.sampled_from(REQUESTS), min_size=1, max_size=5))
    def acquire_many(self, rids: list[str]) -> None:
        self._ready()
        self._acquire_many(rids)

    # Rules pick leases by an index drawn up front: which leases exist depends on timing (a
    # slow step makes the machine wait for expiry), and Hypothesis needs draws that do not.
    @rule(pick=st.integers(0, 255))
    def acquire_again_with_a_granted_token(self, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases), pick)
        if token is None:
            return
        self._acquire_many([self.model.leases[token].request_id], [token])

    def _acquire_many(self, rids: list[str], tokens: list[str] | None = None) -> None:
        tokens = tokens or [new_token() for _ in rids]
        requests = list(zip(rids, tokens, strict=True))
        try:
            self.model.check_batch(requests)
        except NoServers:
            with pytest.raises(NoServersAvailable):
                self._call(self.lb._run, self.lb._core.acquire(rids, tokens))
            return
        grants, t0, t1 = self._call(self.lb._run, self.lb._core.acquire(rids, tokens))
        for (rid, token), g in zip(requests, grants, strict=True):
            allowed, how = self.model.destination(rid, token, self.model.counts())
            assert g.server_id in allowed, (rid, g.server_id, allowed, self.model)
            assert g.sticky == (how == 1)
            self.model.grant(rid, token, g.server_id, how, t0, t1)

    @rule(pick=st.integers(0, 255))
    def release_lease(self, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases) + self.released[-5:], pick)
        if token is None:
            return
        sid = self.model.leases[token].server_id if token in self.model.leases else "s0"
        rid = self.model.leases[token].request_id if token in self.model.leases else "r0"
        done, _, _ = self._call(self.lb._run, self.lb._core.release(sid, rid, token))
        assert done == self.model.release_token(token)
        self.released.append(token)

    @rule(sid=st.sampled_from(SERVERS), rid=st.sampled_from(REQUESTS))
    def release_by_request(self, sid: str, rid: str) -> None:
        self._ready()
        done, _, _ = self._call(self.lb.release_server, sid, rid)
        assert done == self.model.release_request(sid, rid)

    @rule(sid=st.sampled_from(SERVERS))
    def release_by_server(self, sid: str) -> None:
        self._ready()
        candidates = self.model.oldest_candidates(sid)
        done, _, _ = self._call(self.lb.release_server, sid)
        assert done == bool(candidates)
        if done:
            gone = set(self.model.leases) - set(
                self.r.hkeys(invariants.prefix(self.name) + "leases")
            )
            assert len(gone) == 1 and gone <= candidates, (gone, candidates)
            self.model.release_token(gone.pop())

    @rule(pick=st.integers(0, 255))
    def renew(self, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases), pick)
        if token is None:
            return
        done, t0, t1 = self._call(self.lb._run, self.lb._core.renew(token))
        assert done
        lease = self.model.leases[token]  # stays in grant order (release by request uses it)
        lease.set_from, lease.set_by = t0, t1

    @rule(ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=3))
    def add(self, ids: list[str]) -> None:
        self._ready()
        assert self._call(self.lb.add_servers, dict.fromkeys(ids))[0] == self.model.add(ids)

    @rule(ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=2))
    def remove(self, ids: list[str]) -> None:
        self._ready()
        assert self._call(self.lb.remove_servers, ids)[0] == self.model.remove(ids)

    @rule(ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=2))
    def drain(self, ids: list[str]) -> None:
        self._ready()
        assert self._call(self.lb.drain_servers, ids)[0] == self.model.set_draining(ids, True)

    @rule(ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=3))
    def undrain(self, ids: list[str]) -> None:
        self._ready()
        assert self._call(self.lb.undrain_servers, ids)[0] == self.model.set_draining(ids, False)

    @rule()
    def clear_sticky(self) -> None:
        self._ready()
        self._call(self.lb.clear_sticky_cache)
        self.model.sticky.clear()

    @rule(wait=st.integers(0, 7))
    def reap_or_wait_past_expiry_and_reap(self, wait: int) -> None:
        self._ready()
        if wait == 0:  # one in eight: the rule would otherwise dominate the run time
            self._expire_all()
        else:
            assert self._call(self.lb.reap)[0] == 0  # nothing has expired yet

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def counts_match_the_model(self) -> None:
        assert self.lb._run(self.lb._core.counts()) == self.model.counts()
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps % 4 == 0:  # the full check reads every key: every few steps
            draining = sorted(s for s, d in self.model.servers.items() if d)
            assert self.lb.get_status()["draining_servers"] == draining
            assert invariants.check(self.r, self.name) == self.model.counts()


def _pick(items: list[str], index: int) -> str | None:
    return items[index % len(items)] if items else None


@pytest.mark.slow
def test_balancer_never_diverges_from_the_model(fuzz_server: LocalServer) -> None:
    BalancerMachine.url = fuzz_server.url
    Counter.operations = Counter.sequences = Counter.expiries = 0
    options = settings(
        max_examples=10,
        stateful_step_count=200,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    t0 = time.monotonic()
    while Counter.operations < MIN_OPERATIONS:
        run_state_machine_as_test(BalancerMachine, settings=options)
    print(
        f"\nfuzz on {fuzz_server.binary.label}: {Counter.operations} operations in "
        f"{Counter.sequences} sequences, {Counter.expiries} waits past lease expiry, "
        f"{time.monotonic() - t0:.1f}s"
    )
    assert Counter.operations >= MIN_OPERATIONS


# -- ids -------------------------------------------------------------------------------------

ODD = st.one_of(
    st.text(max_size=20),
    st.text(alphabet="{}*:?[]\\ \x00\x1f\x7f\n\t", max_size=8),
    st.text(min_size=100, max_size=600),
    st.sampled_from(["", "{", "}", "{}", "*", ":", "\ud800", "a" * 512, "é" * 257, "\x00"]),
)


def _dump(r: redis.Redis) -> dict[bytes, Any]:
    return {k: (r.dump(k), r.pttl(k) > 0) for k in r.scan_iter(count=1000)}


@pytest.mark.slow
def test_every_id_is_routed_or_refused_without_writing(fuzz_server: LocalServer) -> None:
    r = redis.Redis.from_url(fuzz_server.url)
    lb = RedisLoadBalancer({"a": None}, redis=fuzz_server.url, name="ids")
    outcomes = {"routed": 0, "refused": 0}

    @settings(max_examples=300, deadline=None, database=None)
    @given(value=ODD, kind=st.sampled_from(["request", "server", "token"]))
    def check(value: str, kind: str) -> None:
        before = _dump(r)
        try:
            if kind == "request":
                result = lb.acquire_server(value)
                assert result[0] == "a"
            elif kind == "server":
                lb.add_servers({value: None})
                assert value in lb.get_all_servers()
                lb.remove_servers([value])
            else:
                assert lb.acquire("req", token=value).server_id == "a"
        except (ValueError, TypeError) as exc:
            assert str(exc)
            assert _dump(r) == before, f"a refused {kind} id {value!r} wrote to Redis"
            outcomes["refused"] += 1
            return
        outcomes["routed"] += 1

    check()
    lb.destroy()
    lb.close()
    r.close()
    print(f"\nids: {outcomes}")
    assert outcomes["routed"] and outcomes["refused"]
