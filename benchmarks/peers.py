"""``python -m benchmarks.peers [--quick] [--json FILE] [--only MEASURES] [-R N] [-N N]
[--no-gateways] [--no-install]``

redis-router side by side with the gateways its users would otherwise run (vllm-router
round_robin, sglang-router cache_aware, smg cache_aware), all against the same fake
OpenAI-compatible replicas (benchmarks/peers_http.py) and one private Redis, interleaved: each
repetition runs every contender in turn, in an order rotated per repetition; every number is
the median over the repetitions. Measures:

- ``latency``: added p50/p99 per request with 1 client, against a direct request to a replica
  through the same client (sync ``http.client``; asyncio: the stdlib keep-alive client). The
  library's request is acquire, request, release; the release is queued and answered in the
  background (sync and asyncio), and once more awaited for its result (asyncio: the round trip
  a caller that waits for it pays). The oracle rows make one redis-py ``PING`` round trip
  before each direct request: the least a library that asks Redis once per request pays.
  The bare-client rows (benchmarks/peers_bare.py) send the library's own acquire and release
  scripts, and two no-op ones, from the least a Python client can be: they split what the
  library adds into the round trips, the scripts' own work and the library's Python.
- ``throughput``: 32 concurrent asyncio clients in one process, at 0 and 20 ms service time,
  as a ratio to direct requests in the same repetition.
- ``balance``: 4 client processes, 8 concurrent requests each (service time drawn per request,
  exponential, mean 20 ms), one gateway per process against one shared balancer on one Redis:
  time-weighted mean in-flight per replica, max / mean over the replicas; then sparse (2 per
  process), and sparse multi-turn sessions that think between turns.
- ``prefix``: the replicas' prefix-cache token hit rate for multi-turn sessions whose every turn
  goes through a different router instance (4 instances), and for GRPO groups (8 samples of a
  1024-token prompt, from 4 processes, each process its own router instance).
- ``cpu``: CPU time per routed request with every process counted: the library's client
  process and Redis, against a gateway's process (benchmarks/peers_cpu.py).

redis-router takes part twice: as the library (acquire, request, release in the client
process) and as ``redis-router serve`` instances, each a process of its own on the same Redis,
reached over HTTP like a gateway (benchmarks/peers_fronts.py): with its default policy in
latency, throughput and balance (one instance per client process there), with the
prefix_cache router YAML (the shipped thresholds, and abs 64 / rel 1.5) in the prefix measures,
a session's turns naming it in ``X-Session-ID``. The oracle, an aiohttp pass-through with no
Redis and no routing started and measured as ``serve`` is (benchmarks/peers_oracle.py), bounds
what a front on that HTTP stack can reach in latency and throughput; the same with one Redis
``PING`` round trip per request bounds what such a front that asks Redis once per request
can reach.

The gateways live in ``.venv-peers`` in the checkout, installed from the registry when missing
(``--no-install``: use what is there); a gateway that cannot be installed or started is a row
saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import itertools
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer
from redis_router.local_server import LocalServer, first_server_binary
from redis_router.plugins.prefix_cache import AsyncPrefixCacheRouter

from . import peers_bare as bare
from . import peers_cpu
from . import peers_fronts as fronts
from . import peers_gateways as gws
from .peers_http import AsyncClient, FakeReplicas, SyncClient, completion_body

MEASURES = ("latency", "throughput", "balance", "prefix", "cpu")
INSTANCES = 4  # independent routers: gateway instances, client processes, balancer objects
PREFIX_CONFIG = "pkg://redis_router.plugins/prefix_cache.yaml"
PREFIX_VARIANTS: dict[str, dict[str, float]] = {
    "redis-router prefix_cache, shipped defaults": {},
    "redis-router prefix_cache, abs 64 / rel 1.5": {
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
    },
}


@dataclass(frozen=True)
class Sizes:
    """How much work each measure does per contender and repetition."""

    requests: int  # latency: timed requests
    warmup: int
    tp_seconds: float  # throughput window
    bal_seconds: float  # balance window
    sessions: int  # multi-turn sessions (concurrent)
    turns: int
    groups: int  # GRPO groups per process

    @classmethod
    def full(cls) -> Sizes:
        return cls(2000, 200, 3.0, 4.0, 32, 6, 8)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(60, 10, 0.4, 0.6, 8, 3, 2)


@dataclass
class Row:
    """One line of a measure's table: a contender and its medians (NaN where it could not
    run, with ``note`` saying why)."""

    measure: str
    contender: str
    values: dict[str, float]
    note: str = ""
    runs: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Bench:
    """What every measure shares: the replicas, Redis, the running gateways, the sizes."""

    replicas: FakeReplicas
    redis_url: str
    gateways: dict[str, list[gws.Gateway]]  # label -> INSTANCES instances (or one with error)
    sizes: Sizes
    reps: int
    pool: ProcessPoolExecutor
    # redis-router's own fronts among the gateways: label -> the measures they take part in
    roles: dict[str, frozenset[str]] = field(default_factory=dict)
    session_header: set[str] = field(default_factory=set)  # fronts sent X-Session-ID

    def labels(self, measure: str) -> list[str]:
        """The gateways (and fronts) that take part in ``measure``."""
        return [k for k in self.gateways if k not in self.roles or measure in self.roles[k]]

    @property
    def servers(self) -> dict[str, str]:
        return {f"r{i}": url for i, url in enumerate(self.replicas.urls)}

    def gateway_error(self, label: str, need: int = 1) -> str:
        insts = self.gateways.get(label, [])
        bad = [g for g in insts[:need] if g.error]
        if bad:
            return bad[0].error
        if len(insts) < need:
            return "not started"
        return ""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def _text(tokens: Sequence[int]) -> str:
    return " ".join(f"t{t}" for t in tokens)


def _rotated(items: Sequence[str], rep: int) -> list[str]:
    k = rep % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


# --------------------------------------------------------------------------------------------
# (1) added latency, 1 client
# --------------------------------------------------------------------------------------------

LAT_SYNC_DIRECT = "direct request (sync http.client)"
LAT_ASYNC_DIRECT = "direct request (asyncio client)"
LAT_AWAITED = "redis-router asyncio, release awaited"
# What a library that asks Redis once per request pays at least, with redis-py's own clients:
# one PING round trip, then the request (no script, no routing, no release).
LAT_PING = "oracle: one redis-py PING, then the request"
LAT_PING_ASYNC = f"{LAT_PING}, asyncio"
# The library's own acquire and release scripts, and two no-op calls, from a bare client
# (benchmarks/peers_bare.py): what the scripts add, and what the library's Python adds.
LAT_BARE, LAT_BARE_NOOP = bare.BARE, bare.BARE_NOOP
LAT_BARE_ASYNC, LAT_BARE_NOOP_ASYNC = bare.BARE_ASYNC, bare.BARE_NOOP_ASYNC


@dataclass
class _Requests:
    """One request of each latency and CPU row, as a function: ``sync`` ones called,
    ``asyncio`` ones awaited; ``base``: a row's direct request; ``gateway``: a gateway row's
    gateway (or front); ``errors``: rows that cannot run, and why."""

    sync: dict[str, Callable[[], Any]]
    asyncio: dict[str, Callable[[], Any]]
    base: dict[str, str]
    gateway: dict[str, str]
    errors: dict[str, str]


@contextlib.asynccontextmanager
async def _requests(b: Bench) -> AsyncIterator[_Requests]:
    """The latency and CPU measures' requests, their clients open until the block ends."""
    b.replicas.configure(0, 0)
    urls = b.replicas.urls
    servers = b.servers
    body = completion_body("hello", 1)
    path = "/v1/completions"
    lb = RedisLoadBalancer(servers, redis=b.redis_url, name="peers-latency")
    alb = AsyncRedisLoadBalancer(servers, redis=b.redis_url, name="peers-latency-aio")
    sc, ac = SyncClient(), AsyncClient()
    rping = redis.Redis.from_url(b.redis_url)
    arping = redis.asyncio.Redis.from_url(b.redis_url)
    n = itertools.count()
    # The bare clients send what the balancers' cores make (their scripts are loaded by a
    # first acquire); the no-op library is loaded here.
    lb.release_server(lb.acquire_server("peers-bare-warm")[0], "peers-bare-warm")
    await alb.release_server((await alb.acquire_server("peers-bare-warm"))[0], "peers-bare-warm")
    errors: dict[str, str] = {}
    gateway: dict[str, str] = {}
    bare_rows = (LAT_BARE, LAT_BARE_NOOP, LAT_BARE_ASYNC, LAT_BARE_NOOP_ASYNC)
    try:
        bare.load_noop(rping)  # (Functions: Redis 7+ or Valkey)
    except redis.ResponseError as exc:
        errors.update(dict.fromkeys(bare_rows, f"needs Redis Functions: {_why(exc)}"))
    sbare, abare = bare.SyncBare(b.redis_url), await bare.AsyncBare.open(b.redis_url)
    scripts, ascripts = bare.Commands(lb._core, False), bare.Commands(alb._core, False)
    noops = bare.Commands(alb._core, True)

    def direct() -> None:
        sc.post(urls[next(n) % len(urls)], path, body)

    def pinged() -> None:
        rping.ping()
        sc.post(urls[next(n) % len(urls)], path, body)

    async def apinged() -> None:
        await arping.ping()
        await ac.post(urls[next(n) % len(urls)], path, body)

    def routed() -> None:
        rid = uuid.uuid4().hex
        sid, _ = lb.acquire_server(rid)
        try:
            sc.post(servers[sid], path, body)
        finally:
            lb.release_server(sid, rid)

    def bare_routed() -> None:
        rid, token = uuid.uuid4().hex, bare.new_token()
        sid = bare.server_id(sbare.call(scripts.acquire(rid, token)))
        sc.post(servers[sid], path, body)
        sbare.post(scripts.release(sid, rid, token))

    def bare_noop() -> None:
        rid, token = uuid.uuid4().hex, bare.new_token()
        sbare.call(noops.acquire(rid, token))
        sc.post(urls[next(n) % len(urls)], path, body)
        sbare.post(noops.release("s0", rid, token))

    async def abare_routed() -> None:
        rid, token = uuid.uuid4().hex, bare.new_token()
        sid = bare.server_id(await abare.call(ascripts.acquire(rid, token)))
        await ac.post(servers[sid], path, body)
        abare.post(ascripts.release(sid, rid, token))

    async def abare_noop() -> None:
        rid, token = uuid.uuid4().hex, bare.new_token()
        await abare.call(noops.acquire(rid, token))
        await ac.post(urls[next(n) % len(urls)], path, body)
        abare.post(noops.release("s0", rid, token))

    async def adirect() -> None:
        await ac.post(urls[next(n) % len(urls)], path, body)

    async def arouted(wait: bool = False) -> None:
        rid = uuid.uuid4().hex
        sid, _ = await alb.acquire_server(rid)
        try:
            await ac.post(servers[sid], path, body)
        finally:
            # Queued, answered in the background (as sync's); ``wait``: a caller that waits
            # for the result.
            released = alb.release_server(sid, rid)
            if wait:
                await released

    sync_fns: dict[str, Callable[[], None]] = {
        LAT_SYNC_DIRECT: direct,
        "redis-router sync": routed,
        LAT_PING: pinged,
        LAT_BARE: bare_routed,
        LAT_BARE_NOOP: bare_noop,
    }
    async_fns: dict[str, Callable[[], Any]] = {
        LAT_ASYNC_DIRECT: adirect,
        "redis-router asyncio": arouted,
        LAT_AWAITED: functools.partial(arouted, True),
        LAT_PING_ASYNC: apinged,
        LAT_BARE_ASYNC: abare_routed,
        LAT_BARE_NOOP_ASYNC: abare_noop,
    }
    base = {
        "redis-router sync": LAT_SYNC_DIRECT,
        "redis-router asyncio": LAT_ASYNC_DIRECT,
        LAT_AWAITED: LAT_ASYNC_DIRECT,
        LAT_PING: LAT_SYNC_DIRECT,
        LAT_PING_ASYNC: LAT_ASYNC_DIRECT,
        LAT_BARE: LAT_SYNC_DIRECT,
        LAT_BARE_NOOP: LAT_SYNC_DIRECT,
        LAT_BARE_ASYNC: LAT_ASYNC_DIRECT,
        LAT_BARE_NOOP_ASYNC: LAT_ASYNC_DIRECT,
    }
    for label in errors:
        sync_fns.pop(label, None)
        async_fns.pop(label, None)
    for label in b.labels("latency"):
        err = b.gateway_error(label)
        if err:
            errors[label] = err
            continue
        gurl = b.gateways[label][0].url
        sync_fns[label] = lambda gurl=gurl: sc.post(gurl, path, body)  # type: ignore[misc]
        base[label] = LAT_SYNC_DIRECT
        async_fns[f"{label}, asyncio client"] = lambda gurl=gurl: ac.post(gurl, path, body)
        base[f"{label}, asyncio client"] = LAT_ASYNC_DIRECT
        gateway[label] = gateway[f"{label}, asyncio client"] = label
    try:
        yield _Requests(sync_fns, async_fns, base, gateway, errors)
    finally:
        lb.close()
        await alb.close()
        rping.close()
        await arping.aclose()
        sbare.close()
        abare.close()
        sc.close()
        await ac.close()


