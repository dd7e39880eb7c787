"""Parity: the sync and asyncio balancers run the same scenarios and must give the same results.

Each scenario is written once, as a list of steps on a balancer. It runs on a
``RedisLoadBalancer`` and on an ``AsyncRedisLoadBalancer``, each under a fresh name on the same
server with the same seeded tie-break entropy, and every step's outcome (its normalised result,
or its exception's class and message) is recorded. The two traces must be equal, step by step,
and so must the pools' states afterwards. The sharded pool's two flavours
(``ShardedLoadBalancer``, ``AsyncShardedLoadBalancer``) run the same scenarios, and those of
their own. Every public method of each pair is driven by at least one scenario (a test checks
that list against the classes).
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer
from redis_router.aio import AsyncLease, AsyncReleased
from redis_router.aio_sharded import AsyncShardedLoadBalancer
from redis_router.balancer import Lease
from redis_router.engine import EngineLoad
from redis_router.errors import RedisUnavailable
from redis_router.local_server import LocalServer
from redis_router.outbox import Released
from redis_router.sharded import ShardedLoadBalancer

from .invariants import check
from .test_outage import DropReplyProxy, script_verb

SEED = 20261205
SHARDS = 3


@dataclass(frozen=True)
class Pair:
    """A blocking class and its asyncio twin, with what both constructors take besides."""

    sync: type
    asyncio: type
    options: dict[str, Any]


PAIRS = {
    "balancer": Pair(RedisLoadBalancer, AsyncRedisLoadBalancer, {}),
    "sharded": Pair(ShardedLoadBalancer, AsyncShardedLoadBalancer, {"shards": SHARDS}),
}


class Driver:
    """One flavour's balancer behind one calling convention: ``await d.call(name, ...)``."""

    def __init__(self, lb: Any) -> None:
        self.lb = lb
        self.trace: list[tuple[str, Any]] = []

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self.lb, name)(*args, **kwargs)
        if inspect.isawaitable(out) and not isinstance(out, AsyncReleased):
            out = await out
        return out

    async def step(self, label: str, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call and record the outcome; returns the raw result (None after an exception)."""
        try:
            out = await self.call(name, *args, **kwargs)
            self.trace.append((label, await normalise(out)))
        except Exception as exc:
            self.trace.append((label, _raised(exc)))
            return None
        return out

    async def released(self, label: str, out: Any) -> None:
        """A release's outcome (a pending release is awaited)."""
        try:
            self.trace.append((label, await normalise(out)))
        except Exception as exc:
            self.trace.append((label, _raised(exc)))

    async def lease_block(self, label: str, rid: str, **kwargs: Any) -> None:
        """``with lb.lease(rid)`` / ``async with lb.lease(rid)``: what it yielded, and the
        in-flight count inside and after."""
        cm = self.lb.lease(rid, **kwargs)
        if hasattr(cm, "__aenter__"):
            async with cm as held:
                inside = await self.call("get_inflight_count", held.server_id)
                got = await normalise(held)
        else:
            with cm as held:
                inside = await self.call("get_inflight_count", held.server_id)
                got = await normalise(held)
        after = await self.call("get_inflight_count", held.server_id)
        self.trace.append((label, (got, inside, after)))


def _raised(exc: Exception) -> tuple[str, str, str]:
    if isinstance(exc, RedisUnavailable):
        # The cause is redis-py's socket error text, which differs between its sync and
        # asyncio connections; the library's part (the class, the redacted URL) must not.
        return ("raised", type(exc).__name__, _message(exc).split(": ", 1)[0])
    return ("raised", type(exc).__name__, _message(exc))


def _message(exc: Exception) -> str:
    return _named(str(exc))


def _named(text: str) -> str:
    # A balancer's name is part of some messages and results (a shard's name holds its
    # pool's); the two runs use different names.
    return text.replace("parity-sync", "NAME").replace("parity-async", "NAME")


async def normalise(out: Any) -> Any:
    """A result both flavours can be compared on: leases by where they went, pending releases
    by their outcome, status without clocks."""
    if isinstance(out, (Lease, AsyncLease)):
        return ("lease", out.server_id, out.request_id, out.sticky)
    if isinstance(out, AsyncReleased):
        return ("released", await out)
    if isinstance(out, Released):
        return ("released", out.result())
    if isinstance(out, str):
        return _named(out)
    if isinstance(out, dict):
        return {_named(k): await normalise(v) for k, v in out.items() if k not in _CLOCKS}
    if isinstance(out, (list, tuple)):
        return [await normalise(v) for v in out]
    return out


_CLOCKS = {"name", "ejected_until", "ejected_for", "probation_ms", "now", "age_s"}
_CLOCKS |= {"last_error_at", "last_error_age", "unheard_ms"}


Scenario = Callable[[Driver], Awaitable[None]]
SCENARIOS: dict[str, tuple[dict[str, Any], Scenario]] = {}
# Per pair, the scenarios it runs and the methods they drive.
RUNS: dict[str, list[str]] = {pair: [] for pair in PAIRS}
DRIVEN: dict[str, set[str]] = {pair: set() for pair in PAIRS}


def scenario(
    *methods: str, pairs: tuple[str, ...] = tuple(PAIRS), **options: Any
) -> Callable[[Scenario], Scenario]:
    """A scenario of the pairs named (every pair unless told), driving ``methods``."""

    def register(fn: Scenario) -> Scenario:
        SCENARIOS[fn.__name__] = (options, fn)
        for pair in pairs:
            RUNS[pair].append(fn.__name__)
            DRIVEN[pair].update(methods)
        return fn

    return register


@scenario(
    "add_servers",
    "acquire_server",
    "acquire",
    "acquire_many",
    "lease",
    "release_server",
    "get_inflight_count",
    "get_total_inflight",
    "get_all_servers",
    "request_owner",
    "end_session",
)
async def routing_and_sticky_sessions(d: Driver) -> None:
    await d.step("add", "add_servers", {f"r{i}": {"url": f"http://r{i}"} for i in range(6)})
    for i in range(8):
        await d.step(f"new {i}", "acquire_server", f"s{i}")
    for i in range(8):
        await d.step(f"sticky {i}", "acquire_server", f"s{i}")
    await d.step("total", "get_total_inflight")
    await d.step("servers", "get_all_servers")
    for i in range(8):
        sid, _ = await d.call("acquire_server", f"s{i}")
        await d.step(f"count {i}", "get_inflight_count", sid)
        await d.released(f"release {i}", d.lb.release_server(sid, f"s{i}"))
    lease = await d.step("acquire", "acquire", "t1")
    await d.released("lease.release", lease.release())
    await d.released("lease.release again", lease.release())
    await d.step("many", "acquire_many", [f"m{i}" for i in range(10)])
    await d.lease_block("lease block", "s3")
    await d.step("owner", "request_owner", "s3")
    await d.step("owner of nobody", "request_owner", "nobody")
    await d.step("end", "end_session", "s1", "s2", "never")
    await d.step("after end", "acquire_server", "s1")
    await d.step("total after", "get_total_inflight")


@scenario(
    "drain_servers",
    "undrain_servers",
    "remove_servers",
    "get_status",
    "bump_weight_version",
    "clear_sticky_cache",
    "reap",
    "destroy",
)
async def pool_changes_and_status(d: Driver) -> None:
    await d.step("add", "add_servers", {"a": None, "b": None, "c": None}, capacity={"c": 1})
    for i in range(6):
        await d.step(f"acquire {i}", "acquire_server", f"p{i}")
    await d.step("drain", "drain_servers", ["a", "zz"])
    await d.step("sticky on draining", "acquire_server", "p0")
    await d.step("new avoids draining", "acquire_many", ["q1", "q2", "q3"])
    await d.step("undrain", "undrain_servers", ["a"])
    await d.step("status", "get_status")
    await d.step("remove", "remove_servers", ["b"])
    await d.step("release on removed", "release_server", "b")
    await d.step("bump", "bump_weight_version")
    await d.step("bump sticky", "bump_weight_version", sticky=True)
    await d.step("clear", "clear_sticky_cache")
    await d.step("reap", "reap")
    await d.step("status after", "get_status")
    await d.step("destroy", "destroy")
    await d.step("empty", "get_all_servers")


@scenario("report_engine_load", engine_scoring=True)
async def engine_reports(d: Driver) -> None:
    await d.step("add", "add_servers", {"a": None, "b": None, "c": None})
    await d.step(
        "report",
        "report_engine_load",
        {"a": EngineLoad(running=5, waiting=2), "b": EngineLoad(running=0, waiting=0)},
    )
    for i in range(5):
        await d.step(f"acquire {i}", "acquire_server", f"e{i}")
    await d.step("unknown replica", "report_engine_load", {"zz": EngineLoad(1, 0)})


@scenario()
async def capacity_and_failures(d: Driver) -> None:
    await d.step("add", "add_servers", {"a": None, "b": None}, capacity={"a": 1, "b": 1})
    first = await d.step("a place", "acquire", "c1")
    await d.step("the other", "acquire", "c2")
    await d.step("full", "acquire_server", "c3")
    await d.step("full, waited", "acquire_server", "c3", wait=0.2)
    await d.step("full, many", "acquire_many", ["c3", "c4"])
    await d.released("fail", first.fail())
    await d.step("place again", "acquire_server", "c3")
    await d.step("status", "get_status")


@scenario(eject_after=2, eject_for=30.0)
async def ejection(d: Driver) -> None:
    await d.step("add", "add_servers", {"a": None, "b": None, "c": None, "d": None})
    sid, _ = await d.call("acquire_server", "x0")
    for i in range(2):
        got = await d.step(f"acquire {i}", "acquire_server", "x0")
        await d.released(f"failed {i}", d.lb.release_server(got[0], "x0", failed=True))
    await d.step("sticky after ejection", "acquire_server", "x0")
    for i in range(4):
        await d.step(f"new {i}", "acquire_server", f"y{i}")
    await d.step("status", "get_status")
    del sid


@scenario()
async def bad_input(d: Driver) -> None:
    await d.step("add", "add_servers", {"a": None})
    await d.step("empty id", "acquire_server", "")
    await d.step("id type", "acquire_server", 5)
    await d.step("many type", "acquire_many", "abc")
    await d.step("many field length", "acquire_many", ["a1", "a2"], group_id=["g"])
    await d.step("wait", "acquire_server", "ok", wait=-1)
    await d.step("token", "acquire", "ok", token="not a token")
    await d.step("release id", "release_server", "")
    await d.step("failed flag", "release_server", "a", failed="yes")
    await d.step("add metadata", "add_servers", {"": None})
    await d.step("capacity", "add_servers", {"b": None}, capacity={"b": -1})
    await d.step("unknown keyword", "acquire_server", "ok", wiat=2)
    await d.step("unknown keyword, many", "acquire_many", ["a1"], prompt=["x"])
    await d.step("nothing written", "get_all_servers")
    await d.step("end none", "end_session")
    await d.step("fields", "require_acquire_fields")
    await d.step("release fields", "require_release_fields")


@scenario()
async def exclusions(d: Driver) -> None:
    await d.step("add", "add_servers", {f"r{i}": None for i in range(4)})
    for i in range(6):
        await d.step(f"excluding r0 {i}", "acquire_server", f"x{i}", exclude={"r0"})
    await d.step("sticky excluded", "acquire_server", "x0", exclude=["r0", "r1", "r2"])
    await d.step("sticky excluded, lease", "acquire", "x1", exclude=("r3",))
    await d.lease_block("lease excluding", "x2", exclude={"r1"})
    await d.step("all excluded", "acquire_server", "x9", exclude={"r0", "r1", "r2", "r3"})
    await d.step("bad exclusion", "acquire_server", "x9", exclude="r0")
    await d.step("total", "get_total_inflight")


@scenario("close")
async def after_close(d: Driver) -> None:
    await d.step("add", "add_servers", {"a": None, "b": None})
    lease = await d.step("acquire", "acquire", "k1")
    await d.step("close", "close")
    await d.step("close again", "close")
    await d.step("acquire after close", "acquire_server", "k2")
    await d.step("lease after close", "acquire", "k2")
    await d.step("many after close", "acquire_many", ["k2", "k3"])
    await d.released("release after close", lease.release())
    await d.released("by request id after close", d.lb.release_server("a", "k1"))
    await d.step("status after close", "get_status")


@scenario("grow", pairs=("sharded",))
async def growing_the_pool(d: Driver) -> None:
    await d.step("add", "add_servers", {f"r{i}": None for i in range(3)})
    for i in range(6):
        await d.step(f"new {i}", "acquire_server", f"g{i}")
    await d.step("grow", "grow", SHARDS + 2)
    await d.step("grow again", "grow", SHARDS + 2)
    await d.step("shrink", "grow", SHARDS)
    await d.step("add after growing", "add_servers", {f"n{i}": None for i in range(4)})
    for i in range(6):
        await d.step(f"sticky {i}", "acquire_server", f"g{i}")
    for i in range(6):
        await d.step(f"new after {i}", "acquire_server", f"h{i}")
    await d.step("status", "get_status")


@scenario()
async def empty_pool(d: Driver) -> None:
    await d.step("no replica", "acquire_server", "e1")
    await d.step("no replica, lease", "acquire", "e1")
    await d.step("no replica, many", "acquire_many", ["e1", "e2"])
    await d.step("total", "get_total_inflight")
    await d.step("release", "release_server", "nowhere")


def _options(options: dict[str, Any]) -> dict[str, Any]:
    return {"rng": random.Random(SEED), **options}


async def _run(
    pair: Pair, flavour: str, url: str, fn: Scenario, options: dict[str, Any]
) -> tuple[list, Any]:
    """One flavour of ``pair`` through the scenario: its trace and its pool's state after."""
    cls = pair.sync if flavour == "sync" else pair.asyncio
    lb = cls(redis=url, name=f"parity-{flavour}", **pair.options, **_options(options))
    d = Driver(lb)
    try:
        await fn(d)
        return d.trace, await _snapshot(d)
    finally:
        closed = lb.close()
        if closed is not None:
            await closed


async def _snapshot(d: Driver) -> Any:
    try:
        return await normalise(await d.call("get_status"))
    except Exception as exc:  # a closed balancer
        return _raised(exc)


def _quiet_publishers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded pool places new sessions by the shards' totals its processes publish every
    period; no period comes within a scenario, so both flavours place on the same figures
    (the placements' own counts) and the traces do not depend on when a period fell."""
    for module in ("redis_router.sharded", "redis_router.aio_sharded"):
        monkeypatch.setattr(f"{module}.PUBLISH_EVERY", 3600.0)


CASES = [(pair, name) for pair, names in RUNS.items() for name in sorted(names)]


@pytest.mark.parametrize(("pair", "name"), CASES, ids=[f"{p}-{n}" for p, n in CASES])
def test_both_flavours_give_the_same_results(
    server, r, monkeypatch: pytest.MonkeyPatch, pair: str, name: str
) -> None:
    _quiet_publishers(monkeypatch)
    options, fn = SCENARIOS[name]
    two = PAIRS[pair]
    sync_trace, sync_state = asyncio.run(_run(two, "sync", server.url, fn, options))
    async_trace, async_state = asyncio.run(_run(two, "async", server.url, fn, options))
    assert len(sync_trace) == len(async_trace)
    for (label, got_sync), (_, got_async) in zip(sync_trace, async_trace, strict=True):
        assert got_sync == got_async, f"step {label!r}: sync {got_sync!r} != asyncio {got_async!r}"
    assert sync_state == async_state
    # The scenarios are not vacuous: each raised or routed something.
    assert any(isinstance(v, list | tuple) and v and v[0] != "raised" for _, v in sync_trace)
    for name in ("parity-sync", "parity-async"):
        for balancer in _balancers(r, name):  # the pool's own, or each of its shards'
            check(r, balancer)


def _balancers(r: Any, name: str) -> set[str]:
    """The names of the balancers whose keys hold the pool ``name`` (a shard's name is the
    pool's and a suffix)."""
    keys = r.scan_iter(f"rr:{{{name}*", count=1000)
    return {k.split("{", 1)[1].split("}", 1)[0] for k in keys}


def _public(cls: type) -> set[str]:
    return {
        n
        for n, v in inspect.getmembers(cls)
        if not n.startswith("_") and (inspect.isfunction(v) or inspect.iscoroutinefunction(v))
    }


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_every_public_method_of_both_flavours_is_driven(pair: str) -> None:
    methods = _public(PAIRS[pair].sync)
    assert methods == _public(PAIRS[pair].asyncio)
    # require_*_fields are read in bad_input.
    not_driven = methods - DRIVEN[pair] - {"require_acquire_fields", "require_release_fields"}
    assert not_driven == set()


# -- faults: the same scenario through each flavour, on a server of the test's own ------------


@dataclass
class Env:
    """What a fault scenario may break: the server, and a proxy in front of it that can lose
    the reply to the next script call."""

    server: LocalServer
    proxy: DropReplyProxy
    direct: bool = False  # connect to the server itself (an outage: the proxy would hang)

    @property
    def url(self) -> str:
        return self.server.url if self.direct else f"redis://127.0.0.1:{self.proxy.port}/0"

    def lose_next_reply(self, d: Driver) -> None:
        # (a sharded pool's shards and directory load their scripts the same way)
        self.proxy.armed = script_verb(getattr(d.lb, "_dir", d.lb))


FaultScenario = Callable[[Driver, Env], Awaitable[None]]
FAULT_SCENARIOS: dict[str, FaultScenario] = {}


def fault(fn: FaultScenario) -> FaultScenario:
    FAULT_SCENARIOS[fn.__name__] = fn
    return fn


@fault
async def lost_replies_are_resent(d: Driver, env: Env) -> None:
    """The server runs the call, the reply is lost, redis-py resends it: one lease per
    acquire, one end per release (I9)."""
    await d.step("add", "add_servers", {"a": None, "b": None, "c": None})
    warm = await d.step("warm", "acquire", "w")  # scripts loaded, connection made
    await d.released("warm release", warm.release())
    env.lose_next_reply(d)
    await d.step("acquire, reply lost", "acquire_server", "l1")
    env.lose_next_reply(d)
    await d.step("many, reply lost", "acquire_many", ["l2", "l3", "l4"])
    lease = await d.step("acquire", "acquire", "l5")
    env.lose_next_reply(d)
    await d.released("release, reply lost", lease.release())
    env.lose_next_reply(d)
    await d.released("by request id, reply lost", d.lb.release_server("a", "l1"))
    d.trace.append(("replies lost", env.proxy.dropped))
    await d.step("total", "get_total_inflight")
    await d.step("status", "get_status")


@fault
async def a_paused_server_is_waited_for(d: Driver, env: Env) -> None:
    """CLIENT PAUSE (as a failover's last step does): calls wait for it and then succeed."""
    await d.step("add", "add_servers", {"a": None, "b": None})
    lease = await d.step("acquire", "acquire", "p1")
    with env.server.client() as c:
        c.execute_command("CLIENT", "PAUSE", 300, "ALL")
    await d.step("acquire in a pause", "acquire_server", "p2")
    await d.released("release in a pause", lease.release())
    await d.step("total", "get_total_inflight")


@fault
async def an_outage_fails_and_a_restart_is_seen(d: Driver, env: Env) -> None:
    """The server killed: calls raise RedisUnavailable; restarted empty: the pool is gone
    and registering it again routes."""
    await d.step("add", "add_servers", {"a": None, "b": None})
    await d.step("acquire", "acquire_server", "o1")
    env.server.kill()
    await d.step("acquire while down", "acquire_server", "o2")
    await d.step("release while down", "release_server", "a", "o1")
    env.server.restart()
    await d.step("after an empty restart", "acquire_server", "o3")
    await d.step("add again", "add_servers", {"a": None, "b": None})
    await d.step("routes again", "acquire_server", "o4")
    await d.step("total", "get_total_inflight")


DIRECT = {"an_outage_fails_and_a_restart_is_seen"}


async def _run_fault(
    pair: Pair, flavour: str, env: Env, fn: FaultScenario
) -> list[tuple[str, Any]]:
    cls = pair.sync if flavour == "sync" else pair.asyncio
    lb = cls(redis=env.url, name=f"parity-{flavour}", **pair.options, **_options({}))
    d = Driver(lb)
    try:
        await fn(d, env)
    finally:
        closed = lb.close()
        if closed is not None:
            await closed
    return d.trace


FAULT_CASES = [(pair, name) for pair in PAIRS for name in sorted(FAULT_SCENARIOS)]


@pytest.mark.parametrize(("pair", "name"), FAULT_CASES, ids=[f"{p}-{n}" for p, n in FAULT_CASES])
def test_both_flavours_give_the_same_results_under_faults(
    private: LocalServer, monkeypatch: pytest.MonkeyPatch, pair: str, name: str
) -> None:
    _quiet_publishers(monkeypatch)
    fn = FAULT_SCENARIOS[name]
    traces = {}
    for flavour in ("sync", "async"):
        proxy = DropReplyProxy(private.port)
        try:
            with private.client() as c:
                c.flushall()
            env = Env(private, proxy, direct=name in DIRECT)
            traces[flavour] = asyncio.run(_run_fault(PAIRS[pair], flavour, env, fn))
        finally:
            proxy.close()
    for (label, got_sync), (_, got_async) in zip(traces["sync"], traces["async"], strict=True):
        assert got_sync == got_async, f"step {label!r}: sync {got_sync!r} != asyncio {got_async!r}"
    assert any(v[0] == "raised" for _, v in traces["sync"] if isinstance(v, tuple)) or (
        name != "an_outage_fails_and_a_restart_is_seen"
    )
