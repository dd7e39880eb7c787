"""`redis-router simulate --shards`: where a new session goes when one pool is split into K
shards, each an atomic balancer of its own over a share of the replicas.

Why: one balancer's state lives on one Redis core, which caps a pool near one core's pairs
per second. Split over K shards (K hash tags, K cores), each shard still routes exactly inside
(least loaded, sticky), but a new session must first pick a shard, from what its process
knows of the others. How well that choice balances the pool, and what it costs in calls,
decides how a sharded pool places sessions; this model compares the candidates on the same
workloads before one of them is built into the library.

Model. A placement model in virtual time, not the routers: 256 replicas (64 with --quick),
split evenly over K shards; DISPATCHERS processes, each sending its sessions' turns and
placing its new sessions one after another, DELAY from a placement's first read to its
acquire's reply, so placements in flight at once choose on the same picture. Inside a shard
every choice is the library's (exact least loaded over in-flight counts, a uniform random
tie-break, sticky turns on their replica, a GRPO group's samples on the replica of its
first). A request runs for a lognormal time (mean SERVICE s), independent of the load, so
the measure is the placement's alone; every scheme sees the same requests (one seed, one
workload). Placement of a new session (or a new GRPO group, by its group id):

- ``global``: no shards: least loaded over the whole pool (K = 1's exact answer).
- ``hash``: the shard its id hashes to; no read, and no record needed to find it again.
- ``p2``: two shards at random, both read (one read of two shards), the one whose
  least-loaded replica is lower (then the lower mean); ``p2-home``: the two being the id's
  hash shard (its home) and one at random.
- ``p2-stale``: as ``p2`` on what the process last heard from each shard (every script's
  reply would carry its shard's least and mean in-flight): no read, but stale.
- ``jiq``: join-idle-queue on the same heard summaries: a shard heard to have an idle
  replica, uniformly, else one at random.
- ``p2-guided``: the two shards best by what the process heard, both read, the better.
- ``best``: every shard read (K reads), the best.
- ``rr``: each process's own round robin over the shards, from a random start; ``rr-p2``:
  its next two in turn, read, the better.
- ``directory``: one key (one slot) every placement passes through, one atomic call: the
  shard with the fewest requests by its published in-flight total (each shard's keeper
  publishes it every PUBLISH s) plus the placements sent there since.

Workloads, in rollout steps (every session of a step starts at once, the next step when the
last one ends, as a synchronous RL trainer runs them): ``agent`` (multi-turn sessions: 2-5
turns, one session in five 16-30, a tool call of 0.5-2 s between turns) and ``grpo``
(prompts, each sampled GROUP times at once under one group id); and ``agent-async``: the
same sessions, each replaced by a new one as it ends (asynchronous rollouts).
``grpo-per-request`` places each sample by ``p2`` on its own (the group followed only inside
the shard it lands in): what not carrying the group to its shard costs.

Columns: balance is the time-weighted mean of max/mean in-flight over the replicas, after a
warm-up, while at least as many requests as replicas are in flight (an idle replica beside a
busy one counts against balance), and its ratio to ``global``'s in the same seed; hit = share
of the samples that land on a replica already serving one of their group's (the first of a
group cannot: the ceiling is (GROUP - 1) / GROUP); away = share of new sessions placed off
their hash shard (a process that did not place the session finds it through a record); calls
= reads or directory calls per placement beyond the acquire. Sticky turns reach their
replica by construction (the session's shard is kept: in its process's memory, or a record),
so stickiness is not a column. Each row: the mean over seeds, lowest and highest in brackets.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

DISPATCHERS = 16
SERVICE = 2.0  # mean seconds a request runs
SIGMA = 0.8  # lognormal shape of a request's time
GROUP = 8
SCHEMES = (
    "global",
    "hash",
    "p2",
    "p2-home",
    "p2-stale",
    "jiq",
    "p2-guided",
    "best",
    "rr",
    "rr-p2",
    "directory",
)
WORKLOADS = ("agent", "agent-async", "grpo")
SHARDS = (1, 2, 4, 8, 16)
PUBLISH = 0.1  # seconds between a shard's publications of its in-flight total (directory)
DELAY = 0.0005  # seconds from a placement's read to its acquire's reply (a round trip or two)
HEARING = frozenset({"p2-stale", "jiq", "p2-guided"})  # the schemes that choose on replies
CHOSEN = "directory"  # the placement the targets judge
BALANCE_TARGET = 1.05  # a sharded placement's balance over global's
HIT_POINTS = 1.0  # GRPO hit rate within this many points of K = 1's


@dataclass(frozen=True)
class Size:
    """A run's scale: replicas, concurrent agent sessions and GRPO prompts, virtual seconds,
    warm-up."""

    replicas: int
    sessions: int
    prompts: int
    seconds: float
    warmup: float

    @staticmethod
    def full() -> Size:
        return Size(replicas=256, sessions=1024, prompts=512, seconds=600.0, warmup=60.0)

    @staticmethod
    def quick() -> Size:
        return Size(replicas=64, sessions=128, prompts=64, seconds=400.0, warmup=20.0)


@dataclass
class Result:
    """One run's measures (the columns of the table)."""

    balance: float
    hit: float  # NaN for agent
    away: float
    calls: float  # reads or directory calls per placement, beyond the acquire