async def _latency(b: Bench) -> list[Row]:
    async with _requests(b) as q:
        sync_fns, async_fns, base, errors = q.sync, q.asyncio, q.base, q.errors
        names = [*sync_fns, *async_fns]
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in names}  # (p50, p99) per rep
        failed: dict[str, str] = {}
        for rep in range(b.reps):
            for name in _rotated(names, rep):
                lat: list[float] = []
                total = b.sizes.warmup + b.sizes.requests
                try:
                    for i in range(total):
                        if name in sync_fns:
                            t0 = time.perf_counter()
                            sync_fns[name]()
                        else:
                            t0 = time.perf_counter()
                            await async_fns[name]()
                        if i >= b.sizes.warmup:
                            lat.append(time.perf_counter() - t0)
                    samples[name].append((_pct(lat, 0.5), _pct(lat, 0.99)))
                except Exception as exc:  # a gateway that fails mid-run: its row says why
                    failed[name] = _why(exc)
                    samples[name].append((math.nan, math.nan))
    rows = []
    for name in names:
        p50 = [s[0] * 1e6 for s in samples[name]]
        p99 = [s[1] * 1e6 for s in samples[name]]
        vals = {"p50_us": _med(p50), "p99_us": _med(p99)}
        if name in base:
            ref = samples[base[name]]
            vals["added_p50_us"] = _med(
                [(s[0] - r[0]) * 1e6 for s, r in zip(samples[name], ref, strict=True)]
            )
            vals["added_p99_us"] = _med(
                [(s[1] - r[1]) * 1e6 for s, r in zip(samples[name], ref, strict=True)]
            )
        note = _versus(base[name]) if name in base else "baseline"
        note = f"failed: {failed[name]}" if name in failed else note
        rows.append(Row("latency", name, vals, note, {"p50_us": p50, "p99_us": p99}))
    rows += [
        _error_row("latency", k, v, ("added_p50_us", "added_p99_us")) for k, v in errors.items()
    ]
    return rows


