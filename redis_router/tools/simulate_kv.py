"""`redis-router simulate --kv`: routing on the replicas' own KV-cache events, against the
approximate index, least-loaded and an oracle, under KV pressure and with many routing clients.

Why: the approximate prefix index remembers what it sent where and assumes the replica kept
it; once caches evict, it sends prompts to replicas that no longer hold them. The exact index
(``redis-router kv-events``) knows what each engine holds. This measures what that is worth,
and whether many uncoordinated routing clients sharing one index route as well as one.

Model. One process, virtual time paced against the wall clock (at most ``speed`` virtual
seconds per wall second; the router options read on Redis's clock, ``index_ttl`` and
``kv_event_lag``, are passed divided by ``speed``). Each replica has an LRU KV cache
of ``cache_blocks`` blocks of BLOCK tokens, keyed by chained block hashes as in vLLM; a
request's prompt blocks enter it when the request is admitted (a later request on the same
replica finds them), its output blocks when it ends; evicting frees the tail of a prompt
before its head, as vLLM's free queue does. Every change is an event: ``BlockStored`` (engine
hashes, parent, token ids) and ``BlockRemoved``, published by the replica in batches every
PUBLISH_EVERY and applied by the index's own script (:class:`~redis_router.kv_events.KVIndex`,
``kv_index_apply.lua``), so the exact index lags the caches by up to one batch. A replica
serves its requests at once, sharing CAPACITY work units per second, each at most PER_REQUEST
(decode speed): a request costs one unit per output token and PREFILL_COST per prompt token
not found in the cache.

Routers: ``least-loaded`` (the default balancer), ``approximate`` (prefix_cache, default
options), ``exact`` (prefix_cache with ``kv_block_size`` = BLOCK: the exact index for replicas
whose stream is exact, which every replica's is here), ``oracle`` (in Python: prefix_cache's
rule, the same thresholds and ``min_match``, on the true cache contents at the moment of
routing; no Redis). ``clients`` balancer instances of one name route (sessions spread over
them; a GRPO group stays with one, as verl's workers receive them); calls are serialized in
virtual time, so what differs between 1 and 64 clients is only that 64 instances, each with
its own connection and random tie-break, share the index.

Workloads: ``multi-turn`` (agent sessions of 4 turns, sticky, a 256-token system prompt shared
by all, tool calls of 1-3 s between turns), ``grpo`` (768-1535-token prompts sampled n = 8
times at once under 8 request ids), ``system`` (24 system prompts of 1,536 tokens, popularity
1/rank, each request adding a 128-token question). ``Params.sessions`` closed-loop sessions
keep the pool busy (the full run: 192, 24 requests in flight per replica, whose 512-block cache
is far smaller than what they use: KV pressure).

Columns: token hit rate = cached prompt tokens / prompt tokens; max/mean in-flight =
time-weighted mean, while at least BUSY of the sessions are in flight (as ``simulate``
samples it), of the busiest replica's in-flight count over the mean. Rows with tie-breaks 1
and 2 rerun approximate and exact with one client drawing other tie-break streams: the noise
floor the client counts are judged against. ``--repeats N`` makes each row the mean of N runs.
The run ends with the acquire cost of exact routing (:func:`acquire_cost`).
"""

from __future__ import annotations

import hashlib
import heapq
import random
import secrets
import statistics
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import redis

from ..balancer import RedisLoadBalancer
from ..kv_events import BlockRemoved, BlockStored, KVIndex

BLOCK = 16  # tokens per engine KV block (vLLM's default)
CAPACITY = 400.0  # work units per virtual second a replica shares among its requests
PER_REQUEST = 40.0  # work units per virtual second one request can use (decode speed)
PREFILL_COST = 0.02  # work units per prompt token not found in the cache
PUBLISH_EVERY = 0.05  # virtual seconds between a replica's event batches
REPLICAS = 8
GROUP = 8
VOCAB = 32_000
ROUTERS = ("least-loaded", "approximate", "exact", "oracle")
WORKLOADS = ("multi-turn", "grpo", "system")
CLIENTS = (1, 8, 64)
TIES = (1, 2)  # other tie-break streams run with one client, to show the noise floor
BUSY = 0.75  # balance is sampled while at least this share of the sessions is in flight