@dataclass
class Pool:
    """In-flight counts per replica, a shard's replicas, and the max kept as counts go."""

    replicas: int
    shards: int
    rng: random.Random
    load: list[int] = field(default_factory=list)
    hist: list[int] = field(default_factory=list)
    top: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        self.load, self.hist = [0] * self.replicas, [self.replicas]

    def members(self, shard: int) -> range:
        size = self.replicas // self.shards
        return range(shard * size, (shard + 1) * size)

    def shard_of(self, replica: int) -> int:
        return replica // (self.replicas // self.shards)

    def summary(self, shard: int) -> tuple[int, float]:
        """The shard's least in-flight count and mean: what its scripts' replies carry."""
        counts = [self.load[r] for r in self.members(shard)]
        return min(counts), sum(counts) / len(counts)

    def least_loaded(self, replicas: range) -> int:
        low = min(self.load[r] for r in replicas)
        return self.rng.choice([r for r in replicas if self.load[r] == low])

    def add(self, replica: int, d: int) -> None:
        c = self.load[replica]
        self.hist[c] -= 1
        c += d
        self.load[replica] = c
        if c == len(self.hist):
            self.hist.append(0)
        self.hist[c] += 1
        self.total += d
        if c > self.top:
            self.top = c
        while self.top > 0 and self.hist[self.top] == 0:
            self.top -= 1