async def _cpu(b: Bench) -> list[Row]:
    """(5) CPU per routed request, every process counted (benchmarks/peers_cpu.py): the
    latency measure's requests, metered."""
    async with _requests(b) as q:
        pids = {}
        for name, label in q.gateway.items():
            proc = b.gateways[label][0].proc
            if proc is not None:
                pids[name] = proc.pid
        got, failed = await peers_cpu.measure(
            q.sync, q.asyncio, q.base, pids, b.redis_url, b.sizes, b.reps, _rotated
        )
    rows = [
        Row("cpu", name, {k: _med(v) for k, v in vals.items()}, _versus(q.base[name]), vals)
        for name, vals in got.items()
    ]
    errors = {**q.errors, **{k: f"failed: {v}" for k, v in failed.items()}}
    return rows + [_error_row("cpu", k, v, ("cpu_us",)) for k, v in errors.items()]


def _versus(direct: str) -> str:
    return "vs sync direct" if direct == LAT_SYNC_DIRECT else "vs asyncio direct"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def _error_row(measure: str, label: str, why: str, keys: Sequence[str]) -> Row:
    return Row(measure, label, {k: math.nan for k in keys}, f"not run: {why}")


# --------------------------------------------------------------------------------------------
# (2) throughput, 32 concurrent asyncio clients in one process
# --------------------------------------------------------------------------------------------

TP_CLIENTS = 32
TP_DIRECT = "direct requests"


