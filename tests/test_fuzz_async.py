"""Model-based fuzzing of the coalesced asyncio path: concurrent acquires and releases of an
AsyncRedisLoadBalancer, gathered in one event-loop turn (they reach Redis as one acquire
batch and one release batch, in an order nobody promises), must equal the model's
sequential semantics for some order of the two batches: least-loaded choices within the
allowed sets, sticky turns, retries with granted tokens, and NOSERVERS refusals mixed with
sticky turns to draining replicas (a refused batch is retried request by request, so each
caller gets its own outcome). The other processes of tests/fuzzing.py's machine (sync,
impatient, dying, closing) share the balancer meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import rule

from redis_router import NoServersAvailable
from redis_router.aio import AsyncLease
from redis_router.local_server import LocalServer

from .fuzzing import (
    REQUESTS,
    SERVERS,
    AsyncProcess,
    BalancerMachine,
    LoopThread,
    Process,
    fuzz_server,
    needs_server,
)
from .model import Model, NoServers
from .test_fuzz import LENGTHS, run_machine

MIN_OPERATIONS = 2_500

pytestmark = needs_server
__all__ = ["fuzz_server"]

CALL = st.tuples(
    st.sampled_from(["acquire", "acquire", "retry", "token", "request", "server"]),
    st.sampled_from(REQUESTS),
    st.integers(0, 255),
)


class AsyncMachine(BalancerMachine):
    """Slot 0 (and every process that replaces a patient one) is an asyncio balancer whose
    event loop runs in a thread, so its keeper beats between steps."""

    name_prefix = "fa"

    def __init__(self) -> None:
        self.loop = LoopThread()
        super().__init__()

    def spawn(self, slot: int) -> Process:
        if slot == 0:
            return AsyncProcess(self.new_balancer(self.url, asyncio=True), self.loop)
        return super().spawn(slot)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.loop.close()

    @rule(n=st.integers(0, 3))
    def every_replica_drains(self, n: int) -> None:
        if n:
            return
        self._ready()
        p = self.proc(0, patient=True)
        ids = list(self.model.servers)
        assert self._call(p.call, "drain_servers", ids)[0] == self.model.set_draining(ids, True)

    @rule(who=st.integers(0, 7), calls=st.lists(CALL, min_size=1, max_size=8))
    def concurrent_calls_in_one_loop_turn(
        self, who: int, calls: list[tuple[str, str, int]]
    ) -> None:
        self._ready()
        procs = [p for p in self.procs if isinstance(p, AsyncProcess)]
        p = procs[who % len(procs)]
        lb = p.lb
        acquires: list[tuple[str, str | None, int]] = []  # (request id, token or None, prompt)
        releases: list[tuple[str, str, str | None, str | None]] = []  # (kind, sid, rid, token)
        live = list(self.model.leases)
        by_server = False
        for kind, rid, pick in calls:
            token = live[pick % len(live)] if live else None
            lease = self.model.leases[token] if token else None
            if kind == "server" and not by_server:  # one per turn: its choice is observed
                by_server = True
                sid = lease.server_id if lease else SERVERS[pick % len(SERVERS)]
                releases.append(("server", sid, None, None))
            elif kind == "acquire" or lease is None:
                acquires.append((rid, None, pick))
            elif kind == "retry":
                acquires.append((lease.request_id, token, pick))
            elif kind == "token":
                releases.append(("token", lease.server_id, lease.request_id, token))
            else:
                releases.append(("request", lease.server_id, lease.request_id, None))

        async def turn() -> list[Any]:
            coros: list[Any] = [
                lb.acquire(rid, token=token, **self.fields(pick)) for rid, token, pick in acquires
            ]
            # Each release is queued when gather starts it, after the acquires before it.
            for kind, sid, rid, token in releases:
                if kind == "token":
                    coros.append(_awaited(lb._post, sid, rid, token))  # as AsyncLease.release
                else:
                    coros.append(_awaited(lb.release_server, sid, rid))
            return await asyncio.gather(*coros, return_exceptions=True)

        # The process's ledger as the turn starts: a release by replica only hints its own
        # lease of a request there, which may be another holder's by now (a token granted
        # again by a retry).
        core = lb._core
        self.ledger = [
            *core.latest.items(),
            *((k, t) for k, ts in core.earlier.items() for t in ts),
        ]
        outcomes, t0, t1 = self._call(self.loop.run, turn())
        self.stats.operations += len(calls) - 1
        self.stats.batches += 1
        got_acquires, got_releases = outcomes[: len(acquires)], outcomes[len(acquires) :]
        with self._judging():  # a dead holder's leases must not go before this read
            present = set(self.r.hkeys(self.p + "leases"))
            explained = self._explain(p, acquires, got_acquires, releases, got_releases, t0, t1)
            consistent = [m for m in explained if set(m.leases) == present]
            if not consistent:  # shown in full with the failure (captured output)
                print(f"turn: {acquires=}\n{got_acquires=}\n{releases=}\n{got_releases=}")
                print(f"ledger: {self.ledger}\nmodel: {self.model}\npresent: {sorted(present)}")
                print(self._explain_holders())
            assert consistent, "no order of the turn's batches explains the leases in Redis"
        self.gone += [t for t in self.model.leases if t not in present]
        self.model = consistent[0]

    def _explain(
        self,
        p: Process,
        acquires: list[tuple[str, str | None, int]],
        got_acquires: list[Any],
        releases: list[tuple[str, str, str | None, str | None]],
        got_releases: list[Any],
        t0: float,
        t1: float,
    ) -> list[Model]:
        """Every model state the turn may have led to, given its replies: the release batch
        ran before the acquire batch, after it, or (when the batch was refused and retried
        one by one) between two of the retries; a release by replica only ended any one of
        its candidates."""
        for r in got_acquires + got_releases:
            if isinstance(r, BaseException) and not isinstance(r, NoServersAvailable):
                raise r
        requests = [
            (rid, token if token is not None else _token_of(g, i))
            for i, ((rid, token, _), g) in enumerate(zip(acquires, got_acquires, strict=True))
        ]
        prompts = [self.prompt(pick)[1] for _, _, pick in acquires]

        def call(m: Model, items: list[int]) -> bool:
            """One acquire script call of ``items``: True if it was refused whole."""
            try:
                m.check_batch([requests[i] for i in items])
            except NoServers:
                if len(items) > 1:
                    return True
                assert isinstance(got_acquires[items[0]], NoServersAvailable)
                return False
            for i in items:
                g, (rid, token) = got_acquires[i], requests[i]
                assert isinstance(g, AsyncLease), (rid, g)
                allowed, how = m.destination(rid, token, prompts[i])
                assert g.server_id in allowed and g.sticky == (how == 1), (rid, g, allowed)
                m.grant(rid, token, g.server_id, how, p.holder, t0, t1, prompts[i])
            return False

        out: list[Model] = []
        n = len(requests)
        for at in range(n + 2):  # the release batch runs before acquire call number `at`
            models = [self.model.copy()]
            if at == 0:
                models = _released(models, releases, got_releases, p.holder, self.ledger)
            for m in models:
                try:
                    refused = call(m, list(range(n)))
                except AssertionError:
                    continue
                if not refused:
                    if at == 1:
                        out += _released([m], releases, got_releases, p.holder, self.ledger)
                    elif at == 0:
                        out.append(m)
                    continue
                branch = [m]
                for k in range(n):  # refused whole: retried one by one
                    if at == k + 1:
                        branch = _released(branch, releases, got_releases, p.holder, self.ledger)
                    kept = []
                    for b in branch:
                        try:
                            call(b, [k])
                        except AssertionError:
                            continue
                        kept.append(b)
                    branch = kept
                if at == n + 1:
                    branch = _released(branch, releases, got_releases, p.holder, self.ledger)
                out += branch
        return out


def _token_of(g: Any, i: int) -> str:
    return g.token if isinstance(g, AsyncLease) else f"refused-{i}"


def _released(
    models: list[Model],
    releases: list[tuple[str, str, str | None, str | None]],
    got: list[Any],
    holder: str,
    ledger: list[tuple[tuple[str, str], str]],
) -> list[Model]:
    """Apply the release batch, in order, to each model; a release by replica only, or by
    request id (each names the releasing balancer's own lease, if it has one), branches
    over its candidates, and ends nothing where the lease it names may be gone. Keeps the
    models whose every reply matches."""
    for (kind, sid, rid, token), done in zip(releases, got, strict=True):
        after: list[Model] = []
        for m in models:
            if kind == "token":
                if done == m.release_token(token):
                    after.append(m)
            else:
                candidates = (
                    m.request_candidates(sid, rid, holder)
                    if kind == "request"
                    else m.server_candidates(sid, holder)
                    | {
                        t
                        for (s, r), t in ledger
                        if s == sid
                        and t in m.leases
                        and (m.leases[t].server_id, m.leases[t].request_id) == (s, r)
                    }
                )
                # A lease of its ledger there that is gone (ended by another process): its
                # hint, which ends nothing.
                stale = any(
                    s == sid
                    and (kind == "server" or r == rid)
                    and (
                        t not in m.leases
                        or (m.leases[t].server_id, m.leases[t].request_id) != (s, r)
                    )
                    for (s, r), t in ledger
                )
                if not done and stale:
                    after.append(m)
                    continue
                if done != bool(candidates):
                    continue
                if not candidates:
                    after.append(m)
                for t in sorted(candidates):
                    branch = m.copy()
                    branch.release_token(t)
                    after.append(branch)
        models = after
    return models


@pytest.mark.parametrize("length", LENGTHS)
def test_coalesced_asyncio_calls_equal_sequential_ones_in_the_model(
    fuzz_server: LocalServer, length: tuple[int, int]
) -> None:
    operations, examples = length
    t0 = time.monotonic()
    stats = run_machine(AsyncMachine, fuzz_server.url, operations, examples=examples)
    took = time.monotonic() - t0
    print(f"\nasync fuzz on {fuzz_server.binary.label}: {stats.line()}, {took:.1f}s")
    assert stats.operations >= operations
    # The full run always draws coalesced gathers; a short one (two sequences) may draw none.
    assert stats.batches or examples <= 2


async def _awaited(post: Any, *args: Any) -> Any:
    """Queue a release when the task running this starts, and wait for its result."""
    return await post(*args)