def home(key: str, shards: int) -> int:
    """The shard an id hashes to (stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % shards


class Placement:
    """A scheme's choice of shard for a new session or group, and what it read to choose."""

    def __init__(self, scheme: str, pool: Pool, rng: random.Random) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
        self.scheme, self.pool, self.rng = scheme, pool, rng
        k = pool.shards
        # What each process last heard from each shard (least, mean), from its replies.
        self.heard = [[(0, 0.0)] * k for _ in range(DISPATCHERS)]
        self.placed = self.away = self.calls = 0
        # The directory (one key, one atomic script per placement): each shard's in-flight
        # total as last published, and the placements it sent there since.
        self.published, self.since, self.published_at = [0] * k, [0] * k, -1.0
        # Each process's next shard in its own round-robin order, from a random start.
        self.turn = [rng.randrange(k) for _ in range(DISPATCHERS)]

    def heard_from(self, process: int, shard: int) -> None:
        """A reply from ``shard`` to ``process``: what it tells of the shard (kept only by the
        schemes that choose on it)."""
        if self.scheme in HEARING:
            self.heard[process][shard] = self.pool.summary(shard)

    def choose(self, key: str, process: int, now: float = 0.0) -> int:
        """The shard a new session (or group) ``key`` of ``process`` goes to, decided now on
        what the scheme reads (-1: the whole pool, unsharded)."""
        pool, k = self.pool, self.pool.shards
        self.placed += 1
        if self.scheme == "global" or k == 1:
            return 0 if k == 1 else -1
        if self.scheme == "hash":
            shard = home(key, k)
        elif self.scheme in ("p2", "p2-home"):
            a = home(key, k) if self.scheme == "p2-home" else self.rng.randrange(k)
            b = self.rng.choice([s for s in range(k) if s != a])
            shard = self._read((a, b))
        elif self.scheme == "p2-stale":
            a, b = self.rng.sample(range(k), 2)
            view = self.heard[process]
            shard = min((a, b), key=lambda s: (*view[s], self.rng.random()))
        elif self.scheme == "p2-guided":  # the two best heard, read now
            view = self.heard[process]
            a, b = sorted(range(k), key=lambda s: (*view[s], self.rng.random()))[:2]
            shard = self._read((a, b))
        elif self.scheme == "best":  # every shard read now
            shard = self._read(range(k))
        elif self.scheme == "directory":
            if now - self.published_at >= PUBLISH:  # the shards' keepers publish their totals
                self.published = [sum(pool.load[r] for r in pool.members(s)) for s in range(k)]
                self.since, self.published_at = [0] * k, now
            self.calls += 1
            low = min(self.published[s] + self.since[s] for s in range(k))
            shard = self.rng.choice(
                [s for s in range(k) if self.published[s] + self.since[s] == low]
            )
            self.since[shard] += 1
        elif self.scheme == "rr":  # the process's next shard in turn
            shard = self.turn[process]
            self.turn[process] = (shard + 1) % k
        elif self.scheme == "rr-p2":  # the process's next two in turn, read now
            a = self.turn[process]
            b = (a + 1) % k
            shard = self._read((a, b))
            self.turn[process] = b
        else:  # jiq
            idle = [s for s, (low, _) in enumerate(self.heard[process]) if low == 0]
            shard = self.rng.choice(idle) if idle else self.rng.randrange(k)
        if shard != home(key, k):
            self.away += 1
        return shard

    def _read(self, shards: Sequence[int]) -> int:
        """Of ``shards``, all read now (one read of them before the acquire), the one whose
        least-loaded replica is lowest, then the lowest mean; ties at random."""
        self.calls += len(shards)
        return min(shards, key=lambda s: (*self.pool.summary(s), self.rng.random()))

    def land(self, shard: int, process: int) -> int:
        """The acquire on ``shard``: its least-loaded replica, exactly (the shard's script);
        its reply tells the process the shard's summary."""
        pool = self.pool
        chosen = pool.least_loaded(range(pool.replicas) if shard < 0 else pool.members(shard))
        if shard >= 0 and pool.shards > 1:
            self.heard_from(process, shard)
        return chosen


def _service(rng: random.Random) -> float:
    mu = math.log(SERVICE) - SIGMA * SIGMA / 2
    return rng.lognormvariate(mu, SIGMA)


def _turns(rng: random.Random) -> int:
    return rng.randint(16, 30) if rng.random() < 0.2 else rng.randint(2, 5)