async def _throughput(b: Bench) -> list[Row]:
    urls = b.replicas.urls
    servers = b.servers
    body = completion_body("hello", 1)
    path = "/v1/completions"
    alb = AsyncRedisLoadBalancer(servers, redis=b.redis_url, name="peers-tp")
    ac = AsyncClient()
    n = itertools.count()

    async def direct() -> None:
        await ac.post(urls[next(n) % len(urls)], path, body)

    async def routed() -> None:
        rid = uuid.uuid4().hex
        sid, _ = await alb.acquire_server(rid)
        try:
            await ac.post(servers[sid], path, body)
        finally:
            alb.release_server(sid, rid)  # queued, answered in the background

    fns: dict[str, Callable[[], Any]] = {TP_DIRECT: direct, "redis-router asyncio": routed}
    errors: dict[str, str] = {}
    for label in b.labels("throughput"):
        err = b.gateway_error(label)
        if err:
            errors[label] = err
            continue
        gurl = b.gateways[label][0].url
        fns[label] = lambda gurl=gurl: ac.post(gurl, path, body)

    async def run(fn: Callable[[], Any], seconds: float) -> float:
        deadline = time.perf_counter() + seconds
        done = 0

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await fn()
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(TP_CLIENTS)))
        return done / (time.perf_counter() - t0)

    rows = []
    for service_ms in (0.0, 20.0):
        b.replicas.configure(service_ms, 0)
        failed: dict[str, str] = {}
        for name, fn in fns.items():  # warm every connection pool
            try:
                await asyncio.gather(*(fn() for _ in range(TP_CLIENTS)))
            except Exception as exc:
                failed[name] = _why(exc)
        rates: dict[str, list[float]] = {k: [] for k in fns}
        for rep in range(b.reps):
            for name in _rotated(list(fns), rep):
                try:
                    rates[name].append(await run(fns[name], b.sizes.tp_seconds))
                except Exception as exc:
                    failed[name] = _why(exc)
                    rates[name].append(math.nan)
        measure = f"throughput_{int(service_ms)}ms"
        for name, rs in rates.items():
            ratios = [r / d for r, d in zip(rs, rates[TP_DIRECT], strict=True)]
            rows.append(
                Row(
                    measure,
                    name,
                    {"req_per_s": _med(rs), "ratio_to_direct": _med(ratios)},
                    f"failed: {failed[name]}"
                    if name in failed
                    else ("baseline" if name == TP_DIRECT else ""),
                    {"req_per_s": rs},
                )
            )
        rows += [
            _error_row(measure, k, v, ("req_per_s", "ratio_to_direct")) for k, v in errors.items()
        ]
    await alb.close()
    await ac.close()
    b.replicas.configure(0, 0)
    return rows


# --------------------------------------------------------------------------------------------
# (3) balance with 4 independent routers; (4b) GRPO groups from 4 processes
# --------------------------------------------------------------------------------------------

START_DELAY = 1.5  # seconds for every client process to connect before the agreed start
BAL_CONCURRENCY = 8
BAL_MEAN_MS = 20.0
GROUP = 8
GRPO_PROMPT = 1024
# Sparse multi-turn sessions (the simulator's sparse sessions, in milliseconds for seconds):
# 2 per process, 3-10 turns of 10-30 ms, 10-40 ms of thinking (no request) between turns.
SESSIONS_PER_PROCESS = 2
SESSION_TURNS = (3, 10)
SESSION_TURN_MS = (10, 30)
SESSION_THINK_MS = (10.0, 40.0)


def _worker(job: dict[str, Any]) -> int:
    """One client process of the balance or GRPO measure; returns requests completed."""
    return asyncio.run(_worker_main(job))


async def _worker_main(job: dict[str, Any]) -> int:
    kind: str = job["kind"]  # "redis-router" | "prefix" | "gateway" | "random"
    servers: dict[str, str] = job["servers"]
    urls = list(servers.values())
    rng = random.Random(job["seed"])
    ac = AsyncClient()
    lb: Any = None
    if kind == "redis-router":
        lb = AsyncRedisLoadBalancer(
            servers, redis=job["redis"], name=job["name"], **job.get("options", {})
        )
    elif kind == "prefix":
        lb = _prefix_router(servers, job["redis"], job["name"], job["options"])
    if lb is not None:  # connect and load the scripts before the start
        warm = "warm-" + uuid.uuid4().hex
        sid, _ = await lb.acquire_server(warm)
        await lb.release_server(sid, None)
        if job.get("end_sessions"):  # not a session that counts as pinned
            await lb.end_session(warm)
    path = "/v1/completions"

    async def one(prompt: list[int], max_tokens: int) -> None:
        body = completion_body(_text(prompt), max_tokens)
        if kind == "gateway":
            await ac.post(job["gateway"], path, body)
        elif kind == "random":
            await ac.post(rng.choice(urls), path, body)
        else:
            rid = uuid.uuid4().hex
            extra = {"prompt_ids": prompt} if kind == "prefix" else {}
            sid, _ = await lb.acquire_server(rid, **extra)
            try:
                await ac.post(servers[sid], path, body)
            finally:
                await lb.release_server(sid, rid)

    async def turn(session: str, pinned: str, max_tokens: int) -> None:
        """One turn of a session: sticky through the balancer (the session id as request
        id), to the session's replica when pinned at random, else as the gateway routes it."""
        body = completion_body(_text(_tokens(rng, 8)), max_tokens)
        if kind == "gateway":
            await ac.post(job["gateway"], path, body)
        elif kind == "random":
            await ac.post(pinned, path, body)
        else:
            sid, _ = await lb.acquire_server(session)
            try:
                await ac.post(servers[sid], path, body)
            finally:
                await lb.release_server(sid, session)

    await asyncio.sleep(max(0.0, job["start_at"] - time.time()))
    done = 0
    if job["workload"] == "sessions":
        deadline = job["start_at"] + job["seconds"]

        async def sessions() -> None:
            nonlocal done
            while time.time() < deadline:
                session, pinned = uuid.uuid4().hex, rng.choice(urls)
                turns = rng.randint(*SESSION_TURNS)
                for k in range(turns):
                    await turn(session, pinned, rng.randint(*SESSION_TURN_MS))
                    done += 1
                    if k < turns - 1:
                        await asyncio.sleep(rng.uniform(*SESSION_THINK_MS) / 1000)
                if lb is not None and job.get("end_sessions"):
                    await lb.end_session(session)

        await asyncio.gather(*(sessions() for _ in range(job["concurrency"])))
    elif job["workload"] == "balance":
        deadline = job["start_at"] + job["seconds"]

        async def loop() -> None:
            nonlocal done
            while time.time() < deadline:
                ms = max(1, round(rng.expovariate(1 / BAL_MEAN_MS)))
                await one(_tokens(rng, 8), ms)
                done += 1

        await asyncio.gather(*(loop() for _ in range(job["concurrency"])))
    else:  # grpo: groups one after another, the samples of a group at once
        for _ in range(job["groups"]):
            prompt = _tokens(rng, GRPO_PROMPT)
            await asyncio.gather(*(one(prompt, rng.randint(10, 30)) for _ in range(GROUP)))
            done += GROUP
    await ac.close()
    if lb is not None:
        await lb.close()
    return done


