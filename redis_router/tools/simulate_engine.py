"""`redis-router simulate --engine`: least loaded on lease counts alone against least loaded on
what the engines report, over a pool whose replicas differ.

Why: a lease count is exact for the requests routed here and blind to the rest. A pool where
one replica runs at half speed, one has half the KV memory and a fifth of the sessions reach
the replicas without the router is where engine-aware scoring (``engine_scoring``) must earn
its cost: shorter tails and an earlier end, at the same prefix-cache hit rate.

Model. One process, virtual time paced against the wall clock (at most ``speed`` virtual seconds
per wall second; the scoring ttl is passed divided by it, and at least a wall second). REPLICAS
replicas; each runs its admitted requests at once, sharing CAPACITY work units per second (each
at most PER_REQUEST), a request costing one unit per output token and PREFILL_COST per prompt
token not in its prefix cache (an LRU of ``cache_blocks`` blocks, as in ``simulate --kv``). A
request is admitted while its blocks (prompt and output) fit in the replica's KV memory
(``kv_blocks``), else it waits, first come first served: KV usage is the admitted requests'
blocks over ``kv_blocks``. Replica r0 runs at half speed; r1 has half the KV memory and half the
cache. Every REPORT_EVERY virtual seconds a reporter stores each replica's running and waiting
requests and KV usage with ``report_engine_load``, as ``redis-router load`` does from vLLM's
metrics.

Workload: agent sessions of 4 turns (a 768-token first prompt, 256 more tokens a turn, 128
output tokens, 1-3 s of tool time between turns), ``sessions`` of them in flight (the first
starting over RAMP seconds). BYPASS of the sessions are sent by another client straight to a
replica, which the router never hears of: all to OUTSIDE (workload ``one``, the default: an
evaluation job given one replica's address) or each to a replica of its own at random
(``spread``). Routers: ``count-only`` (the default balancer), ``engine-aware`` (the same with
``engine_scoring``: ttl 5 s, kv_weight 4, no KV ceiling), and both with an affinity margin
of MARGIN (``+margin``).

Columns (routed requests only, mean over seeds with the lowest and highest run): p99 and
median request latency (arrival to last token, virtual s), makespan (the virtual time the
last routed session ends), token hit rate, and the share of the routed requests sent to the
replica the bypassing sessions load.
"""

from __future__ import annotations

import heapq
import random
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..balancer import RedisLoadBalancer
from ..engine import EngineLoad
from ..scoring import EngineScoring
from .simulate_kv import BLOCK, Replica, _tokens, chain

REPLICAS = 8
CAPACITY = 400.0
PER_REQUEST = 40.0
PREFILL_COST = 0.02
REPORT_EVERY = 1.0  # virtual seconds between reports
RAMP = 8.0  # the first sessions start over this many virtual seconds
BYPASS = 0.2  # share of the sessions sent past the router ...
OUTSIDE = "r2"  # ... all to one replica (an evaluation job given its address: "one") or
WORKLOADS = ("one", "spread")  # each to a replica of its own, uniformly at random ("spread")
ROUTERS = ("count-only", "engine-aware", "count-only+margin", "engine-aware+margin")
MARGIN = 6  # the affinity margin of the +margin rows (in-flight requests; engine-aware: score)
SCORING: dict[str, Any] = {
    "ttl": 5.0,
    "kv_weight": 4.0,
    "kv_ceiling": None,
}  # ttl in virtual seconds
SEEDS = 4


@dataclass(frozen=True)
class Params:
    sessions: int  # sessions in flight
    jobs: int  # sessions a run
    kv_blocks: int  # KV memory per replica (blocks)
    cache_blocks: int  # prefix cache per replica (blocks)
    speed: float

    @staticmethod
    def full() -> Params:
        return Params(sessions=128, jobs=512, kv_blocks=1024, cache_blocks=2048, speed=20.0)

    @staticmethod
    def quick() -> Params:
        return Params(sessions=128, jobs=256, kv_blocks=1024, cache_blocks=2048, speed=40.0)


@dataclass
class Row:
    workload: str
    router: str
    seeds: int
    requests: int
    p99: float
    p50: float
    makespan: float
    hit_rate: float
    outside: float  # share of the routed requests sent to OUTSIDE (the replica bypass loads)
    p99_lo: float = float("nan")
    p99_hi: float = float("nan")
    span_lo: float = float("nan")
    span_hi: float = float("nan")


@dataclass
class Engine:
    """A replica as its engine sees it: admitted and waiting requests, KV memory in use."""

    speed: float
    kv_blocks: int
    cache: Replica
    used: int = 0
    running: dict[int, list[Any]] = field(default_factory=dict)  # request -> [work left, blocks]
    waiting: list[tuple[int, float, int]] = field(default_factory=list)  # request, work, blocks

    def rate(self) -> float:
        n = len(self.running)
        return min(PER_REQUEST, CAPACITY / n) * self.speed if n else 0.0

    def admit(self) -> None:
        while self.waiting and self.used + self.waiting[0][2] <= self.kv_blocks:
            req, work, blocks = self.waiting.pop(0)
            self.running[req] = [work, blocks]
            self.used += blocks

    def report(self) -> EngineLoad:
        return EngineLoad(
            len(self.running), len(self.waiting), min(1.0, self.used / self.kv_blocks)
        )


