"""`redis-router simulate`: replicas with prefix (KV) caches, driven by the real routers.

Why: a prefix-cache-aware router is only worth its cost if it saves prefill work without
unbalancing the pool; this measures both, on the workloads of RL rollouts, against the routers
it competes with.

Model. Each simulated replica has a block-level LRU KV cache (``--cache-blocks`` blocks of
``BLOCK`` tokens, chained block hashes as in vLLM) and serves its requests one after another
(FIFO): a request costs 1 unit per uncached prompt token, ``CACHED_COST`` per cached one (the
leading blocks found in the cache) and ``DECODE_COST`` per output token; a replica does
``REPLICA_SPEED`` units per simulated second. After a request its prompt and output blocks are
in the cache (most recently used). Replica state lives in Redis under ``rrsim:{RUN}:`` and
changes by one Lua script per request, so worker processes share the replicas as they share
the balancer. Simulated time runs ``--speed`` times faster than the wall clock (real sleeps).

Driving. ``--processes`` worker processes (multiprocessing, spawn), each running
``--sessions`` threads of closed-loop sessions, call the routers' public protocol
(``acquire_server`` with the declared fields, ``release_server``) on a fresh balancer name.

Workloads: ``multi-turn`` (agent sessions of several turns under one request id, sharing a
short system prompt), ``grpo`` (each prompt sampled n = 8 times under 8 request ids, started
together), ``system`` (a long shared system prompt and a short unique question), ``mix``
(the three interleaved).

Routers: ``random`` (uniform over the replicas taking new sessions, sticky like the core:
:class:`RandomRouter`, defined here), ``least-loaded`` (the default RedisLoadBalancer),
``least-tokens`` and ``prefix-cache`` (the plugins, from ``redis_router.plugins``).

Report per workload and router: token hit rate (cached prompt tokens / prompt tokens), load
balance (mean over samples taken while the pool is busy, i.e. at least 3/4 of the sessions
in flight, of max/mean in-flight per replica), throughput (requests per simulated second) and
median acquire latency. Then the targets the router is held to, and an acquire benchmark with
a 4k-token prompt (prefix-cache vs the default router, interleaved, medians).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import multiprocessing
import random
import secrets
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis

from .. import scripts
from ..balancer import RedisLoadBalancer
from ..local_server import given_or_private_redis
from ..policy import RoutingPolicy

BLOCK = 16  # tokens per replica KV block (vLLM's default)
CACHED_COST = 0.05  # work units per cached prompt token (attention over the cached KV)
DECODE_COST = 0.5  # work units per output token
REPLICA_SPEED = 10_000.0  # work units per simulated second
VOCAB = 32_000
GROUP = 8  # GRPO samples per prompt
BUSY = 0.75  # the pool is busy while at least this share of the sessions is in flight
SAMPLE_EVERY = 0.02  # wall seconds between balance samples

ROUTERS: dict[str, str] = {
    "random": "redis_router.tools.simulate:RandomRouter",
    "least-loaded": "redis_router:RedisLoadBalancer",
    "least-tokens": "redis_router.plugins.least_tokens:LeastTokensRouter",
    "prefix-cache": "redis_router.plugins.prefix_cache:PrefixCacheRouter",
}
WORKLOADS = ("multi-turn", "grpo", "system", "mix")

_RANDOM_LUA = """
-- The simulator's random router: uniform over the replicas taking new sessions (client
-- entropy in ARGV), with the core's leases and stickiness (acquire_all).
-- Uses     lib/base, lib/holders, lib/admission, lib/picking, lib/acquiring
return acquire_all(OWN, {
  choose = function(i)
    local n = redis.call('ZCARD', P .. 'load')
    local r = tonumber(ARGV[i + 2]) % n
    return redis.call('ZRANGE', P .. 'load', r, r)[1]
  end,
})
"""

_SERVE_LUA = """
-- Serve one request on a simulated replica. KEYS[1] "rrsim:{RUN}:".
-- ARGV: replica, cache capacity (blocks), prompt tokens, output tokens, block tokens,
-- cached cost, decode cost, speed (units per wall ms), prompt blocks n, block hashes of
-- prompt + output (16 hex chars each; the first n are the prompt's).
-- Returns {cached prompt tokens, wall microseconds until the reply}.
local S, id = KEYS[1], ARGV[1]
local cap, ptok, otok = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local bt = tonumber(ARGV[5])
local n, hs = tonumber(ARGV[9]), ARGV[10]
local m = #hs / 16
local cache = S .. 'kv:' .. id
local hit = 0
if n > 0 then
  local list = {}
  for j = 1, n do list[j] = string.sub(hs, (j - 1) * 16 + 1, j * 16) end
  local scores = redis.call('ZMSCORE', cache, unpack(list))
  while hit < n and scores[hit + 1] do hit = hit + 1 end
end
if m > 0 then
  local seq = redis.call('HINCRBY', S .. 'seq', id, m)
  local args = {}
  for j = 1, m do
    args[#args + 1] = seq - m + j
    args[#args + 1] = string.sub(hs, (j - 1) * 16 + 1, j * 16)
  end
  redis.call('ZADD', cache, unpack(args))
  local over = redis.call('ZCARD', cache) - cap
  if over > 0 then redis.call('ZREMRANGEBYRANK', cache, 0, over - 1) end
end
local cached = hit * bt
local work = (ptok - cached) + tonumber(ARGV[6]) * cached + tonumber(ARGV[7]) * otok
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local free = tonumber(redis.call('HGET', S .. 'free', id) or '0')
local finish = math.max(now, free) + work / tonumber(ARGV[8])
redis.call('HSET', S .. 'free', id, string.format('%.3f', finish))
return {cached, math.floor((finish - now) * 1000)}
"""


class RandomPolicy(RoutingPolicy):
    """Uniform random choice among the replicas taking new sessions (a baseline)."""

    name = "random"

    @property
    def script(self) -> scripts.Script:
        return _random_script()


@functools.cache
def _random_script() -> scripts.Script:
    return scripts.from_source("sim_random", _RANDOM_LUA)


class RandomRouter(RedisLoadBalancer):
    """The random baseline, with the core's leases and stickiness."""

    default_policy = RandomPolicy


# -- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    request_id: str
    prompt: list[int]
    output: list[int]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _jobs(workload: str, seed: int, jobs: int, turns: int) -> list[list[Turn]]:
    """All sessions of a run, in start order; a session is the turns of one request id
    (multi-turn) or one request (grpo, system). Deterministic in (workload, seed)."""
    rng = random.Random(f"{workload}:{seed}")
    system_short = _tokens(random.Random(f"sys-short:{seed}"), 256)
    system_long = _tokens(random.Random(f"sys-long:{seed}"), 2048)
    out: list[list[Turn]] = []

    def agent(k: int) -> list[Turn]:
        prompt, session = system_short + _tokens(rng, 512), []
        for _ in range(turns):
            output = _tokens(rng, 128)
            session.append(Turn(f"agent-{seed}-{k}", prompt, output))
            prompt = prompt + output + _tokens(rng, 256)  # the tool's observation
        return session

    def group(k: int) -> list[list[Turn]]:
        prompt = _tokens(rng, rng.randrange(768, 1536))
        return [[Turn(f"grpo-{seed}-{k}-{s}", prompt, _tokens(rng, 256))] for s in range(GROUP)]

    def system(k: int) -> list[Turn]:
        return [Turn(f"sys-{seed}-{k}", system_long + _tokens(rng, 128), _tokens(rng, 128))]

    k = 0
    while len(out) < jobs:
        kind = workload if workload != "mix" else ("multi-turn", "grpo", "system")[k % 3]
        if kind == "multi-turn":
            out.append(agent(k))
        elif kind == "grpo":
            out.extend(group(k))
        else:
            out.append(system(k))
        k += 1
    return out


def _block_hashes(tokens: Sequence[int]) -> str:
    """The replica's own chained block hashes (vLLM-style), concatenated."""
    raw, step = array("I", tokens).tobytes(), BLOCK * 4
    parent, out = b"", []
    for j in range(len(tokens) // BLOCK):
        parent = hashlib.blake2b(parent + raw[j * step : (j + 1) * step], digest_size=8).digest()
        out.append(parent.hex())
    return "".join(out)


# -- one run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What every worker process of one run needs (picklable)."""

    url: str
    name: str
    sim_prefix: str
    router: str
    router_options: dict[str, Any]
    replicas: int
    workload: str
    seed: int
    jobs: int
    turns: int
    processes: int
    sessions: int
    cache_blocks: int
    speed: float
    start_at: float


@dataclass
class Result:
    workload: str
    router: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    balance: float
    busy_samples: int
    throughput: float
    acquire_us: float
    sim_seconds: float


def router_class(key: str) -> type:
    """A router class from a ``module:Class`` spec (ROUTERS' values)."""
    module, _, attr = ROUTERS.get(key, key).partition(":")
    cls: type = getattr(importlib.import_module(module), attr)
    return cls


def _servers(n: int) -> dict[str, str]:
    return {f"replica-{i}": f"sim://replica-{i}" for i in range(n)}


def _warm(routers: list[str]) -> None:
    for r in routers:
        router_class(r)


def _worker(spec: Spec, index: int) -> dict[str, Any]:
    """One worker process: run its share of the sessions on `spec.sessions` threads."""
    cls = router_class(spec.router)
    lb = cls(
        servers=_servers(spec.replicas),
        router_kwargs={"redis": spec.url, "name": spec.name, **spec.router_options},
    )
    acquire_fields = set(lb.require_acquire_fields())
    client = redis.Redis.from_url(spec.url)
    serve = client.register_script(_SERVE_LUA)
    all_jobs = _jobs(spec.workload, spec.seed, spec.jobs, spec.turns)
    # GRPO groups stay together in one process, as verl's workers receive them.
    mine = [job for k, job in enumerate(all_jobs) if (k // GROUP) % spec.processes == index]
    lock = threading.Lock()
    totals = {"requests": 0, "prompt": 0, "cached": 0, "end": 0.0}
    latencies: list[float] = []
    speed_ms = REPLICA_SPEED * spec.speed / 1000  # work units per wall millisecond

    def session_loop() -> None:
        while True:
            with lock:
                if not mine:
                    return
                job = mine.pop(0)
            for turn in job:
                fields = {"prompt_ids": turn.prompt} if "prompt_ids" in acquire_fields else {}
                t0 = time.perf_counter()
                sid, _ = lb.acquire_server(turn.request_id, **fields)
                t1 = time.perf_counter()
                hs = _block_hashes(turn.prompt + turn.output)
                cached, wait_us = serve(
                    keys=[spec.sim_prefix],
                    args=[
                        sid, spec.cache_blocks, len(turn.prompt), len(turn.output), BLOCK,
                        CACHED_COST, DECODE_COST, speed_ms, len(turn.prompt) // BLOCK, hs,
                    ],
                )  # fmt: skip
                time.sleep(int(wait_us) / 1e6)
                lb.release_server(sid, request_id=turn.request_id)
                with lock:
                    totals["requests"] += 1
                    totals["prompt"] += len(turn.prompt)
                    totals["cached"] += int(cached)
                    latencies.append(t1 - t0)

    time.sleep(max(0.0, spec.start_at - time.time()))
    threads = [threading.Thread(target=session_loop) for _ in range(spec.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    totals["end"] = time.time()
    lb.close()
    client.close()
    return {**totals, "latencies": latencies}


def _sample_balance(
    lb: RedisLoadBalancer, busy_at: int, stop: threading.Event, out: list[float]
) -> None:
    """Sample max/mean in-flight per replica while at least `busy_at` requests are in flight."""
    while not stop.wait(SAMPLE_EVERY):
        counts = list(lb.get_status()["servers"].values())
        total = sum(counts)
        if counts and total >= busy_at and total > 0:
            out.append(max(counts) / (total / len(counts)))


def run_one(pool: Any, base: Spec) -> Result:
    """Run one (workload, router) pair on a fresh balancer and fresh replicas."""
    spec = Spec(**{**asdict(base), "start_at": time.time() + 0.5})
    watcher = RedisLoadBalancer(_servers(spec.replicas), redis=spec.url, name=spec.name)
    samples: list[float] = []
    stop = threading.Event()
    busy_at = max(1, int(BUSY * spec.processes * spec.sessions))
    sampler = threading.Thread(target=_sample_balance, args=(watcher, busy_at, stop, samples))
    sampler.start()
    try:
        parts = pool.starmap(_worker, [(spec, i) for i in range(spec.processes)])
    finally:
        stop.set()
        sampler.join()
        cls = router_class(spec.router)
        cleaner = cls(router_kwargs={"redis": spec.url, "name": spec.name})
        cleaner.destroy()
        cleaner.close()
        watcher.close()
        with redis.Redis.from_url(spec.url) as c:
            keys = list(c.scan_iter(match=spec.sim_prefix + "*"))
            if keys:
                c.delete(*keys)
    requests = sum(p["requests"] for p in parts)
    prompt = sum(p["prompt"] for p in parts)
    cached = sum(p["cached"] for p in parts)
    wall = max(p["end"] for p in parts) - spec.start_at
    sim_seconds = wall * spec.speed
    lat = [x for p in parts for x in p["latencies"]]
    return Result(
        workload=spec.workload,
        router=spec.router,
        requests=requests,
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        balance=statistics.fmean(samples) if samples else float("nan"),
        busy_samples=len(samples),
        throughput=requests / sim_seconds if sim_seconds > 0 else 0.0,
        acquire_us=statistics.median(lat) * 1e6 if lat else float("nan"),
        sim_seconds=sim_seconds,
    )


# -- acquire benchmark ----------------------------------------------------------------------


def acquire_benchmark(
    url: str, *, rounds: int = 2000, tokens: int = 4096, replicas: int = 8
) -> dict[str, float]:
    """Median ACQUIRE time (µs; the release that follows each is common to both routers and
    not timed) of the default router, and of prefix-cache with a ``tokens``-token prompt seen
    before (a GRPO group's repeat) and one never seen, plus each one's ratio to the default
    (target: <= 2). One client, one server; the three run interleaved in a shuffled
    order each round, so machine noise hits all alike. Not a test: a figure for the report."""
    from redis_router.plugins.prefix_cache import PrefixCacheRouter

    tag = secrets.token_hex(3)
    servers = _servers(replicas)
    base = RedisLoadBalancer(servers, redis=url, name=f"bench-{tag}-default")
    pc = PrefixCacheRouter(servers, router_kwargs={"redis": url, "name": f"bench-{tag}-pc"})
    rng = random.Random(7)
    prompt = _tokens(rng, tokens)
    times: dict[str, list[float]] = {"default": [], "prefix-cached": [], "prefix-unique": []}
    clock = time.perf_counter
    try:
        pc.release_server(pc.acquire_server("warm", prompt_ids=prompt)[0], "warm")
        for i in range(rounds):
            unique = [VOCAB + i, *prompt[1:]]  # a first token no other prompt has
            order = [("default", None), ("prefix-cached", prompt), ("prefix-unique", unique)]
            rng.shuffle(order)
            for key, ids in order:
                rid = f"{key}-{i}"
                if ids is None:
                    t0 = clock()
                    sid, _ = base.acquire_server(rid)
                    times[key].append(clock() - t0)
                    base.release_server(sid, rid)
                else:
                    t0 = clock()
                    sid, _ = pc.acquire_server(rid, prompt_ids=ids)
                    times[key].append(clock() - t0)
                    pc.release_server(sid, rid)
    finally:
        base.destroy()
        pc.destroy()
        base.close()
        pc.close()
    out = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    out["ratio-cached"] = out["prefix-cached"] / out["default"]
    out["ratio-unique"] = out["prefix-unique"] / out["default"]
    return out


# -- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `redis-router simulate` (--redis comes from the CLI's global options)."""
    from . import simulate_engine, simulate_kv

    parser.description = __doc__.split("\n\n")[0] if __doc__ else None
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run (seconds), for tests; too small to judge the prefix-cache "
        "targets, so it shows their figures as not judged",
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all); with --kv: of "
        f"{', '.join(simulate_kv.ALL_WORKLOADS)} (default: all); with --engine: of "
        f"{', '.join(simulate_engine.WORKLOADS)} (default: {simulate_engine.WORKLOADS[0]})",
    )
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help=f"comma-separated, of {', '.join(ROUTERS)} (default: all)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=8,
        help="simulated replicas (default: 8; --quick: at most 4; --kv, --rl and --engine "
        "have pools of their own)",
    )
    parser.add_argument("--processes", type=int, default=4, help="worker processes")
    parser.add_argument("--sessions", type=int, default=48, help="concurrent sessions a process")
    parser.add_argument("--jobs", type=int, default=768, help="sessions (requests) a run")
    parser.add_argument("--turns", type=int, default=4, help="turns of a multi-turn session")
    parser.add_argument("--cache-blocks", type=int, default=4096, help="KV blocks a replica")
    parser.add_argument(
        "--speed", type=float, default=2.0, help="simulated seconds per wall second"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of the workloads and the routers' tie-breaks: a run with the same seed "
        "repeats (default: 1)",
    )
    parser.add_argument("--no-bench", action="store_true", help="skip the acquire benchmark")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--rl",
        action="store_true",
        help="instead: the locality/balance trade of RL rollouts (sticky only, a global gate, "
        "affinity margins, groups, prefix-cache), in virtual time (redis_router.tools.simulate_rl)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=4,
        help="with --kv, --rl, --engine or --shards: seeds (from --seed on) each row is averaged "
        "over",
    )
    parser.add_argument(
        "--clients",
        default="1,8,64",
        help="with --kv: comma-separated routing client counts, each a row",
    )
    parser.add_argument(
        "--kv",
        action="store_true",
        help="instead: routing on the replicas' KV-cache events (least-loaded, approximate, "
        "exact, oracle) under KV pressure, with 1, 8 and 64 routing clients, in virtual time "
        "(redis_router.tools.simulate_kv)",
    )
    parser.add_argument(
        "--shards",
        nargs="?",
        const="1,2,4,8,16",
        metavar="K,K,...",
        help="instead: where a new session goes in a pool split over K shards (hash, power of "
        "two, join-idle-queue, a directory...), a placement model in virtual time, no Redis "
        "(redis_router.tools.simulate_shards; default K: 1,2,4,8,16)",
    )
    parser.add_argument(
        "--engine",
        action="store_true",
        help="instead: least loaded on lease counts against engine-aware scoring, over a pool "
        "with a half-speed replica, a half-KV-memory one and sessions past the router, in "
        "virtual time (redis_router.tools.simulate_engine)",
    )


def _quick(args: argparse.Namespace) -> argparse.Namespace:
    q = argparse.Namespace(**vars(args))
    q.processes, q.sessions, q.jobs, q.turns, q.speed = 2, 8, 48, 3, 8.0
    q.replicas = min(args.replicas, 4)
    return q


def available_routers(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(routers that import, routers skipped because their module is missing)."""
    ok, missing = [], []
    for n in names:
        try:
            router_class(n)
            ok.append(n)
        except ImportError:
            missing.append(n)
    return ok, missing


def table(results: Sequence[Result]) -> str:
    """The results as a Markdown table."""
    rows = [
        "| workload | router | token hit rate | max/mean in-flight (busy) | req/s (sim) "
        "| acquire p50 (µs) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r.workload} | {r.router} | {r.hit_rate:.1%} | {r.balance:.2f} "
            f"| {r.throughput:.1f} | {r.acquire_us:.0f} |"
        )
    return "\n".join(rows)


# What a --quick run says instead of met / NOT met: its few sessions (48, on at most 4
# replicas) and benchmark rounds (50) make the balance and the latency ratios noise.
NOT_JUDGED = "not judged (a --quick run is too small for this target; run without --quick)"


def targets(
    results: Sequence[Result], bench: dict[str, float] | None, quick: bool = False
) -> list[str]:
    """The prefix-cache targets, checked against this run's figures (``quick``: shown with
    the figures but not judged, see NOT_JUDGED)."""

    def verdict(ok: bool) -> str:
        return NOT_JUDGED if quick else "met" if ok else "NOT met"

    by = {(r.workload, r.router): r for r in results}
    lines = []
    g_pc, g_ll = by.get(("grpo", "prefix-cache")), by.get(("grpo", "least-loaded"))
    if g_pc and g_ll:
        ratio = g_pc.hit_rate / g_ll.hit_rate if g_ll.hit_rate else float("inf")
        ok = ratio >= 1.5 and g_pc.balance <= 1.25
        lines.append(
            f"- GRPO: hit rate {ratio:.2f}x least-loaded's (target >= 1.5x), max/mean "
            f"{g_pc.balance:.2f} (target <= 1.25): {verdict(ok)}"
        )
    m_pc, m_ll = by.get(("multi-turn", "prefix-cache")), by.get(("multi-turn", "least-loaded"))
    if m_pc and m_ll:
        ok = m_pc.hit_rate >= m_ll.hit_rate - 0.005
        lines.append(
            f"- multi-turn: hit rate {m_pc.hit_rate:.1%} vs least-loaded {m_ll.hit_rate:.1%} "
            f"(target: not worse, 0.5 pt noise allowed): {verdict(ok)}"
        )
    if bench:
        ok = max(bench["ratio-cached"], bench["ratio-unique"]) <= 2.0
        lines.append(
            f"- acquire, 4k-token prompt (medians): default {bench['default']:.0f} µs; "
            f"prefix-cache {bench['prefix-cached']:.0f} µs cached ({bench['ratio-cached']:.2f}x),"
            f" {bench['prefix-unique']:.0f} µs never seen ({bench['ratio-unique']:.2f}x) "
            f"(target <= 2x): {verdict(ok)}"
        )
    return lines


def _names(given: str | None, default: Sequence[str]) -> list[str]:
    return list(default) if given is None else [w for w in given.split(",") if w]


def _ints(given: str, arg: str) -> list[int]:
    try:
        return [int(x) for x in given.split(",") if x]
    except ValueError:
        raise ValueError(f"{arg} must be comma-separated ints, got {given!r}") from None


def run(args: argparse.Namespace) -> int:
    """Run every (workload, router) pair, print the table and the targets."""
    if args.shards is not None:
        from . import simulate_shards

        return simulate_shards.main(
            args.seed, args.quick, sys.stdout, args.seeds, _ints(args.shards, "--shards")
        )
    if args.rl:
        from . import simulate_rl

        with given_or_private_redis(getattr(args, "redis", None)) as (url, where):
            print(f"simulate --rl: {simulate_rl.REPLICAS} replicas, {where}", file=sys.stdout)
            return simulate_rl.main(url, args.seed, args.quick, sys.stdout, args.seeds)
    if args.engine:
        from . import simulate_engine

        with given_or_private_redis(getattr(args, "redis", None)) as (url, where):
            print(f"simulate --engine: {where}", file=sys.stdout)
            return simulate_engine.main(
                url,
                args.seed,
                args.quick,
                sys.stdout,
                args.seeds,
                workloads=_names(args.workloads, simulate_engine.WORKLOADS[:1]),
            )
    if args.kv:
        from . import simulate_kv

        with given_or_private_redis(getattr(args, "redis", None)) as (url, where):
            print(f"simulate --kv: {where}", file=sys.stdout)
            return simulate_kv.main(
                url,
                args.seed,
                args.quick,
                sys.stdout,
                args.seeds,
                clients=_ints(args.clients, "--clients"),
                workloads=_names(args.workloads, simulate_kv.ALL_WORKLOADS),
            )
    if args.quick:
        args = _quick(args)
    workloads = _names(args.workloads, WORKLOADS)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {WORKLOADS}")
    routers, missing = available_routers([r for r in args.routers.split(",") if r])
    out = sys.stdout
    with given_or_private_redis(getattr(args, "redis", None)) as (url, where):
        print(
            f"simulate: {args.replicas} replicas, {args.processes} processes x "
            f"{args.sessions} sessions, {args.jobs} sessions a run, {where}",
            file=out,
        )
        if missing:
            print(f"skipped (not importable): {', '.join(missing)}", file=out)
        tag = secrets.token_hex(3)
        results: list[Result] = []
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.processes) as pool:
            # Import the routers in every worker first, so all start each run together.
            pool.starmap(_warm, [(routers,)] * args.processes)
            for w in workloads:
                for r in routers:
                    base = Spec(
                        url=url,
                        name=f"sim-{tag}-{w}-{r}",
                        sim_prefix=f"rrsim:{{{tag}-{w}-{r}}}:",
                        router=r,
                        router_options={},
                        replicas=args.replicas,
                        workload=w,
                        seed=args.seed,
                        jobs=args.jobs,
                        turns=args.turns,
                        processes=args.processes,
                        sessions=args.sessions,
                        cache_blocks=args.cache_blocks,
                        speed=args.speed,
                        start_at=0.0,
                    )
                    results.append(run_one(pool, base))
                    print(table(results[-1:]).splitlines()[-1], file=out, flush=True)
        bench = None
        if not args.no_bench and "prefix-cache" in routers:
            bench = acquire_benchmark(
                url, rounds=50 if args.quick else 2000, replicas=args.replicas
            )
    print("\n" + table(results) + "\n", file=out)
    for line in targets(results, bench, args.quick):
        print(line, file=out)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"results": [asdict(r) for r in results], "bench": bench, "skipped": missing},
                fh,
                indent=2,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="redis-router simulate")
    parser.add_argument("--redis", metavar="URL", help="Redis URL (default: $REDIS_URL, else a "
                        "private server)")  # fmt: skip
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