def _prefix_router(
    servers: dict[str, str], url: str, name: str, options: dict[str, float]
) -> AsyncPrefixCacheRouter:
    """The asyncio prefix_cache router with the shipped YAML's settings (plus ``options``)."""
    from redis_router.loader import load_router_config, resolve_config_path

    config = load_router_config(resolve_config_path(PREFIX_CONFIG))
    config.pop("router_class", None)
    config.update(redis=url, name=name, **options)
    return AsyncPrefixCacheRouter(servers, router_kwargs=config)


def _in_processes(
    b: Bench, jobs: list[dict[str, Any]], window: float | None
) -> tuple[int, list[dict[str, float]]]:
    """Run the jobs in the pool's processes, started together. Returns the requests done and
    the replicas' counts: over ``window`` seconds from the start (reset at the start), else
    over the whole run (reset before it)."""
    b.replicas.reset()
    start_at = time.time() + START_DELAY
    for job in jobs:
        job["start_at"] = start_at
    futures = [b.pool.submit(_worker, job) for job in jobs]
    stats = []
    if window is not None:
        time.sleep(max(0.0, start_at - time.time()))
        b.replicas.reset()
        time.sleep(window)
        stats = b.replicas.stats()
    done = sum(f.result(timeout=600) for f in futures)
    return done, stats if window is not None else b.replicas.stats()


def _balance_contenders(
    b: Bench,
) -> tuple[dict[str, Callable[[int], dict[str, Any]]], dict[str, str]]:
    common = {"servers": b.servers, "redis": b.redis_url}
    out: dict[str, Callable[[int], dict[str, Any]]] = {
        "redis-router, 4 processes on one Redis": lambda i: {
            **common,
            "kind": "redis-router",
            "name": "peers-balance",
        },
        "random replica per request (no router)": lambda i: {**common, "kind": "random"},
    }
    errors = {}
    for label in b.labels("balance"):
        insts = b.gateways[label]
        err = b.gateway_error(label, INSTANCES)
        if err:
            errors[label] = err
            continue
        out[f"{label}, one per process"] = lambda i, insts=insts: {
            **common,
            "kind": "gateway",
            "gateway": insts[i].url,
        }
    return out, errors


def _session_contenders(
    b: Bench,
) -> tuple[dict[str, Callable[[int], dict[str, Any]]], dict[str, str]]:
    """The sessions measure's: the balancer with its defaults, and with spread_sessions (each
    session ended after its last turn, or never), each session pinned to a random replica,
    the gateways."""
    common = {"servers": b.servers, "redis": b.redis_url}
    gateways, errors = _balance_contenders(b)
    out: dict[str, Callable[[int], dict[str, Any]]] = {
        "redis-router, 4 processes on one Redis, defaults": lambda i: {
            **common,
            "kind": "redis-router",
            "name": "peers-sessions",
        },
        "redis-router, spread_sessions, each session ended (end_session)": lambda i: {
            **common,
            "kind": "redis-router",
            "name": "peers-sessions-spread",
            "options": {"spread_sessions": True},
            "end_sessions": True,
        },
        "redis-router, spread_sessions, sessions never ended": lambda i: {
            **common,
            "kind": "redis-router",
            "name": "peers-sessions-kept",
            "options": {"spread_sessions": True},
        },
        "each session pinned to a random replica (no router)": lambda i: {
            **common,
            "kind": "random",
        },
    }
    out.update({k: v for k, v in gateways.items() if k.endswith(", one per process")})
    return out, errors


def _balance(b: Bench) -> list[Row]:
    """Dense (8 concurrent per process), sparse (2 per process: 8 in flight on 8 replicas,
    where a router that sees only its own requests stacks them on the same idle replicas),
    then sparse multi-turn sessions (a session thinking between turns holds no lease, so
    least loaded alone places new sessions beside idle pinned ones)."""
    return (
        _balance_at(b, BAL_CONCURRENCY, "balance")
        + _balance_at(b, 2, "balance_sparse")
        + _balance_at(b, SESSIONS_PER_PROCESS, "balance_sessions", "sessions")
    )