def _engines(p: Params) -> dict[str, Engine]:
    out = {}
    for k in range(REPLICAS):
        half_kv = k == 1
        out[f"r{k}"] = Engine(
            speed=0.5 if k == 0 else 1.0,
            kv_blocks=p.kv_blocks // 2 if half_kv else p.kv_blocks,
            cache=Replica(p.cache_blocks // 2 if half_kv else p.cache_blocks),
        )
    return out


def run(url: str, router: str, seed: int, p: Params, workload: str = "one") -> Row:
    """One run in virtual time; every key it made is deleted."""
    name = f"engsim-{secrets.token_hex(3)}"
    servers = {f"r{k}": None for k in range(REPLICAS)}
    scoring = None
    if router.startswith("engine-aware"):
        # The ttl is judged on Redis's clock: at least a wall second, so a run that falls
        # behind its pace (a busy machine) never finds its own reports stale.
        ttl = max(SCORING["ttl"] / p.speed, 1.0)
        scoring = EngineScoring(ttl, SCORING["kv_weight"], SCORING["kv_ceiling"])
    lb = RedisLoadBalancer(
        servers,
        redis=url,
        name=name,
        rng=random.Random(seed),
        engine_scoring=scoring,
        affinity_margin=MARGIN if router.endswith("+margin") else None,
    )
    engines = _engines(p)
    rng = random.Random(f"engsim:{seed}")
    side = random.Random(f"engsim-bypass:{seed}")
    sessions = []
    for k in range(p.jobs):
        first = _tokens(rng, 768)
        turns = [first] + [_tokens(rng, 256) for _ in range(3)]
        away = None
        if side.random() < BYPASS:
            away = OUTSIDE if workload == "one" else f"r{side.randrange(REPLICAS)}"

        sessions.append((f"s{k}", turns, away))
    context: dict[int, list[int]] = {}
    events: list[tuple[float, int, tuple[int, int]]] = []  # (at, order, (session, turn))
    order = started = 0

    def start(at: float) -> None:
        nonlocal order, started
        heapq.heappush(events, (at, order, (started, 0)))
        order, started = order + 1, started + 1

    for _ in range(min(p.sessions, p.jobs)):
        start(rng.uniform(0, RAMP))
    meta: dict[
        int, tuple[str, int, int, float, bool]
    ] = {}  # req -> replica, session, turn, t0, routed
    latencies: list[float] = []
    prompt_tokens = cached = to_outside = 0
    now, wall0, next_report, req_ids, makespan = 0.0, time.monotonic(), 0.0, 0, 0.0
    try:
        while events or any(e.running or e.waiting for e in engines.values()):
            rates = {sid: e.rate() for sid, e in engines.items()}
            t_done = min(
                (
                    now + job[0] / rates[sid]
                    for sid, e in engines.items()
                    for job in e.running.values()
                ),
                default=float("inf"),
            )
            t_next = min(t_done, events[0][0] if events else float("inf"), next_report)
            dt = t_next - now
            for sid, e in engines.items():
                for job in e.running.values():
                    job[0] -= dt * rates[sid]
            now = t_next
            ahead = wall0 + now / p.speed - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            if now >= next_report:
                if scoring is not None:
                    lb.report_engine_load({sid: e.report() for sid, e in engines.items()})
                next_report = now + REPORT_EVERY
            for sid, e in engines.items():
                done = [req for req, job in e.running.items() if job[0] <= 1e-9]
                for req in done:
                    e.used -= e.running.pop(req)[1]
                    _, s, t, t0, routed = meta.pop(req)
                    ctx = context[s]
                    e.cache.store(ctx, chain(ctx, len(ctx) // BLOCK))
                    e.cache.pending.clear()
                    if routed:
                        latencies.append(now - t0)
                        lb.release_server(sid, sessions[s][0])
                    if t + 1 < 4:
                        heapq.heappush(events, (now + rng.uniform(1, 3), order, (s, t + 1)))
                        order += 1
                    else:
                        if routed:
                            makespan = now
                        if started < p.jobs:
                            start(now + rng.uniform(0, 0.5))
                if done:
                    e.admit()
            while events and events[0][0] <= now:
                _, _, (s, t) = heapq.heappop(events)
                rid, turns, away = sessions[s]
                prompt = turns[0] if t == 0 else context[s] + turns[t]
                sid = away or lb.acquire_server(rid)[0]
                e = engines[sid]
                hashes = chain(prompt, len(prompt) // BLOCK)
                hit = e.cache.cached(hashes) * BLOCK
                e.cache.store(prompt, hashes)
                e.cache.pending.clear()
                if away is None:
                    prompt_tokens += len(prompt)
                    cached += hit
                    to_outside += sid == OUTSIDE
                context[s] = prompt + _tokens(random.Random(f"{rid}:{t}"), 128)
                blocks = -(-(len(prompt) + 128) // BLOCK)
                meta[req_ids] = (sid, s, t, now, away is None)
                e.waiting.append((req_ids, 128 + PREFILL_COST * (len(prompt) - hit), blocks))
                e.admit()
                req_ids += 1
    finally:
        lb.destroy()
        lb.close()
    lat = sorted(latencies)
    return Row(
        workload=workload,
        router=router,
        seeds=1,
        requests=len(lat),
        p99=lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        p50=statistics.median(lat) if lat else float("nan"),
        makespan=makespan,
        hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
        outside=to_outside / len(lat) if lat else 0.0,
    )


def _mean(rows: Sequence[Row]) -> Row:
    return Row(
        workload=rows[0].workload,
        router=rows[0].router,
        seeds=len(rows),
        requests=sum(r.requests for r in rows),
        p99=statistics.fmean(r.p99 for r in rows),
        p50=statistics.fmean(r.p50 for r in rows),
        makespan=statistics.fmean(r.makespan for r in rows),
        hit_rate=statistics.fmean(r.hit_rate for r in rows),
        outside=statistics.fmean(r.outside for r in rows),
        p99_lo=min(r.p99 for r in rows),
        p99_hi=max(r.p99 for r in rows),
        span_lo=min(r.makespan for r in rows),
        span_hi=max(r.makespan for r in rows),
    )


def run_all(
    url: str, seed: int = 1, quick: bool = False, seeds: int = SEEDS,
    routers: Sequence[str] = ROUTERS, out: TextIO | None = None,
    workloads: Sequence[str] = WORKLOADS[:1],
) -> list[Row]:  # fmt: skip
    """Each (workload, router) over seeds ``seed`` ... ``seed + seeds - 1``, the routers'
    runs interleaved."""
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {w!r}")
    p = Params.quick() if quick else Params.full()
    rows = []
    for w in workloads:
        got: dict[str, list[Row]] = {r: [] for r in routers}
        for k in range(seeds):
            for r in routers:
                got[r].append(run(url, r, seed + k, p, w))
        rows += [_mean(got[r]) for r in routers]
        if out:
            print(table(rows[-len(routers) :]), file=out, flush=True)
            for line in targets(rows[-len(routers) :]):
                print(line, file=out)
    return rows


def table(rows: Sequence[Row]) -> str:
    head = (
        f"{'bypass':<6} {'router':<20} {'seeds':>5} {'requests':>8} {'p99 latency (s)':>22} "
        f"{'p50 (s)':>8} {'makespan (s)':>22} {'hit rate':>8} {'to ' + OUTSIDE:>6}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.workload:<6} {r.router:<20} {r.seeds:>5} {r.requests:>8} "
            f"{r.p99:>6.1f} [{r.p99_lo:5.1f}-{r.p99_hi:5.1f}]      {r.p50:>8.1f} "
            f"{r.makespan:>6.1f} [{r.span_lo:5.1f}-{r.span_hi:5.1f}]      "
            f"{r.hit_rate:>7.1%} {r.outside:>6.1%}"
        )
    return "\n".join(lines)


def targets(rows: Sequence[Row]) -> list[str]:
    """The targets engine-aware scoring is held to against counts alone (each with the same
    affinity setting)."""
    by = {r.router: r for r in rows}
    out = []
    for suffix in ("", "+margin"):
        c, e = by.get("count-only" + suffix), by.get("engine-aware" + suffix)
        if c is None or e is None:
            continue
        p99_cut, span_cut = 1 - e.p99 / c.p99, 1 - e.makespan / c.makespan
        hit_gap = e.hit_rate - c.hit_rate
        met = p99_cut >= 0.2 and span_cut >= 0.1 and abs(hit_gap) <= 0.01
        out.append(
            f"engine-aware{suffix} vs count-only{suffix}: p99 latency {-p99_cut:+.0%} (target "
            f"<= -20%), makespan {-span_cut:+.0%} (<= -10%), hit rate {hit_gap * 100:+.1f} "
            f"points (within 1): {'met' if met else 'NOT met'}"
        )
    return out


def main(
    url: str, seed: int, quick: bool, out: TextIO, seeds: int = SEEDS,
    workloads: Sequence[str] = WORKLOADS[:1],
) -> int:  # fmt: skip
    print(
        f"simulate --engine: {REPLICAS} replicas (r0 half speed, r1 half KV memory), "
        f"{BYPASS:.0%} of sessions past the router (one: all to {OUTSIDE}; spread: each to "
        "a replica at random)",
        file=out,
    )
    run_all(url, seed, quick, seeds, out=out, workloads=workloads)
    return 0
