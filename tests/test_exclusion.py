"""``exclude=``: an acquire that must not go to some replicas (a retry leaves out every replica
that already failed the request), honoured atomically by the acquire script, for new and
sticky requests alike, by every policy and acquire path; and the HTTP retries built on it
(``redis-router serve`` and the httpx transports) that no longer go back to a replica that
just failed them."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from redis_router import AsyncRedisLoadBalancer, NoCapacity, NoServersAvailable
from redis_router.http import AsyncRouterTransport, RouterTransport
from redis_router.plugins.least_tokens import LeastTokensRouter

from . import invariants, test_http_serve
from .test_http_serve import CHAT, inflight, register, state, until

ABCD = {s: None for s in "abcd"}
# The HTTP tests' fixtures: fake replicas and fronts in subprocesses, a balancer name per test.
procs, name = test_http_serve.procs, test_http_serve.name


def _pool(r: Any, name: str) -> dict[str, dict[str, float]]:
    p = invariants.prefix(name)
    return {zs: dict(r.zrange(p + zs, 0, -1, withscores=True)) for zs in ("load", "draining")}


@pytest.mark.parametrize(
    "kind", ["least_loaded", "full_determinism", "least_tokens", "engine", "capacity", "spread"]
)
def test_no_policy_ever_routes_to_an_excluded_replica(make_lb, r, kind):
    """Random exclusions over random loads, seeded: every grant is outside its exclusion, and
    (least loaded) the least loaded of the replicas left; the excluded ones' counts are back
    unchanged after each call (I1)."""
    rng = random.Random(f"exclusion-{kind}")
    servers: Any = ABCD
    kw: dict[str, Any] = {"rng": random.Random(rng.getrandbits(32))}
    if kind == "full_determinism":
        kw["full_determinism"] = True
    elif kind == "least_tokens":
        kw["cls"] = LeastTokensRouter
    elif kind == "engine":
        kw["engine_scoring"] = True
    elif kind == "capacity":
        servers = {s: {"capacity": 50} for s in "abcd"}
    elif kind == "spread":
        kw["spread_sessions"] = True
    lb = make_lb(servers, **kw)
    held: list[Any] = []
    for step in range(150):
        excluded = set(rng.sample(sorted(ABCD), rng.randint(1, 3)))
        before = invariants.check(r, lb.name)
        fields = {"prompt_ids": [1] * rng.randint(1, 50)} if kind == "least_tokens" else {}
        # New sessions mostly, some turns of earlier ones (sticky to a replica maybe excluded).
        rid = f"s{rng.randint(0, 9)}" if rng.random() < 0.3 else f"n{step}"
        lease = lb.acquire(rid, exclude=excluded, **fields)
        assert lease.server_id not in excluded, (step, rid, excluded, lease.server_id)
        if kind == "least_loaded" and not lease.sticky:
            least = min(before[s] for s in ABCD if s not in excluded)
            assert before[lease.server_id] == least, (before, excluded, lease.server_id)
        after = invariants.check(r, lb.name)
        assert {s: after[s] for s in excluded} == {s: before[s] for s in excluded}
        held.append(lease)
        while held and rng.random() < 0.5:
            held.pop(rng.randrange(len(held))).release()
    for lease in held:
        lease.release()
    assert sum(invariants.check(r, lb.name).values()) == 0


def test_the_replicas_left_share_new_sessions_uniformly(make_lb, r):
    lb = make_lb(ABCD, rng=random.Random(7))
    got = {s: 0 for s in "bcd"}
    for i in range(600):
        sid, _ = lb.acquire_server(f"u{i}", exclude=["a"])
        got[sid] += 1
        lb.release_server(sid, f"u{i}")
    assert invariants.fair(got, 600, 3), got


def test_a_sticky_session_on_an_excluded_replica_moves_and_stays_where_it_went(make_lb, r):
    lb = make_lb(ABCD, rng=random.Random(3))
    first = lb.acquire("conv")
    first.release()
    moved = lb.acquire("conv", exclude={first.server_id})
    assert moved.server_id != first.server_id and not moved.sticky
    moved.release()
    again = lb.acquire("conv")  # pinned where it went, as after an ejection
    assert again.server_id == moved.server_id and again.sticky
    again.release()
    # A sticky session whose replica is not excluded stays, exclusion or not.
    other = next(s for s in "abcd" if s not in (first.server_id, moved.server_id))
    stay = lb.acquire("conv", exclude=[other])
    assert stay.server_id == moved.server_id and stay.sticky
    stay.release()
    invariants.check(r, lb.name)


def test_a_draining_or_held_sticky_replica_that_is_excluded_is_left_too(make_lb, r):
    lb = make_lb(ABCD, eject_after=1, eject_for=60.0, ejected_sticky="wait", wait_timeout=0)
    a = lb.acquire("drained")
    lb.drain_servers([a.server_id])
    a.release()
    assert lb.acquire("drained").server_id == a.server_id  # a draining one keeps its sessions
    lb.release_server(a.server_id, "drained")
    away = lb.acquire("drained", exclude={a.server_id})
    assert away.server_id != a.server_id
    away.release()
    lb.undrain_servers([a.server_id])
    # ejected_sticky="wait" holds a session for its ejected replica, unless it is excluded.
    b = lb.acquire("held")
    b.fail()  # ejects it (eject_after=1)
    with pytest.raises(NoCapacity):  # ReplicaEjected: wait for it
        lb.acquire("held")
    elsewhere = lb.acquire("held", exclude=[b.server_id])
    assert elsewhere.server_id != b.server_id
    elsewhere.release()
    invariants.check(r, lb.name)


def test_a_batch_honours_its_exclusion_on_the_batch_path(make_lb, r):
    """The script's batch procedure (many requests in one call) honours a call's exclusion
    as the one-request procedure does: the core sends it for any call."""
    lb = make_lb(ABCD, rng=random.Random(11))
    first = lb.acquire("t0")
    first.release()
    grants = lb._run(lb._core.acquire(["t0", "t1", "t2", "t3", "t0"], exclude=(first.server_id,)))
    assert all(g.server_id != first.server_id for g in grants)
    assert grants[0].server_id == grants[4].server_id and grants[4].sticky
    for g in grants:
        lb.release_server(g.server_id, g.request_id)
    assert sum(invariants.check(r, lb.name).values()) == 0


def test_every_replica_excluded_is_no_servers_available_and_changes_nothing(make_lb, r):
    lb = make_lb({"a": {"capacity": 1}, "b": None, "c": None})
    lease = lb.acquire("s", exclude=["b", "c"], wait=0)  # fills a
    assert lease.server_id == "a"
    pool = _pool(r, lb.name)
    sticky = {k: r.hgetall(k) for k in r.keys(invariants.prefix(lb.name) + "sticky:*")}
    for excluded in (["a", "b", "c"], ["b", "c", "a"]):
        for rid in ("s", "new"):
            with pytest.raises(NoServersAvailable, match="excluded") as info:
                lb.acquire(rid, exclude=excluded, wait=0)
            assert not isinstance(info.value, NoCapacity)  # waiting could never help
    with pytest.raises(NoServersAvailable, match="excluded"):
        lb._run(lb._core.acquire(["x", "y"], exclude=("a", "b", "c")))  # the batch path
    assert _pool(r, lb.name) == pool
    assert {k: r.hgetall(k) for k in r.keys(invariants.prefix(lb.name) + "sticky:*")} == sticky
    # A replica left out only for being full (a, capacity 1, held) can still free a place.
    with pytest.raises(NoCapacity):
        lb.acquire("new", exclude=["b", "c"], wait=0)
    lease.release()
    assert lb.acquire("new", exclude=["b", "c"], wait=0).server_id == "a"


def test_an_acquire_that_waits_for_a_place_keeps_its_exclusion(make_lb, server):
    """Refused for capacity, an acquire waits in the queue and tries again: every try keeps
    the exclusion, so a free but excluded replica never serves it; the excluded one's place
    does once its lease ends."""
    caps = {"a": {"capacity": 1}, "b": {"capacity": 1}}
    lb = make_lb(caps)
    busy = lb.acquire("busy", exclude=["b"])
    assert busy.server_id == "a"
    timer = threading.Timer(0.3, busy.release)
    timer.start()
    try:
        waited = lb.acquire("next", exclude=["b"], wait=10)
    finally:
        timer.join()
    assert waited.server_id == "a"
    waited.release()

    async def main() -> str:
        async with AsyncRedisLoadBalancer(redis=server.url, name=lb.name) as alb:
            held = await alb.acquire("busy2", exclude=["b"])
            asyncio.get_running_loop().call_later(0.3, held.release)
            got = await alb.acquire("next2", exclude={"b"}, wait=10)
            got.release()
            return got.server_id

    assert asyncio.run(main()) == "a"


@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        ("a", TypeError, "exclude must be a collection"),
        (b"a", TypeError, "exclude must be a collection"),
        (3, TypeError, "exclude must be a collection"),
        ([1], TypeError, "each server id in exclude must be a str"),
        ({""}, ValueError, "each server id in exclude must be a non-empty"),
        (["a\x1fb"], ValueError, "each server id in exclude must not contain control"),
        (["x" * 300], ValueError, "each server id in exclude must be at most 256"),
    ],
)
def test_a_bad_exclusion_is_refused_naming_it_and_writes_nothing(
    make_lb, r, server, bad, error, words
):
    lb = make_lb()  # nothing registered: the first acquire would write
    with pytest.raises(error, match=words):
        lb.acquire_server("s", exclude=bad)
    with pytest.raises(error, match=words):
        lb.acquire("s", exclude=bad)
    with pytest.raises(error, match=words), lb.lease("s", exclude=bad):
        pass

    async def main() -> None:
        async with AsyncRedisLoadBalancer(redis=server.url, name=lb.name) as alb:
            with pytest.raises(error, match=words):
                await alb.acquire_server("s", exclude=bad)
            with pytest.raises(error, match=words):
                await alb.acquire("s", exclude=bad)
            with pytest.raises(error, match=words):
                async with alb.lease("s", exclude=bad):
                    pass

    asyncio.run(main())
    assert r.keys(invariants.prefix(lb.name) + "*") == []


def test_coalesced_asyncio_acquires_each_keep_their_own_exclusion(server, r):
    """A burst of asyncio acquires shares round trips (coalesce.py); one with an exclusion
    is sent by itself, and every one keeps its own."""
    rng = random.Random(5)

    async def main() -> list[tuple[set[str], str]]:
        async with AsyncRedisLoadBalancer(
            ABCD, redis=server.url, name="excl-co", rng=random.Random(9)
        ) as lb:
            out: list[tuple[set[str], str]] = []
            for burst in range(6):
                asks = [set(rng.sample(sorted(ABCD), rng.randint(0, 3))) for _ in range(40)]
                leases = await asyncio.gather(
                    *(lb.acquire(f"b{burst}-{i}", exclude=ex) for i, ex in enumerate(asks))
                )
                out += [(ex, lease.server_id) for ex, lease in zip(asks, leases, strict=True)]
                for lease in leases:
                    lease.release()
            await lb.destroy()
            return out

    got = asyncio.run(main())
    assert all(sid not in ex for ex, sid in got)
    assert {sid for ex, sid in got if not ex} == set(ABCD)  # the others still go everywhere


# -- HTTP retries --------------------------------------------------------------------------


def _busy_then_kill(server: Any, procs: Any, name: str, hold: Callable[[], Any]) -> str:
    """Four replicas, three of them busy with one request each (``hold`` takes one, from
    least loaded: one per replica), then the idle one killed: the least loaded replica, for
    every new request, is a dead one. Returns its id."""
    for _ in range(3):
        hold()

    def three() -> dict[str, int] | None:
        counts = inflight(server, name)
        return counts if sum(counts.values()) == 3 else None

    counts = until(three, "three requests in flight")
    (idle,) = [sid for sid, n in counts.items() if n == 0]
    procs.kill(idle)
    return str(idle)


@pytest.mark.slow
def test_serve_never_retries_on_the_replica_that_just_failed(server, procs, name):
    """Each request's first attempt meets the dead replica (the least loaded); its failure
    ends that lease, so the dead one is tied for least loaded again when the retry acquires:
    with exclusion the retry never goes back there, and one retry is always enough."""
    replicas = procs.replicas(4)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1, "--retries", "1")
    streams: list[Any] = []
    client = httpx.Client(timeout=60)
    body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 5000}

    def hold() -> None:
        cm = client.stream(
            "POST", f"{front}/v1/chat/completions", json=body, headers={"X-Fake-Delay": "0.05"}
        )
        resp = cm.__enter__()
        assert resp.status_code == 200
        streams.append((cm, resp.iter_lines()))
        next(streams[-1][1])  # its first words: the lease is held, the replica busy

    try:
        dead = _busy_then_kill(server, procs, name, hold)
        codes, where = [], []
        for _ in range(20):
            resp = httpx.post(
                f"{front}/v1/chat/completions",
                json={"model": "m", "messages": CHAT, "max_tokens": 1},
                timeout=30,
            )
            codes.append(resp.status_code)
            where.append(resp.headers.get("x-replica-id"))
        failed = [c for c in codes if c != 200]
        print(f"{len(failed)} of 20 requests failed: {failed}")
        assert not failed, codes
        assert dead not in where
        assert state(server, name)["replicas"][dead]["failures"] == 20  # each met it first
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        client.close()
    assert until(lambda: sum(inflight(server, name).values()) == 0, "every lease released")


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_the_transports_never_retry_on_the_replica_that_just_failed(
    server, procs, name, make_lb, flavour
):
    replicas = procs.replicas(4)
    register(server, name, replicas)
    lb = make_lb(name=name)
    held = []
    dead = _busy_then_kill(server, procs, name, lambda: held.append(lb.acquire(f"busy{len(held)}")))
    post = {"model": "m", "prompt": "x", "max_tokens": 1}
    if flavour == "sync":
        with httpx.Client(transport=RouterTransport(lb, retries=1), timeout=30) as client:
            got = [client.post("http://router/v1/completions", json=post) for _ in range(20)]
    else:

        async def main() -> list[httpx.Response]:
            async with AsyncRedisLoadBalancer(redis=server.url, name=name) as alb:
                transport = AsyncRouterTransport(alb, retries=1)
                async with httpx.AsyncClient(transport=transport, timeout=30) as client:
                    return [
                        await client.post("http://router/v1/completions", json=post)
                        for _ in range(20)
                    ]

        got = asyncio.run(main())
    codes = [resp.status_code for resp in got]
    print(f"{sum(c != 200 for c in codes)} of 20 requests failed")
    assert codes == [200] * 20, [resp.text for resp in got if resp.status_code != 200]
    assert dead not in {resp.json()["replica"] for resp in got}
    assert state(server, name)["replicas"][dead]["failures"] == 20
    for lease in held:
        lease.release()
    until(lambda: sum(inflight(server, name).values()) == 0, "every lease released")


@pytest.mark.slow
def test_a_transport_whose_every_replica_failed_answers_502_at_once(server, procs, name, make_lb):
    """Two replicas, both dead, and retries to spare: the second failure leaves no replica to
    try, so the answer is a 502 after two attempts, naming why, not a 503."""
    replicas = procs.replicas(2)
    register(server, name, replicas)
    procs.kill("r0")
    procs.kill("r1")
    lb = make_lb(name=name)
    with httpx.Client(transport=RouterTransport(lb, retries=5), timeout=30) as client:
        resp = client.post("http://router/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 502, resp.text
    message = resp.json()["error"]["message"]
    assert "in 2 attempt(s)" in message and "no other replica takes new sessions" in message
    assert {r["failures"] for r in state(server, name)["replicas"].values()} == {1}