def _balance_at(b: Bench, concurrency: int, measure: str, workload: str = "balance") -> list[Row]:
    b.replicas.configure(0, 1.0)
    contenders, errors = (
        _session_contenders(b) if workload == "sessions" else _balance_contenders(b)
    )
    got: dict[str, list[float]] = {k: [] for k in contenders}
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    failed: dict[str, str] = {}
    for rep in range(b.reps):
        for name in _rotated(list(contenders), rep):
            jobs = [
                {
                    **contenders[name](i),
                    "workload": workload,
                    "concurrency": concurrency,
                    "seconds": b.sizes.bal_seconds,
                    "seed": f"{measure}:{rep}:{name}:{i}",
                }
                for i in range(INSTANCES)
            ]
            for job in jobs:  # a balancer per repetition: nothing pinned by the one before
                if "name" in job:
                    job["name"] = f"{job['name']}-{measure}-{rep}"
            try:
                done, stats = _in_processes(b, jobs, b.sizes.bal_seconds)
            except Exception as exc:
                failed[name] = _why(exc)
                got[name].append(math.nan)
                rates[name].append(math.nan)
                continue
            mean_inflight = [s["inflight_area"] / s["seconds"] for s in stats]
            got[name].append(max(mean_inflight) / statistics.mean(mean_inflight))
            rates[name].append(done / b.sizes.bal_seconds)
    b.replicas.configure(0, 0)
    rows = [
        Row(
            measure,
            k,
            {"max_over_mean": _med(v), "req_per_s": _med(rates[k])},
            f"failed: {failed[k]}" if k in failed else "",
            {"max_over_mean": v},
        )
        for k, v in got.items()
    ]
    rows += [
        _error_row(measure, f"{k}, one per process", v, ("max_over_mean",))
        for k, v in errors.items()
    ]
    return rows


def _grpo(b: Bench) -> list[Row]:
    b.replicas.configure(0, 1.0)
    common = {"servers": b.servers, "redis": b.redis_url}
    contenders: dict[str, Callable[[int, int], dict[str, Any]]] = {
        "random replica per request (no router)": lambda i, rep: {**common, "kind": "random"},
    }
    for label, opts in PREFIX_VARIANTS.items():
        contenders[label] = lambda i, rep, opts=opts, label=label: {
            **common,
            "kind": "prefix",
            "name": f"peers-grpo-{len(opts)}-{rep}",
            "options": opts,
        }
    errors = {}
    for label in b.labels("grpo"):
        insts = b.gateways[label]
        err = b.gateway_error(label, INSTANCES)
        if err:
            errors[label] = err
            continue
        contenders[f"{label}, one per process"] = lambda i, rep, insts=insts: {
            **common,
            "kind": "gateway",
            "gateway": insts[i].url,
        }
    got: dict[str, list[float]] = {k: [] for k in contenders}
    failed: dict[str, str] = {}
    for rep in range(b.reps):
        for name in _rotated(list(contenders), rep):
            jobs = [
                {
                    **contenders[name](i, rep),
                    "workload": "grpo",
                    "groups": b.sizes.groups,
                    "seed": f"grpo:{rep}:{name}:{i}",
                }
                for i in range(INSTANCES)
            ]
            try:
                got[name].append(_hit_rate(_in_processes(b, jobs, None)[1]))
            except Exception as exc:
                failed[name] = _why(exc)
                got[name].append(math.nan)
    b.replicas.configure(0, 0)
    ceiling = 100.0 * (GROUP - 1) / GROUP
    rows = [
        Row(
            "prefix_grpo",
            k,
            {"hit_rate_pct": _med(v)},
            f"failed: {failed[k]}" if k in failed else "",
            {"hit_rate_pct": v},
        )
        for k, v in got.items()
    ]
    rows.append(
        Row("prefix_grpo", "ceiling (each group's first sample misses)", {"hit_rate_pct": ceiling})
    )
    rows += [
        _error_row("prefix_grpo", f"{k}, one per process", v, ("hit_rate_pct",))
        for k, v in errors.items()
    ]
    return rows


def _hit_rate(stats: list[dict[str, float]]) -> float:
    prompt = sum(s["prompt_tokens"] for s in stats)
    return 100.0 * sum(s["cached_tokens"] for s in stats) / prompt if prompt else math.nan


# --------------------------------------------------------------------------------------------
# (4a) multi-turn sessions roaming between router instances
# --------------------------------------------------------------------------------------------

MT_FIRST = 512  # tokens of a session's first prompt
MT_TURN = 64  # tokens each later turn adds (the previous answer and the next question)