@dataclass(frozen=True)
class Params:
    """One run's size. ``full()`` is the documented run; ``quick()`` takes seconds."""

    sessions: int  # closed-loop sessions in flight
    jobs: int  # requests a run (multi-turn: jobs / 4 sessions of 4 turns)
    cache_blocks: int  # KV blocks per replica
    speed: float  # virtual seconds per wall second

    @staticmethod
    def full() -> Params:
        return Params(sessions=192, jobs=3072, cache_blocks=512, speed=40.0)

    @staticmethod
    def quick() -> Params:
        return Params(sessions=32, jobs=96, cache_blocks=256, speed=200.0)


@dataclass
class Row:
    workload: str
    router: str
    clients: int
    tie: int  # which set of tie-break streams the clients draw (0: the main rows)
    requests: int
    hit_rate: float
    balance: float
    events: int


@dataclass
class Turn:
    rid: str
    prompt: list[int]
    output: int  # output tokens


@dataclass
class Job:
    """A session (its turns, in order) and the client that routes it."""

    turns: list[Turn]
    client: int
    context: list[int] = field(default_factory=list)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def jobs(workload: str, seed: int, count: int, clients: int) -> list[Job]:
    """A run's sessions (about ``count`` requests) in start order; deterministic in
    (workload, seed)."""
    rng = random.Random(f"kv:{workload}:{seed}")
    out: list[Job] = []
    if workload == "multi-turn":
        system = _tokens(random.Random(f"kv-sys:{seed}"), 256)
        for k in range(count // 4):
            task = system + _tokens(rng, 512)
            turns = [Turn(f"agent-{k}", task, 128)] + [
                Turn(f"agent-{k}", _tokens(rng, 256), 128) for _ in range(3)
            ]
            out.append(Job(turns, k % clients))
    elif workload == "grpo":
        for g in range(count // GROUP):
            prompt = _tokens(rng, rng.randrange(768, 1536))
            for s in range(GROUP):
                out.append(Job([Turn(f"grpo-{g}-{s}", prompt, 256)], g % clients))
    else:
        systems = [_tokens(random.Random(f"kv-sys{k}:{seed}"), 1536) for k in range(24)]
        weights = [1 / (k + 1) for k in range(24)]
        for k in range(count):
            system = rng.choices(systems, weights)[0]
            out.append(Job([Turn(f"sys-{k}", system + _tokens(rng, 128), 128)], k % clients))
    return out


def chain(tokens: Sequence[int], upto: int) -> list[int]:
    """The engine's hashes of the first ``upto`` full blocks (chained, 63-bit ints)."""
    width, parent, out = 4 * BLOCK, b"", []
    raw = array("I", tokens[: upto * BLOCK]).tobytes()
    for j in range(upto):
        parent = hashlib.blake2b(parent + raw[j * width : (j + 1) * width], digest_size=8).digest()
        out.append(int.from_bytes(parent, "big") >> 1)
    return out


class Replica:
    """A block-level LRU KV cache that reports every change as events."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # engine hash, oldest first
        self.pending: list[Any] = []  # events not published yet
        self.seq = 0

    def cached(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` in the cache."""
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += 1
        return n

    def store(self, tokens: Sequence[int], hashes: Sequence[int]) -> None:
        """Blocks ``hashes`` (of ``tokens``) are now cached, the head most recently used."""
        have = self.cached(hashes)
        new = list(hashes[have:])
        if new:
            parent = hashes[have - 1] if have else None
            self.pending.append(
                BlockStored(new, parent, tokens[have * BLOCK : len(hashes) * BLOCK], BLOCK)
            )
        for h in reversed(hashes):  # the tail is evicted first
            self.lru[h] = None
            self.lru.move_to_end(h)
        gone = []
        while len(self.lru) > self.capacity:
            gone.append(self.lru.popitem(last=False)[0])
        if gone:
            self.pending.append(BlockRemoved(gone))


def _servers() -> dict[str, Any]:
    return {f"r{i}": {"kv_events": f"tcp://sim-r{i}:5557"} for i in range(REPLICAS)}


def _routers(
    url: str, name: str, router: str, clients: int, seed: int, tie: int, p: Params
) -> list[Any]:
    """``clients`` balancer instances of one name (none for the oracle), each with its own
    seeded tie-break."""
    if router == "oracle":
        return []
    from ..plugins.prefix_cache import PrefixCacheRouter

    out: list[Any] = []
    for k in range(clients):
        rng = random.Random(f"{seed}:{tie}:{k}")
        if router == "least-loaded":
            out.append(RedisLoadBalancer(_servers(), redis=url, name=name, rng=rng))
            continue
        opts: dict[str, Any] = {"index_ttl": 600 / p.speed}
        if router == "exact":
            opts |= {"kv_block_size": BLOCK, "kv_event_lag": 2 / p.speed}
        out.append(PrefixCacheRouter(_servers(), redis=url, name=name, rng=rng, **opts))
    return out


def _oracle(
    prompt: list[int], hashes: list[int], replicas: dict[str, Replica], load: dict[str, int],
    rng: random.Random,
) -> str:  # fmt: skip
    """prefix_cache's rule on the true caches: the replica caching the longest prefix (at
    least min_match = 0.5 of the prompt), least loaded first, unless the pool is imbalanced
    (max - min > 4 and max > 1.2 min)."""
    lo, hi = min(load.values()), max(load.values())
    best: list[str] = []
    if not (hi - lo > 4 and hi > 1.2 * lo):
        held = {sid: r.cached(hashes) for sid, r in replicas.items()}
        top = max(held.values())
        if top * BLOCK >= 0.5 * len(prompt) and top > 0:
            best = [sid for sid, n in held.items() if n == top]
    if not best:
        best = list(load)
    least = min(load[s] for s in best)
    return rng.choice(sorted(s for s in best if load[s] == least))


def run(
    url: str, workload: str, router: str, clients: int, seed: int, p: Params, tie: int = 0
) -> Row:
    """One (workload, router, clients) in virtual time; every key it made is deleted."""
    name = f"kvsim-{secrets.token_hex(3)}"
    lbs = _routers(url, name, router, clients, seed, tie, p)
    client = redis.Redis.from_url(url)
    index = KVIndex(client, name, stale=max(10.0, 30 / p.speed))
    replicas = {sid: Replica(p.cache_blocks) for sid in _servers()}
    load = {sid: 0 for sid in replicas}
    rng = random.Random(seed)
    todo = jobs(workload, seed, p.jobs, clients)
    publish = router == "exact"
    if publish:  # every stream starts exact: an empty first batch
        for sid, rep in replicas.items():
            index.apply(sid, 0, 1, 0, 0.0, [])
            rep.seq = 1
    # Units start together: a session, or a GRPO group's 8 samples.
    width = GROUP if workload == "grpo" else 1
    units = [list(range(u, min(u + width, len(todo)))) for u in range(0, len(todo), width)]
    left = [len(u) for u in units]
    # (virtual time, order, payload): a turn (job, turn index) is ready
    events: list[tuple[float, int, Any]] = []
    order = 0
    started = 0

    def start_unit(at: float) -> None:
        nonlocal order, started
        for j in units[started]:
            heapq.heappush(events, (at, order, (j, 0)))
            order += 1
        started += 1

    for _ in range(min(max(1, p.sessions // width), len(units))):
        start_unit(rng.uniform(0, 1))
    running: dict[int, list[Any]] = {}  # request -> [replica, work left, job, turn]
    pinned: dict[str, str] = {}  # the oracle's sticky sessions
    now, wall0, next_publish = 0.0, time.monotonic(), PUBLISH_EVERY
    prompt_tokens = cached_tokens = requests = published = 0
    busy_time = busy_weighted = 0.0
    req_ids = 0
    busy_at = max(REPLICAS, BUSY * min(p.sessions // width * width, len(todo)))
    try:
        while events or running:
            rates = {sid: min(PER_REQUEST, CAPACITY / n) if n else 0.0 for sid, n in load.items()}
            t_done = min((now + w / rates[r] for r, w, _, _ in running.values()), default=None)
            t_next = min(t for t in (t_done, events[0][0] if events else None) if t is not None)
            if publish and t_next >= next_publish:
                t_next = next_publish
            dt = t_next - now
            total = sum(load.values())
            if total >= busy_at and dt > 0:
                busy_time += dt
                busy_weighted += dt * max(load.values()) / (total / REPLICAS)
            for job in running.values():
                job[1] -= dt * rates[job[0]]
            now = t_next
            ahead = wall0 + now / p.speed - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            if publish and now >= next_publish:
                published += _publish(index, replicas, now)
                next_publish = now + PUBLISH_EVERY
            for k in [k for k, job in running.items() if job[1] <= 1e-9]:
                sid, _, j, t = running.pop(k)
                job = todo[j]
                turn = job.turns[t]
                load[sid] -= 1
                full = job.context
                replicas[sid].store(full, chain(full, len(full) // BLOCK))
                if lbs:
                    lbs[job.client].release_server(sid, turn.rid)
                if t + 1 < len(job.turns):
                    heapq.heappush(events, (now + rng.uniform(1, 3), order, (j, t + 1)))
                    order += 1
                else:
                    left[j // width] -= 1
                    if left[j // width] == 0 and started < len(units):
                        start_unit(now + rng.uniform(0, 0.5))
            while events and events[0][0] <= now:
                _, _, (j, t) = heapq.heappop(events)
                job = todo[j]
                turn = job.turns[t]
                prompt = turn.prompt if t == 0 else job.context + turn.prompt
                hashes = chain(prompt, len(prompt) // BLOCK)
                if lbs:
                    sid, _ = lbs[job.client].acquire_server(turn.rid, prompt_ids=prompt)
                elif t > 0:
                    sid = pinned[turn.rid]
                else:
                    sid = pinned[turn.rid] = _oracle(prompt, hashes, replicas, load, rng)
                rep = replicas[sid]
                hit = rep.cached(hashes) * BLOCK
                rep.store(prompt, hashes)
                prompt_tokens += len(prompt)
                cached_tokens += hit
                requests += 1
                out_rng = random.Random(f"{turn.rid}:{t}")
                job.context = prompt + _tokens(out_rng, turn.output)
                load[sid] += 1
                work = turn.output + PREFILL_COST * (len(prompt) - hit)
                running[req_ids] = [sid, work, j, t]
                req_ids += 1
    finally:
        for lb in lbs[1:]:  # closed first: no heartbeat of theirs finds the keys gone
            lb.close()
        if lbs:
            lbs[0].destroy()
            lbs[0].close()
        keys = list(client.scan_iter(match=f"rr:{{{name}}}:*"))
        if keys:
            client.delete(*keys)
        client.close()
    return Row(
        workload=workload,
        router=router,
        clients=clients,
        tie=tie,
        requests=requests,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        balance=busy_weighted / busy_time if busy_time else float("nan"),
        events=published,
    )


def _publish(index: KVIndex, replicas: dict[str, Replica], now: float) -> int:
    """Each replica's pending events as one batch through the index's own script."""
    n = 0
    for sid, rep in replicas.items():
        if not rep.pending:
            continue
        got = index.apply(sid, 0, 1, rep.seq, now, rep.pending)
        if got.outcome != "ok":
            raise RuntimeError(f"the index refused {sid}'s batch {rep.seq}: {got}")
        n += len(rep.pending)
        rep.seq += 1
        rep.pending = []
    index.heartbeat([(sid, 0, 1, "1") for sid in replicas])
    return n


def run_all(
    url: str, seed: int = 1, quick: bool = False, clients: Sequence[int] = CLIENTS,
    workloads: Sequence[str] = WORKLOADS, routers: Sequence[str] = ROUTERS,
    out: TextIO | None = None, repeats: int = 1,
) -> list[Row]:  # fmt: skip
    """Every (workload, router, clients); the oracle routes without Redis, so once. Then the
    noise floor: approximate and exact with one client drawing TIES other sets of tie-break
    streams (what differs between 1 and 64 clients is which streams they draw). Each row is
    the mean of ``repeats`` runs, set t drawing streams t * repeats ... (t + 1) * repeats - 1."""
    p = Params.quick() if quick else Params.full()
    rows = []
    for w in workloads:
        runs = [(r, c, 0) for r in routers for c in (clients if r != "oracle" else clients[:1])]
        runs += [(r, 1, t) for r in routers if r in ("approximate", "exact") for t in TIES]
        for r, c, t in runs:
            reps = 1 if r == "oracle" else repeats  # the oracle breaks ties with the sim's rng
            got = [run(url, w, r, c, seed, p, t * reps + k) for k in range(reps)]
            rows.append(_mean(got, t))
            if out:
                print(table(rows[-1:]).splitlines()[-1], file=out, flush=True)
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| workload | router | clients | tie-breaks | token hit rate | max/mean in-flight "
        "| requests | events |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        c = "-" if r.router == "oracle" else str(r.clients)
        lines.append(
            f"| {r.workload} | {r.router} | {c} | {r.tie} | {r.hit_rate:.1%} "
            f"| {r.balance:.2f} | {r.requests} | {r.events:,} |"
        )
    return "\n".join(lines)


def _mean(rows: Sequence[Row], tie: int) -> Row:
    """The mean of runs that differ only in their tie-breaks, as one row of set ``tie``."""
    n = len(rows)
    return Row(
        workload=rows[0].workload,
        router=rows[0].router,
        clients=rows[0].clients,
        tie=tie,
        requests=sum(r.requests for r in rows) // n,
        hit_rate=sum(r.hit_rate for r in rows) / n,
        balance=sum(r.balance for r in rows) / n,
        events=sum(r.events for r in rows) // n,
    )


def _spread(rows: Sequence[Row]) -> float:
    """Points between the highest and the lowest hit rate of ``rows``."""
    return 100 * (max(r.hit_rate for r in rows) - min(r.hit_rate for r in rows))


def targets(rows: Sequence[Row]) -> list[str]:
    """The targets, per workload, against this run's figures (one client, the main
    tie-breaks, unless said)."""
    lines = []
    for w in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == w]
        main = {(r.router, r.clients): r for r in mine if r.tie == 0}
        ex, ap = main.get(("exact", 1)), main.get(("approximate", 1))
        orc = next((r for r in mine if r.router == "oracle"), None)
        if ex and ap:
            ratio = ex.hit_rate / ap.hit_rate if ap.hit_rate else float("inf")
            lines.append(
                f"- {w}: exact {ex.hit_rate:.1%} vs approximate {ap.hit_rate:.1%}: "
                f"{ratio:.2f}x (target >= 1.3x): {'met' if ratio >= 1.3 else 'NOT met'}"
            )
        if ex and orc:
            gap = 1 - ex.hit_rate / orc.hit_rate if orc.hit_rate else 0.0
            where = f"{gap:.1%} below" if gap >= 0 else f"{-gap:.1%} above"
            lines.append(
                f"- {w}: exact {ex.hit_rate:.1%} vs oracle {orc.hit_rate:.1%}: {where} "
                f"(target <= 5% below): {'met' if gap <= 0.05 else 'NOT met'}"
            )
        for k in ("approximate", "exact"):
            by_clients = [r for (kk, _), r in main.items() if kk == k]
            by_ties = [r for r in mine if r.router == k and r.clients == 1]
            if len(by_clients) > 1:
                spread = _spread(by_clients)
                floor = f"; {_spread(by_ties):.1f} between 1-client runs with other tie-breaks"
                lines.append(
                    f"- {w}: {k} hit rate from {min(r.clients for r in by_clients)} to "
                    f"{max(r.clients for r in by_clients)} clients varies {spread:.1f} points "
                    f"(target <= 2): {'met' if spread <= 2 else 'NOT met'}"
                    + (floor if len(by_ties) > 1 else "")
                )
        worst = max((r.balance for r in mine), default=float("nan"))
        lines.append(
            f"- {w}: max/mean in-flight at worst {worst:.2f} (target <= 1.25): "
            f"{'met' if worst <= 1.25 else 'NOT met'}"
        )
    return lines


def acquire_cost(url: str, *, rounds: int = 1000, tokens: int = 4096) -> dict[str, float]:
    """Median acquire time (µs, the release after it untimed) of a new session with a
    ``tokens``-token prompt, interleaved in a shuffled order each round: the default router;
    prefix_cache with exact routing off (a never-seen prompt, a cached one); on, with no
    replica exact (never seen: what exact routing costs where no stream is healthy); on, with
    every replica exact and one holding the prompt. Each with its ratio to the default. A
    figure for the report, not a test."""
    from ..plugins.prefix_cache import PrefixCacheRouter

    tag = secrets.token_hex(3)
    rng = random.Random(5)
    prompt = _tokens(rng, tokens)
    kinds = {
        "default": RedisLoadBalancer(_servers(), redis=url, name=f"kvc-{tag}-d"),
        "exact off, never seen": PrefixCacheRouter(_servers(), redis=url, name=f"kvc-{tag}-a"),
        "exact off, cached": PrefixCacheRouter(_servers(), redis=url, name=f"kvc-{tag}-c"),
        "exact on, none exact, never seen": PrefixCacheRouter(
            _servers(), redis=url, name=f"kvc-{tag}-n", kv_block_size=BLOCK
        ),
        "exact on, all exact, cached": PrefixCacheRouter(
            _servers(), redis=url, name=f"kvc-{tag}-e", kv_block_size=BLOCK
        ),
    }
    client = redis.Redis.from_url(url)
    index = KVIndex(client, f"kvc-{tag}-e", stale=3600)
    for sid in _servers():
        index.apply(sid, 0, 1, 0, 0.0, [])
    held = BlockStored(chain(prompt, tokens // BLOCK), None, prompt, BLOCK)
    index.apply("r3", 0, 1, 1, 1.0, [held])
    times: dict[str, list[float]] = {k: [] for k in kinds}
    clock = time.perf_counter
    try:
        for i in range(rounds):
            order = list(kinds.items())
            rng.shuffle(order)
            for key, lb in order:
                rid = f"c{i}"
                fields: dict[str, Any] = {"prompt_ids": prompt}
                if key == "default":
                    fields = {}
                elif key.endswith("never seen"):  # a first token no other prompt has
                    fields = {"prompt_ids": [VOCAB + i, *prompt[1:]]}
                t0 = clock()
                sid, _ = lb.acquire_server(rid, **fields)
                times[key].append(clock() - t0)
                lb.release_server(sid, rid)
    finally:
        for lb in kinds.values():
            lb.destroy()
            lb.close()
        for key in client.scan_iter(match=f"rr:{{kvc-{tag}-*"):
            client.delete(key)
        client.close()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {**med, **{f"{k} ratio": v / med["default"] for k, v in med.items() if k != "default"}}


def main(url: str, seed: int, quick: bool, out: TextIO, repeats: int = 1) -> int:
    """Run every row, print the table and the targets (``redis-router simulate --kv``)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    p = Params.quick() if quick else Params.full()
    print(
        f"{REPLICAS} replicas, {p.cache_blocks} KV blocks of {BLOCK} tokens each, "
        f"{p.sessions} sessions in flight, {p.jobs} requests a run, virtual time x{p.speed:g}, "
        f"each row the mean of {repeats} run(s)",
        file=out,
    )
    rows = run_all(url, seed, quick, out=out, repeats=repeats)
    print("\n" + table(rows) + "\n", file=out)
    for line in targets(rows):
        print(line, file=out)
    cost = acquire_cost(url, rounds=30 if quick else 1000)
    print(
        f"- acquire, {4096}-token prompt, new session (medians): default {cost['default']:.0f} µs;"
        + "".join(
            f" {k} {cost[k]:.0f} µs ({cost[k + ' ratio']:.2f}x);"
            for k in cost
            if k != "default" and not k.endswith("ratio")
        ),
        file=out,
    )
    return 0