def run(workload: str, shards: int, scheme: str, seed: int, size: Size) -> Result:
    """One run: ``workload`` over ``shards`` shards placed by ``scheme``, seeded."""
    if workload not in (*WORKLOADS, "grpo-per-request"):
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if isinstance(shards, bool) or shards < 1 or size.replicas % shards:
        raise ValueError(f"shards must divide {size.replicas} replicas, got {shards!r}")
    rng = random.Random(seed)
    pool = Pool(size.replicas, shards, random.Random(seed + 1))
    place = Placement(scheme, pool, random.Random(seed + 2))
    events: list[tuple[float, int, Callable[[float], None]]] = []
    seq = 0
    weighted = busy = 0.0
    last = 0.0
    hits = samples = 0
    # A process places its new sessions one after another, each a read (if its scheme reads)
    # and an acquire, DELAY apart: while one is in flight, others' placements see the pool as
    # it was (the herding of simultaneous choices).
    queues: list[deque[tuple[str, Callable[[int, float], None]]]] = [
        deque() for _ in range(DISPATCHERS)
    ]

    def at(t: float, fn: Callable[[float], None]) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, fn))

    def placed(key: str, process: int, t: float, then: Callable[[int, float], None]) -> None:
        queue = queues[process]
        queue.append((key, then))
        if len(queue) == 1:
            at(t, lambda t2: next_placement(process, t2))

    def next_placement(process: int, t: float) -> None:
        key, then = queues[process][0]
        shard = place.choose(key, process, t)

        def landed(t2: float) -> None:
            queues[process].popleft()
            then(place.land(shard, process), t2)
            if queues[process]:
                next_placement(process, t2)

        at(t + DELAY, landed)

    def start(replica: int, t: float, done: Callable[[float], None], process: int) -> None:
        pool.add(replica, 1)

        def end(t2: float) -> None:
            pool.add(replica, -1)
            if shards > 1:
                place.heard_from(process, pool.shard_of(replica))
            done(t2)

        at(t + _service(rng), end)

    def step(t: float) -> None:
        """A rollout step: every session (or prompt) starts, the next step when all end;
        asynchronous agent rollouts replace each session as it ends instead."""
        n = size.sessions if workload.startswith("agent") else size.prompts
        if workload == "agent-async":
            for j in range(n):

                def again(t2: float, process: int = j % DISPATCHERS) -> None:
                    session(t2, process, again)

                at(rng.uniform(0.0, 5.0), again)
            return
        left = [n]

        def ended(t2: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                step(t2)

        for j in range(n):
            (prompt if workload.startswith("grpo") else session)(t, j % DISPATCHERS, ended)

    def session(t: float, process: int, ended: Callable[[float], None]) -> None:
        turns = _turns(rng)

        def begin(replica: int, t2: float) -> None:
            def turn(t3: float, left: int) -> None:
                def done(t4: float) -> None:
                    if left > 1:
                        at(t4 + rng.uniform(0.5, 2.0), lambda t5: turn(t5, left - 1))
                    else:
                        ended(t4)

                start(replica, t3, done, process)

            turn(t2, turns)

        placed(f"s{rng.getrandbits(64):x}", process, t, begin)

    def prompt(t: float, process: int, ended: Callable[[float], None]) -> None:
        key = f"g{rng.getrandbits(64):x}"
        left = [GROUP]
        served: set[int] = set()

        def done(t2: float) -> None:
            left[0] -= 1
            if left[0] == 0:
                ended(t2)

        def sample(replica: int, t2: float) -> None:
            nonlocal hits, samples
            samples += 1
            hits += replica in served
            served.add(replica)
            start(replica, t2, done, process)

        if workload == "grpo":  # the group placed once, its samples where the first went

            def group(r: int, t2: float) -> None:
                for _ in range(GROUP):
                    sample(r, t2)

            placed(key, process, t, group)
            return
        for j in range(GROUP):  # each sample placed on its own, the group followed in-shard

            def follow(r: int, t2: float) -> None:
                shard = pool.shard_of(r)
                there = [x for x in served if pool.shard_of(x) == shard]
                if there:  # the shard's group affinity: where the group went there
                    r = there[0]
                sample(r, t2)

            placed(f"{key}-{j}", process, t, follow)

    at(0.0, step)
    while events:
        t, _, fn = heapq.heappop(events)
        if t > size.seconds:
            break
        if last >= size.warmup and pool.total >= size.replicas:
            span = t - last
            weighted += span * pool.top / (pool.total / size.replicas)
            busy += span
        last = t
        fn(t)
    return Result(
        balance=weighted / busy if busy else math.nan,
        hit=hits / samples if samples else math.nan,
        away=place.away / place.placed if place.placed else 0.0,
        calls=place.calls / place.placed if place.placed else 0.0,
    )


@dataclass(frozen=True)
class Row:
    workload: str
    shards: int
    scheme: str
    runs: tuple[Result, ...]
    ratios: tuple[float, ...]  # balance over global's, per seed


def rows(
    seed: int, seeds: int, size: Size, shards: Sequence[int], workloads: Sequence[str]
) -> list[Row]:
    out = []
    for workload in workloads:
        base = [run(workload, 1, "global", seed + s, size) for s in range(seeds)]
        for k in shards:
            schemes = ("p2",) if workload == "grpo-per-request" else SCHEMES
            for scheme in schemes:
                if (k == 1) != (scheme == "global") and workload != "grpo-per-request":
                    continue
                got = (
                    base
                    if k == 1
                    else [run(workload, k, scheme, seed + s, size) for s in range(seeds)]
                )
                ratios = tuple(g.balance / b.balance for g, b in zip(got, base, strict=True))
                out.append(Row(workload, k, scheme, tuple(got), ratios))
    return out


def _spread(values: Sequence[float], fmt: str) -> str:
    if any(math.isnan(v) for v in values):
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def table(found: Sequence[Row]) -> str:
    head = (
        f"{'workload':18s} {'K':>3s} {'scheme':9s} {'balance':>19s} {'x global':>19s} "
        f"{'hit %':>17s} {'away %':>7s} {'calls':>6s}"
    )
    lines = [head, "-" * len(head)]
    for row in found:
        r = row.runs
        lines.append(
            f"{row.workload:18s} {row.shards:3d} {row.scheme:9s} "
            f"{_spread([x.balance for x in r], '.3f'):>19s} {_spread(row.ratios, '.3f'):>19s} "
            f"{_spread([100 * x.hit for x in r], '.1f'):>17s} "
            f"{100 * sum(x.away for x in r) / len(r):7.1f} {sum(x.calls for x in r) / len(r):6.2f}"
        )
    return "\n".join(lines)


def targets(found: Sequence[Row], scheme: str) -> list[str]:
    """The targets a sharded placement is held to, for ``scheme``: balance within
    BALANCE_TARGET of global's at every K, seed and workload, and the GRPO hit rate within
    HIT_POINTS of K = 1's."""
    out = []
    mine = [r for r in found if r.scheme == scheme and r.workload in WORKLOADS]
    worst = max((max(r.ratios) for r in mine), default=math.nan)
    out.append(
        f"- {scheme}: balance at most {BALANCE_TARGET} x global's at every K, every seed: worst "
        f"{worst:.3f}: {'met' if worst <= BALANCE_TARGET else 'NOT met'}"
    )
    one = [r for r in found if r.workload == "grpo" and r.shards == 1]
    grpo = [r for r in mine if r.workload == "grpo"]
    if one and grpo:
        base = 100 * sum(x.hit for x in one[0].runs) / len(one[0].runs)
        gap = max(abs(100 * sum(x.hit for x in r.runs) / len(r.runs) - base) for r in grpo)
        out.append(
            f"- {scheme}: GRPO hit rate within {HIT_POINTS:g} point of K = 1's ({base:.1f} %): "
            f"largest gap {gap:.2f}: {'met' if gap <= HIT_POINTS else 'NOT met'}"
        )
    return out


def main(
    seed: int, quick: bool, out: TextIO, seeds: int = 4, shards: Sequence[int] = SHARDS
) -> int:
    """Every workload, K and scheme; the table, then the targets of the chosen scheme."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an int >= 1, got {seeds!r}")
    size = Size.quick() if quick else Size.full()
    bad = [k for k in shards if isinstance(k, bool) or k < 1 or size.replicas % k]
    if bad:
        raise ValueError(f"--shards must divide {size.replicas} replicas, got {bad}")
    print(
        f"placement model: {size.replicas} replicas, {DISPATCHERS} processes, rollout steps of "
        f"{size.sessions} agent sessions or {size.prompts} GRPO prompts of {GROUP} at a time, "
        f"{size.seconds:g} s virtual; each row the mean of seeds {seed}-{seed + seeds - 1} "
        "(lowest-highest)",
        file=out,
    )
    found = rows(seed, seeds, size, sorted(set(shards)), (*WORKLOADS, "grpo-per-request"))
    print(table(found) + "\n", file=out)
    for line in targets(found, CHOSEN):
        print(line, file=out)
    return 0