async def _multiturn(b: Bench) -> list[Row]:
    b.replicas.configure(0, 1.0)
    servers = b.servers
    urls = b.replicas.urls
    ac = AsyncClient()
    path = "/v1/completions"

    async def sessions(send: Callable[[str, int, list[int]], Any], seed: str) -> None:
        rng = random.Random(seed)  # prompts of their own: no gateway saw them in another row
        firsts = [_tokens(rng, MT_FIRST) for _ in range(b.sizes.sessions)]

        async def session(s: int) -> None:
            sid = f"s{s}-{uuid.uuid4().hex}"
            prompt = list(firsts[s])
            for turn in range(b.sizes.turns):
                await send(sid, s + turn, prompt)
                prompt += _tokens(rng, MT_TURN)

        await asyncio.gather(*(session(s) for s in range(b.sizes.sessions)))

    def via_gateway(
        insts: list[gws.Gateway], k: int, session: bool
    ) -> Callable[[str, int, list[int]], Any]:
        async def send(sid: str, hop: int, prompt: list[int]) -> None:
            headers = {fronts.SESSION_HEADER: sid} if session else None
            body = completion_body(_text(prompt), 8)
            await ac.post(insts[hop % k].url, path, body, headers)

        return send

    async def pinned(sid: str, hop: int, prompt: list[int]) -> None:  # the ceiling
        await ac.post(urls[hash(sid) % len(urls)], path, completion_body(_text(prompt), 8))

    contenders: dict[str, Any] = {"each session pinned to one replica (ceiling)": pinned}
    routers: list[Any] = []
    for label, opts in PREFIX_VARIANTS.items():
        for k in (INSTANCES, 1):
            group = [
                _prefix_router(servers, b.redis_url, f"peers-mt-{len(opts)}-{k}", opts)
                for _ in range(k)
            ]
            routers += group

            async def send(sid: str, hop: int, prompt: list[int], group: list[Any] = group) -> None:
                lb = group[hop % len(group)]
                server, _ = await lb.acquire_server(sid, prompt_ids=prompt)
                try:
                    await ac.post(servers[server], path, completion_body(_text(prompt), 8))
                finally:
                    await lb.release_server(server, sid)

            contenders[f"{label}, {_instances(k)}"] = send
    errors = {}
    for label in b.labels("multiturn"):
        insts = b.gateways[label]
        err = b.gateway_error(label, INSTANCES)
        if err:
            errors[label] = err
            continue
        for k in (INSTANCES, 1):
            contenders[f"{label}, {_instances(k)}"] = via_gateway(
                insts, k, label in b.session_header
            )
    got: dict[str, list[float]] = {k: [] for k in contenders}
    failed: dict[str, str] = {}
    for rep in range(b.reps):
        for name in _rotated(list(contenders), rep):
            b.replicas.reset()
            try:
                await sessions(contenders[name], f"multiturn:{rep}:{name}")
            except Exception as exc:
                failed[name] = _why(exc)
                got[name].append(math.nan)
                continue
            got[name].append(_hit_rate(b.replicas.stats()))
    for lb in routers:
        await lb.close()
    await ac.close()
    b.replicas.configure(0, 0)
    rows = [
        Row(
            "prefix_multiturn",
            k,
            {"hit_rate_pct": _med(v)},
            f"failed: {failed[k]}" if k in failed else "",
            {"hit_rate_pct": v},
        )
        for k, v in got.items()
    ]
    rows += [
        _error_row("prefix_multiturn", f"{k}, {_instances(INSTANCES)}", v, ("hit_rate_pct",))
        for k, v in errors.items()
    ]
    return rows


def _instances(k: int) -> str:
    return "1 instance" if k == 1 else f"{k} instances, each turn through the next"


# --------------------------------------------------------------------------------------------
# tables, main
# --------------------------------------------------------------------------------------------

TITLES = {
    "latency": "(1) added latency per request, 1 client, replicas answer at once (us)",
    "throughput_0ms": "(2) throughput, 32 concurrent asyncio clients, 0 ms service",
    "throughput_20ms": "(2) throughput, 32 concurrent asyncio clients, 20 ms service",
    "balance": f"(3) balance, 4 client processes x {BAL_CONCURRENCY} concurrent requests, 4 "
    "independent routers: time-weighted in-flight per replica, max / mean",
    "balance_sparse": "(3) the same, sparse: 4 client processes x 2 concurrent requests",
    "balance_sessions": f"(3) the same, sparse multi-turn sessions: 4 client processes x "
    f"{SESSIONS_PER_PROCESS} sessions of {SESSION_TURNS[0]}-{SESSION_TURNS[1]} turns "
    f"({SESSION_TURN_MS[0]}-{SESSION_TURN_MS[1]} ms), {SESSION_THINK_MS[0]:g}-"
    f"{SESSION_THINK_MS[1]:g} ms thinking between turns",
    "prefix_multiturn": f"(4a) prefix-cache token hit rate, multi-turn sessions roaming between "
    f"router instances ({MT_FIRST}-token first prompt, +{MT_TURN} per turn)",
    "prefix_grpo": f"(4b) prefix-cache token hit rate, GRPO groups of {GROUP} samples of a "
    f"{GRPO_PROMPT}-token prompt from 4 processes",
    "cpu": "(5) CPU per routed request, every process counted (us): the caller's process and "
    "Redis above a direct request, and a gateway's or front's process",
}


def _fmt(key: str, v: float) -> str:
    if not math.isfinite(v):
        return "-"
    if key.endswith("_us"):
        return f"{v:+.0f}" if key.startswith("added") else f"{v:.0f}"
    if key == "req_per_s":
        return f"{v:,.0f}/s"
    if key == "ratio_to_direct":
        return f"{v:.2f}x"
    if key == "max_over_mean":
        return f"{v:.2f}"
    if key.endswith("_pct"):
        return f"{v:.1f} %"
    return f"{v:g}"


HEADS = {
    "added_p50_us": "added p50",
    "added_p99_us": "added p99",
    "p50_us": "p50",
    "p99_us": "p99",
    "req_per_s": "req/s",
    "ratio_to_direct": "vs direct",
    "max_over_mean": "max/mean",
    "hit_rate_pct": "hit rate",
    "cpu_us": "CPU",
    "client_us": "client",
    "redis_us": "Redis",
    "gateway_us": "gateway",
}


def tables(rows: list[Row]) -> str:
    out = []
    for measure in TITLES:
        mine = [r for r in rows if r.measure == measure]
        if not mine:
            continue
        keys = [k for k in HEADS if any(k in r.values for r in mine)]
        head = ["contender", *(HEADS[k] for k in keys), ""]
        lines = [
            [r.contender, *(_fmt(k, r.values[k]) if k in r.values else "" for k in keys), r.note]
            for r in mine
        ]
        widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
        out.append(TITLES[measure])
        out.append(_line(head, widths))
        out.append("-" * len(out[-1]))
        out += [_line(x, widths) for x in lines]
        out.append("")
    return "\n".join(out)


def _line(cells: list[str], widths: list[int]) -> str:
    """Names and notes left-aligned, numbers right-aligned."""
    last = len(cells) - 1
    return "  ".join(
        c.ljust(w) if i in (0, last) else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ).rstrip()


def _versions(redis_url: str, gateway_versions: dict[str, str]) -> dict[str, str]:
    info = redis.Redis.from_url(redis_url).info("server")
    server = "valkey" if "valkey_version" in info else "redis"
    out = {
        "redis-router": importlib.metadata.version("llm-redis-router")
        if _has_dist("llm-redis-router")
        else "unknown",
        "revision": _revision(),
        "redis-py": redis.__version__,
        "server": f"{server} {info.get('valkey_version') or info.get('redis_version')}",
        "python": platform.python_version(),
    }
    out.update(gateway_versions)
    return out


def _revision() -> str:
    """The checkout's commit (and '+' when the work tree differs), or 'unknown'."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(gws.ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(gws.ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (rev + ("+" if dirty else "")) or "unknown"


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _machine() -> str:
    return f"{platform.node()}, {platform.platform()}, {os.cpu_count()} CPUs"


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description="redis-router side by side with vllm-router, sglang-router and smg on fake "
        "OpenAI-compatible replicas: added latency, throughput, balance, prefix-cache hit rate.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds): the smoke test")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument(
        "--only", metavar="MEASURES", help=f"comma-separated subset of {','.join(MEASURES)}"
    )
    p.add_argument(
        "-R", "--reps", type=int, default=None, help="repetitions (default 3; --quick 1)"
    )
    p.add_argument("-N", "--replicas", type=int, default=8, help="fake replicas (default 8)")
    p.add_argument("--no-gateways", action="store_true", help="redis-router and references only")
    p.add_argument("--no-install", action="store_true", help="do not pip-install missing gateways")
    args = p.parse_args(argv)
    only = args.only.split(",") if args.only else list(MEASURES)
    bad = [m for m in only if m not in MEASURES]
    if bad:
        p.error(f"--only: unknown measure(s) {bad}; choose from {', '.join(MEASURES)}")
    if args.replicas < 2 or args.replicas > 256:
        p.error("-N/--replicas: between 2 and 256")
    if args.reps is not None and not 1 <= args.reps <= 50:
        p.error("-R/--reps: between 1 and 50")
    args.only = only
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    sizes = Sizes.quick() if args.quick else Sizes.full()
    reps = args.reps or (1 if args.quick else 3)
    log: list[str] = []
    if args.no_gateways:
        gw_versions = {s.dist: "not run (--no-gateways)" for s in gws.SPECS}
    elif args.no_install:
        gw_versions = gws.installed()
    else:
        gw_versions = gws.install(log)
    for line in log:
        print(line, file=sys.stderr)
    binary = first_server_binary()
    if binary is None:
        print("no Redis-compatible server binary found", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="peers-gateways-"))
    measures = set(args.only) - {"prefix"} | (
        {"multiturn", "grpo"} if "prefix" in args.only else set()
    )
    started = time.time()
    with LocalServer(binary) as server:
        server.start()
        replicas = FakeReplicas([gws.free_port() for _ in range(args.replicas)])
        gateways: dict[str, list[gws.Gateway]] = {}
        pool = ProcessPoolExecutor(INSTANCES, mp_context=multiprocessing.get_context("spawn"))
        try:
            counts = {f.label: fronts.needed(f, measures, INSTANCES) for f in fronts.FRONTS}
            servers = {f"r{i}": url for i, url in enumerate(replicas.urls)}
            gateways.update(fronts.start(fronts.FRONTS, counts, servers, server.url, logs))
            if not args.no_gateways:
                for spec in gws.SPECS:
                    version = gw_versions[spec.dist]
                    if version.startswith("not installed"):
                        gateways[spec.label] = [gws.Gateway(spec, error=version)]
                        continue
                    need = INSTANCES if {"balance", "prefix"} & set(args.only) else 1
                    gateways[spec.label] = [
                        gws.start(spec, replicas.urls, logs, i) for i in range(need)
                    ]
            bench = Bench(
                replicas,
                server.url,
                gateways,
                sizes,
                reps,
                pool,
                {f.label: f.measures for f in fronts.FRONTS},
                {f.label for f in fronts.FRONTS if f.session_header},
            )
            list(pool.map(time.sleep, [0.1] * INSTANCES))  # spawn the client processes now
            rows: list[Row] = []
            if "latency" in args.only:
                rows += asyncio.run(_latency(bench))
            if "throughput" in args.only:
                rows += asyncio.run(_throughput(bench))
            if "balance" in args.only:
                rows += _balance(bench)
            if "prefix" in args.only:
                rows += asyncio.run(_multiturn(bench))
                rows += _grpo(bench)
            if "cpu" in args.only:
                rows += asyncio.run(_cpu(bench))
            versions = _versions(server.url, {**fronts.versions(), **gw_versions})
        finally:
            for insts in gateways.values():
                for g in insts:
                    g.stop()
            pool.shutdown()
            replicas.close()
    if not any(g.error and g.log_path for insts in gateways.values() for g in insts):
        shutil.rmtree(logs, ignore_errors=True)  # kept when a gateway failed: its log says why
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": _machine(),
        "versions": versions,
        "repetitions": reps,
        "replicas": args.replicas,
        "quick": args.quick,
        "seconds": round(time.time() - started, 1),
    }
    print(
        f"peers benchmark, {meta['date']}, {meta['machine']}\n"
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"\nR={reps} repetitions (medians), N={args.replicas} fake replicas"
        f"{', --quick' if args.quick else ''}, {meta['seconds']} s\n"
    )
    print(tables(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "meta": meta,
                    "rows": [
                        {
                            "measure": r.measure,
                            "contender": r.contender,
                            "values": {
                                k: (v if math.isfinite(v) else None) for k, v in r.values.items()
                            },
                            "note": r.note,
                            "runs": r.runs,
                        }
                        for r in rows
                    ],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
