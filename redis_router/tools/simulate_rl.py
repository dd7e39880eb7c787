"""`redis-router simulate --rl`: the trade between cache locality and balance in RL rollouts.

Why: keeping a session on its replica saves re-prefilling its context; moving it evens the
load. verl PR #6533 moves every sticky session while the pool is imbalanced (a global gate),
verl PR #7435 moves a session only when its own replica is more than a margin above the least
loaded one. This measures both, and group affinity, with the real balancer.

Model. Virtual time (no sleeps), one process, the real balancer on a private or given Redis,
with a seeded tie-break, so a run is deterministic. A replica serves its requests at once,
sharing CAPACITY work units per second, each at most PER_REQUEST per second (decode speed),
so a replica slows down past CAPACITY / PER_REQUEST requests, and further while the contexts
it serves exceed its KV memory (KV_TOKENS: preemption and recompute, as in vllm-project/router
#179 where one engine received every request). A request costs one unit per
output token and PREFILL_COST per prompt token its replica does not hold. A replica holds the
last context of each session it served and each GRPO prompt it prefilled (LRU, CACHE_TOKENS).
A turn on another replica than the session's previous one re-prefills the session's whole
context: those tokens are counted as re-prefilled.

Workloads. ``agent``: long-context multi-turn sessions with a long tail (most run 2-5 turns,
one in five 16-30; each turn adds 1-4k tokens of observations, so the long ones reach
50-100k), started together, a tool call of 0.5-2 s between turns. ``grpo``: prompts sampled
GROUP = 8 times (request ids "prompt<k>-s<j>", group_by "-"), two turns each.

Remaining work (least_tokens' ``remaining_work``): the harness passes each turn's
``expected_output_tokens`` at acquire and, every RENEW_EVERY seconds, renews each running
lease with what is left (``policy.weigh(prompt, expected - made)``, never below 0). What it
expects is one of ESTIMATES: the turn's true output (an oracle), that times a factor drawn
from 0.5-2 (a noisy estimate), or the session's whole remaining output, this turn's and its
later turns' (a harness that knows how long a task runs, as for engine priority).
``prefill_weight`` PREFILL_COST weighs a prompt token as the model's engines cost it.

Columns: step time (makespan: the last session's end) and its ratio to the work bound (the
work the row's requests cost, prefill included, over the pool's capacity, REPLICAS *
CAPACITY: the step time of a pool that never idles a unit; turns wait for each other and
for tool calls, so 1.0 is out of reach), re-prefilled tokens, token hit rate
(prompt tokens held by the replica / prompt tokens), max/mean in-flight per replica in the
tail (time-weighted, after half the sessions finished, while at least as many requests as
replicas are in flight: an idle replica beside a busy one counts against balance). Every row
is the mean over ``seeds`` seeds (workload and tie-breaks), with the lowest and the highest
run in brackets. The targets' lines also give, for the rows with every option on, the
chain floor: the longest session alone (its start, its tool calls, each turn at decode speed
with nothing to prefill) over the work bound, below which no placement can end the step.
"""

from __future__ import annotations

import heapq
import itertools
import random
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..balancer import RedisLoadBalancer

CAPACITY = 80.0  # work units per second a replica shares among its requests
PER_REQUEST = 40.0  # work units per second one request can use (decode speed)
PREFILL_COST = 0.01  # work units per prompt token not held by the replica
KV_TOKENS = 200_000  # KV memory of a replica: past it, its requests slow down in proportion
CACHE_TOKENS = 600_000  # tokens of context a replica keeps for later turns (LRU)
GROUP = 8
REPLICAS = 8

# (row, router, options). The gate is #6533's dual threshold (sglang's cache-aware rule): the
# pool is imbalanced while max - min > abs and max > rel * min (in-flight counts); a sticky
# turn is then re-pinned to the least loaded replica.
ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("sticky only", "least-loaded", {}),
    ("global gate 32/1.0001", "gate", {"abs": 32, "rel": 1.0001}),
    ("global gate 2/1.5", "gate", {"abs": 2, "rel": 1.5}),
    ("margin 1", "least-loaded", {"affinity_margin": 1}),
    ("margin 2", "least-loaded", {"affinity_margin": 2}),
    ("margin 4", "least-loaded", {"affinity_margin": 4}),
    ("groups, cap 4", "least-loaded", {"group_by": "-", "group_cap": 4}),
    ("groups, cap 8", "least-loaded", {"group_by": "-", "group_cap": 8}),
    ("prefix-cache", "prefix-cache", {}),
    # prefix_cache places a GRPO group's samples together; a wide margin moves only the second
    # turns that would queue behind a hot spot.
    ("prefix-cache, margin 4", "prefix-cache", {"affinity_margin": 4}),
    # Each lease weighed by its prompt tokens (a long session's context is long) rather than
    # counted: what placing by a lease's own work gives.
    ("least-tokens, margin 1", "least-tokens", {"affinity_margin": 1}),
    # Remaining work (least_tokens' remaining_work, prefill_weight PREFILL_COST): a lease
    # weighs its prompt's prefill and the output expected of it (ESTIMATES), renewed with
    # progress every RENEW_EVERY seconds. The first row is its baseline: least_tokens, sticky.
    ("least-tokens, sticky only", "least-tokens", {}),
    (
        "least-tokens, remaining work (true output), margin 1",
        "least-tokens",
        {"affinity_margin": 1, "expect": "true"},
    ),
    (
        "least-tokens, remaining work (output x0.5-2), margin 1",
        "least-tokens",
        {"affinity_margin": 1, "expect": "noisy"},
    ),
    ("least-tokens, remaining work (session's output)", "least-tokens", {"expect": "session"}),
    (
        "least-tokens, remaining work (session's output), margin 1",
        "least-tokens",
        {"affinity_margin": 1, "expect": "session"},
    ),
    ("every option", "least-loaded", {"affinity_margin": 1, "group_by": "-", "group_cap": 4}),
    # The balance floor of routing at acquire time: every turn to the least loaded replica
    # unless its own is tied with it (margin 0), no groups.
    ("no affinity", "least-loaded", {"affinity_margin": 0}),
    # Not a router option: engines that schedule by request priority (vLLM's
    # --scheduling-policy priority and the request's "priority" field), the harness giving a
    # session it knows to be long (a task kind; LONG_TURNS here) the higher one. A replica's
    # capacity goes to those requests first, each at most at decode speed, then to the rest.
    (
        "margin 1, engines prioritise long sessions",
        "least-loaded",
        {"affinity_margin": 1, "engine_priority": True},
    ),
    # The same engines behind the rows that balance best without them: how far serving long
    # sessions first goes, and what hit rate a margin wide enough to keep the cache costs.
    (
        "least-tokens, margin 1, engines prioritise long sessions",
        "least-tokens",
        {"affinity_margin": 1, "engine_priority": True},
    ),
    (
        "least-tokens, margin 2, engines prioritise long sessions",
        "least-tokens",
        {"affinity_margin": 2, "engine_priority": True},
    ),
    (
        "least-tokens, remaining work (true output), margin 1, engines prioritise long sessions",
        "least-tokens",
        {"affinity_margin": 1, "expect": "true", "engine_priority": True},
    ),
    (
        "least-tokens, remaining work (session's output), engines prioritise long sessions",
        "least-tokens",
        {"expect": "session", "engine_priority": True},
    ),
)
# The harness's hint for "engine_priority": a session with at least this many turns is long.
LONG_TURNS = 16
# Remaining-work rows: how often (virtual seconds) the harness renews each running lease with
# what is left of it, and what it expects of a turn's output.
RENEW_EVERY = 2.0
ESTIMATES = ("true", "noisy", "session")


@dataclass
class Session:
    """One conversation: its turns' (new prompt tokens, output tokens), and what it holds."""

    rid: str
    prompt: str  # the prompt's cache key (a GRPO group shares it)
    turns: list[tuple[int, int]]
    start: float
    context: list[int] = field(default_factory=list)  # tokens so far (prefix-cache reads it)
    replica: str | None = None
    epoch: int = 0  # the gate re-pins by starting a new session id


def sessions(workload: str, seed: int, quick: bool) -> list[Session]:
    rng = random.Random(f"{workload}:{seed}")
    out: list[Session] = []
    if workload == "agent":
        for k in range(48 if quick else 96):
            n = rng.randint(16, 30) if rng.random() < 0.25 else rng.randint(2, 5)
            turns = [(rng.randint(2048, 4096), rng.randint(200, 600))]
            turns += [(rng.randint(1024, 4096), rng.randint(200, 600)) for _ in range(n - 1)]
            out.append(Session(f"agent{k}", f"agent{k}", turns, rng.uniform(0, 2)))
    else:
        for k in range(8 if quick else 16):
            first = (rng.randint(1024, 3072), 0)
            for j in range(GROUP):
                turns = [(first[0], rng.randint(300, 900)), (rng.randint(256, 1024), 300)]
                out.append(Session(f"prompt{k}-s{j}", f"prompt{k}", turns, rng.uniform(0, 1)))
    return out


@dataclass
class Row:
    row: str
    workload: str
    makespan: float
    reprefilled: int
    hit_rate: float
    tail_balance: float
    repins: int
    bound_ratio: float = float("nan")  # step time over the work bound (work / pool capacity)
    # The longest session's own chain (its start, its tool calls, each turn at decode speed
    # with nothing to prefill) over the work bound: no placement ends the step sooner.
    chain_ratio: float = float("nan")
    seeds: int = 1
    lo: Row | None = None  # per column, the lowest and the highest run (rows of several seeds)
    hi: Row | None = None


class _Replica:
    def __init__(self) -> None:
        self.held: OrderedDict[str, int] = OrderedDict()  # cache key -> tokens held
        self.size = 0

    def holds(self, key: str) -> int:
        n = self.held.get(key, 0)
        if n:
            self.held.move_to_end(key)
        return n

    def keep(self, key: str, tokens: int) -> None:
        self.size += tokens - self.held.pop(key, 0)
        self.held[key] = tokens
        while self.size > CACHE_TOKENS and self.held:
            self.size -= self.held.popitem(last=False)[1]


def run_row(url: str, workload: str, row: str, router: str, opts: dict[str, Any], seed: int,
            quick: bool) -> Row:  # fmt: skip
    """One (workload, row): every session to its end, in virtual time."""
    servers = {f"r{i}": None for i in range(REPLICAS)}
    name = f"rl-{secrets.token_hex(3)}"
    gate = opts if router == "gate" else None
    kw = {} if gate else {k: v for k, v in opts.items() if k not in ("engine_priority", "expect")}
    priority = bool(opts.get("engine_priority"))
    expect = opts.get("expect")  # remaining work: one of ESTIMATES, None = off
    if expect is not None:
        assert expect in ESTIMATES and router == "least-tokens", (row, expect)
        kw["remaining_work"] = True
        kw.setdefault("prefill_weight", PREFILL_COST)
    if router == "prefix-cache":
        from ..plugins.prefix_cache import PrefixCacheRouter

        lb: RedisLoadBalancer = PrefixCacheRouter(
            servers, redis=url, name=name, rng=random.Random(seed), **kw
        )
    elif router == "least-tokens":
        from ..plugins.least_tokens import LeastTokensRouter

        lb = LeastTokensRouter(servers, redis=url, name=name, rng=random.Random(seed), **kw)
    else:
        lb = RedisLoadBalancer(servers, redis=url, name=name, rng=random.Random(seed), **kw)
    wants_prompt = "prompt_ids" in lb.require_acquire_fields()
    weigh = getattr(lb.policy, "weigh", None)  # least_tokens: a lease's remaining weight
    replicas = {sid: _Replica() for sid in servers}
    todo = sessions(workload, seed, quick)
    # (time, order, session index, turn index): a turn becomes ready
    ready = [(s.start, k, k, 0) for k, s in enumerate(todo)]
    heapq.heapify(ready)
    running: dict[int, list[Any]] = {}  # session -> [replica, work left, turn]
    # remaining work: session -> (lease, prompt, its work at acquire, output expected)
    weighed: dict[int, tuple[Any, list[int], float, int]] = {}
    t_renew = RENEW_EVERY if expect is not None else None
    chain = [s.start + sum(out for _, out in s.turns) / PER_REQUEST for s in todo]
    order = len(todo)
    now, finished, tail_from = 0.0, 0, len(todo) // 2
    prompt_tokens = held_tokens = reprefilled = 0
    work_total = 0.0
    tail_time = tail_weighted = 0.0
    try:
        while ready or running:
            counts = {sid: 0 for sid in servers}
            for rep, _, _ in running.values():
                counts[rep] += 1
            kv = {sid: 0 for sid in servers}
            for k, (rep, _, _) in running.items():
                kv[rep] += len(todo[k].context)
            rate = _rates(running, todo, counts, kv, priority)
            t_done = min(
                (now + job[1] / rate[k] for k, job in running.items() if rate[k] > 0),
                default=None,
            )
            t_ready = ready[0][0] if ready else None
            t_next = min(t for t in (t_done, t_ready) if t is not None)
            if t_renew is not None and t_renew < t_next:
                t_next = t_renew
            dt = t_next - now
            total = sum(counts.values())
            if finished >= tail_from and total >= REPLICAS and dt > 0:
                tail_time += dt
                tail_weighted += dt * max(counts.values()) / (total / REPLICAS)
            for k, job in running.items():
                job[1] -= dt * rate[k]
            now = t_next
            if t_renew is not None and weigh is not None and now >= t_renew:
                t_renew = now + RENEW_EVERY
                for k, job in running.items():
                    if job[1] > 1e-9:
                        lease, prompt, work, expected = weighed[k]
                        out = todo[k].turns[job[2]][1]
                        made = round(out * (1 - job[1] / work)) if work else out
                        lease.renew(remaining=weigh(prompt, max(0, expected - made)))
            for k in [k for k, job in running.items() if job[1] <= 1e-9]:
                rep, _, turn = running.pop(k)
                weighed.pop(k, None)
                s = todo[k]
                lb.release_server(rep, f"{s.rid}#{s.epoch}" if s.epoch else s.rid)
                if turn + 1 < len(s.turns):
                    gap = _gap(seed, k, turn)
                    chain[k] += gap
                    heapq.heappush(ready, (now + gap, order, k, turn + 1))
                    order += 1
                else:
                    finished += 1
            while ready and ready[0][0] <= now:
                _, _, k, turn = heapq.heappop(ready)
                s = todo[k]
                new, out = s.turns[turn]
                if gate and s.replica is not None and _imbalanced(lb, gate):
                    s.epoch += 1  # a new id: placed on the least loaded, sticky from there
                rid = f"{s.rid}#{s.epoch}" if s.epoch else s.rid
                prompt = [*s.context, *_tokens(s.prompt if turn == 0 else rid, turn, new)]
                fields: dict[str, Any] = {"prompt_ids": prompt} if wants_prompt else {}
                if expect is not None:
                    fields["expected_output_tokens"] = expected = _expected(
                        expect, seed, k, turn, s.turns
                    )
                    lease = lb.acquire(rid, **fields)
                    rep = lease.server_id
                else:
                    rep, _ = lb.acquire_server(rid, **fields)
                cache = replicas[rep]
                key = s.prompt if workload == "grpo" and turn == 0 else s.rid
                held = min(cache.holds(key), len(prompt))
                if s.replica is not None and rep != s.replica:
                    reprefilled += len(s.context) - min(held, len(s.context))
                prompt_tokens += len(prompt)
                held_tokens += held
                work = out + PREFILL_COST * (len(prompt) - held)
                work_total += work
                running[k] = [rep, work, turn]
                if expect is not None:
                    weighed[k] = (lease, prompt, work, expected)
                output = _tokens(rid, turn + 1000, out)
                s.context = prompt + output
                s.replica = rep
                cache.keep(key, len(prompt))
                if key != s.rid:
                    cache.keep(s.rid, len(s.context))
                else:
                    cache.keep(key, len(s.context))
        repins = sum(x["repins"] for x in lb.get_status()["replicas"].values())
    finally:
        lb.destroy()
        lb.close()
    return Row(
        row=row,
        workload=workload,
        makespan=now,
        reprefilled=reprefilled,
        hit_rate=held_tokens / prompt_tokens if prompt_tokens else 0.0,
        tail_balance=tail_weighted / tail_time if tail_time else float("nan"),
        repins=repins,
        bound_ratio=now / (work_total / (REPLICAS * CAPACITY)) if work_total else float("nan"),
        chain_ratio=max(chain) / (work_total / (REPLICAS * CAPACITY))
        if work_total
        else float("nan"),
    )


def _rates(
    running: dict[int, list[Any]],
    todo: list[Session],
    counts: dict[str, int],
    kv: dict[str, int],
    priority: bool,
) -> dict[int, float]:
    """Each running request's work units per second: its replica's CAPACITY shared equally
    (each at most PER_REQUEST), slowed while the replica's contexts exceed KV_TOKENS; with
    ``priority`` the long sessions' requests take their share first and the rest share what
    is left."""
    first: dict[str, list[int]] = {sid: [] for sid in counts}
    then: dict[str, list[int]] = {sid: [] for sid in counts}
    for k, (rep, _, _) in running.items():
        long = priority and len(todo[k].turns) >= LONG_TURNS
        (first if long else then)[rep].append(k)
    out: dict[int, float] = {}
    for sid in counts:
        slow, left = min(1.0, KV_TOKENS / max(kv[sid], 1)), CAPACITY
        for jobs in (first[sid], then[sid]):
            if jobs:
                share = min(PER_REQUEST, left / len(jobs))
                out.update(dict.fromkeys(jobs, share * slow))
                left -= share * len(jobs)
    return out


def _expected(expect: str, seed: int, session: int, turn: int, turns: list[tuple[int, int]]) -> int:
    """The output the harness expects of a turn (remaining-work rows, ESTIMATES): its true
    output, that times a factor from 0.5-2 (a function of seed, session and turn), or the
    session's output from this turn to its last."""
    out = turns[turn][1]
    if expect == "noisy":
        return round(out * random.Random(f"est:{seed}:{session}:{turn}").uniform(0.5, 2))
    if expect == "session":
        return sum(o for _, o in turns[turn:])
    return out


def _gap(seed: int, session: int, turn: int) -> float:
    """The tool call after a session's turn: a function of (seed, session, turn), so that
    every row and the oracles replay one workload."""
    return random.Random(f"gap:{seed}:{session}:{turn}").uniform(0.5, 2)


def pooled(workload: str, seed: int, quick: bool, longest_first: bool) -> float:
    """An oracle's step time over its work bound: the pool as one replica of the pool's
    capacity (REPLICAS * CAPACITY, each request still at most PER_REQUEST), every token a
    replica could hold cached (only each turn's new tokens, and a GRPO prompt once, are
    prefilled), the same sessions and tool calls as the rows. Its requests share that capacity
    equally (``longest_first`` False: perfect balance at every instant) or go in the order of
    their sessions' remaining chains, longest first (True: a clairvoyant order, which no
    balancer has, as it does not know how many turns a session has left). Neither bounds every
    placement: replicas that each share equally can still favour a long session by giving it
    a replica of its own. What they show is how much of the gap to the work bound is balance
    and how much is the order in which sessions are served."""
    todo = sessions(workload, seed, quick)
    pool = REPLICAS * CAPACITY
    ready = [(s.start, k, k, 0) for k, s in enumerate(todo)]
    heapq.heapify(ready)
    order = len(todo)
    running: dict[int, list[float]] = {}  # session -> [work left, turn, chain left after it]
    seen: set[str] = set()
    now = work_total = 0.0
    while ready or running:
        rates: dict[int, float] = {}
        if longest_first:
            left = pool
            for k in sorted(running, key=lambda k: -(running[k][0] / PER_REQUEST + running[k][2])):
                rates[k] = min(PER_REQUEST, left)
                left -= rates[k]
        else:
            share = min(PER_REQUEST, pool / len(running)) if running else 0.0
            rates = dict.fromkeys(running, share)
        t_done = min(
            (now + job[0] / rates[k] for k, job in running.items() if rates[k] > 0), default=None
        )
        t_ready = ready[0][0] if ready else None
        t_next = min(t for t in (t_done, t_ready) if t is not None)
        for k, job in running.items():
            job[0] -= (t_next - now) * rates[k]
        now = t_next
        for k in [k for k, job in running.items() if job[0] <= 1e-9]:
            turn = int(running.pop(k)[1])
            if turn + 1 < len(todo[k].turns):
                heapq.heappush(ready, (now + _gap(seed, k, turn), order, k, turn + 1))
                order += 1
        while ready and ready[0][0] <= now:
            _, _, k, turn = heapq.heappop(ready)
            s = todo[k]
            new, out = s.turns[turn]
            shared = workload == "grpo" and turn == 0
            prefill = 0 if shared and s.prompt in seen else new
            seen.add(s.prompt)
            work = out + PREFILL_COST * prefill
            work_total += work
            after = sum(o for _, o in s.turns[turn + 1 :]) / PER_REQUEST
            after += sum(_gap(seed, k, t) for t in range(turn, len(s.turns) - 1))
            running[k] = [work, turn, after]
    return now / (work_total / pool)


def _tokens(key: str, turn: int, n: int) -> list[int]:
    """n token ids, a function of (key, turn): a GRPO group's members share their prompt."""
    r = random.Random(f"{key}:{turn}")
    return [r.randrange(32_000) for _ in range(n)]


def _imbalanced(lb: RedisLoadBalancer, gate: dict[str, Any]) -> bool:
    counts = list(lb._run(lb._core.counts()).values())
    lo, hi = min(counts), max(counts)
    return bool(hi - lo > gate["abs"] and hi > gate["rel"] * lo)


def run_all(url: str, seed: int = 1, quick: bool = False, seeds: int = 4) -> list[Row]:
    """Every row on the workloads it concerns (the gate and margins move multi-turn sessions,
    groups place GRPO samples, engine priority favours long sessions), each the mean over
    seeds ``seed`` ... ``seed + seeds - 1``."""
    out = []
    for workload in ("agent", "grpo"):
        for row, router, opts in ROWS:
            if workload == "agent" and row.startswith("groups"):
                continue  # no groups in agent sessions
            if workload == "grpo" and row.startswith(("global gate", "margin")):
                continue  # GRPO samples are short: nothing for a gate or margin to move
            if workload == "grpo" and opts.get("engine_priority"):
                continue  # every GRPO sample has two turns: none is long
            got = [run_row(url, workload, row, router, opts, seed + k, quick) for k in range(seeds)]
            out.append(_mean(got))
    return out


def _mean(rows: Sequence[Row]) -> Row:
    """The mean of one row's runs over seeds, with the lowest and the highest of each column."""
    n = len(rows)

    def of(pick: Any) -> Row:
        return Row(
            row=rows[0].row,
            workload=rows[0].workload,
            makespan=pick(r.makespan for r in rows),
            reprefilled=round(pick(r.reprefilled for r in rows)),
            hit_rate=pick(r.hit_rate for r in rows),
            tail_balance=pick(r.tail_balance for r in rows),
            repins=round(pick(r.repins for r in rows)),
            bound_ratio=pick(r.bound_ratio for r in rows),
            chain_ratio=pick(r.chain_ratio for r in rows),
            seeds=n,
        )

    mean = of(lambda xs: sum(xs) / n)
    mean.lo, mean.hi = of(min), of(max)
    return mean


def main(url: str, seed: int, quick: bool, out: Any, seeds: int = 4) -> int:
    """Run every row, print the table and the targets (``redis-router simulate --rl``)."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an int >= 1, got {seeds!r}")
    print(f"each row the mean of seeds {seed}-{seed + seeds - 1} (lowest-highest)", file=out)
    rows = run_all(url, seed, quick, seeds)
    print(table(rows) + "\n", file=out)
    for line in targets(rows, oracles(seed, quick, seeds)):
        print(line, file=out)
    for line in sparse_lines(url, seed, seeds):
        print(line, file=out)
    return 0


def sparse_lines(url: str, seed: int, seeds: int) -> list[str]:
    """The sparse-session balance, with spread_sessions and sessions ended by their process
    (the target), and beside it without either and without end_session."""

    def of(spread: bool, end: bool) -> tuple[str, float]:
        got = [sparse_balance(url, seed + k, spread, end) for k in range(seeds)]
        mean = sum(got) / len(got)
        return f"{mean:.2f} ({min(got):.2f}-{max(got):.2f})", mean

    text, mean = of(True, True)
    off, _ = of(False, False)
    kept, _ = of(True, False)
    return [
        f"- sparse sessions ({SPARSE_SESSIONS} per process, {SPARSE_PROCESSES} processes, "
        f"{REPLICAS} replicas), spread_sessions on, each session ended (end_session) after its "
        f"last turn: time-weighted max/mean in-flight {text} (target <= 1.10): "
        f"{'met' if mean <= 1.10 else 'NOT met'}; spread_sessions off {off}; on, sessions "
        f"never ended (every session placed in the run counts as pinned) {kept}"
    ]


SPARSE_PROCESSES, SPARSE_SESSIONS = 4, 2  # routing processes, concurrent sessions each
SPARSE_RUN = 160  # sessions a run


def sparse_balance(url: str, seed: int, spread: bool = True, end: bool = True) -> float:
    """Sparse sticky sessions: SPARSE_PROCESSES balancer instances of one name, each keeping
    SPARSE_SESSIONS sessions going (3-10 turns of 1-3 s, 1-4 s of thinking between turns,
    holding no lease meanwhile; a new session when one ends), over REPLICAS replicas, in
    virtual time. With ``end`` a process ends each session after its last turn
    (``end_session``); without, its sticky entry stays (the run is far shorter than
    sticky_ttl, so every session ever placed counts as pinned). Each release is answered
    before the next event (the processes' calls reach Redis in virtual-time order). Returns
    the time-weighted max/mean in-flight: the busiest replica's mean in-flight count over the
    run, over the mean of all replicas'."""
    servers = {f"r{i}": None for i in range(REPLICAS)}
    name = f"rl-sparse-{secrets.token_hex(3)}"
    lbs = [
        RedisLoadBalancer(
            servers, redis=url, name=name, rng=random.Random(f"{seed}:{p}"), spread_sessions=spread
        )
        for p in range(SPARSE_PROCESSES)
    ]
    rng = random.Random(f"sparse:{seed}")
    # (time, order, process, session id, turn, turns left, replica or None): a turn starts
    # (replica None) or ends
    events: list[tuple[float, int, int, str, int, int, str | None]] = []
    seq = itertools.count()  # order among events at the same time
    started = 0

    def start(at: float, p: int) -> None:
        nonlocal started
        started += 1
        turns = rng.randint(3, 10)
        heapq.heappush(events, (at, next(seq), p, f"sp{started}", 0, turns, None))

    for p in range(SPARSE_PROCESSES):
        for _ in range(SPARSE_SESSIONS):
            start(rng.uniform(0, 1), p)
    load = dict.fromkeys(servers, 0)
    area = dict.fromkeys(servers, 0.0)
    now = 0.0
    try:
        while events:
            t, _, p, sid, turn, left, rep = heapq.heappop(events)
            for s in servers:
                area[s] += load[s] * (t - now)
            now = t
            if rep is None:
                rep, _ = lbs[p].acquire_server(sid)
                load[rep] += 1
                done = now + rng.uniform(1, 3)
                heapq.heappush(events, (done, next(seq), p, sid, turn, left, rep))
                continue
            load[rep] -= 1
            lbs[p].release_server(rep, sid).result()
            if left > 1:
                at = now + rng.uniform(1, 4)
                heapq.heappush(events, (at, next(seq), p, sid, turn + 1, left - 1, None))
                continue
            if end:
                lbs[p].end_session(sid)
            if started < SPARSE_RUN:
                start(now + rng.uniform(0, 0.5), p)
    finally:
        for lb in lbs[1:]:
            lb.close()
        lbs[0].destroy()
        lbs[0].close()
    mean = sum(area.values()) / len(area)
    return max(area.values()) / mean if mean else float("nan")


def _spread(r: Row, col: str, fmt: str) -> str:
    """A column's mean, and with several seeds its lowest and highest run."""
    text = format(getattr(r, col), fmt)
    if r.lo and r.hi and r.seeds > 1:
        text += f" ({format(getattr(r.lo, col), fmt)}-{format(getattr(r.hi, col), fmt)})"
    return text


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| workload | row | step time (s) | / work bound | re-prefilled tokens | token hit rate "
        "| max/mean in-flight (tail) | re-pins |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.workload} | {r.row} | {_spread(r, 'makespan', '.1f')} "
            f"| {_spread(r, 'bound_ratio', '.2f')} | {r.reprefilled:,} "
            f"| {_spread(r, 'hit_rate', '.1%')} | {_spread(r, 'tail_balance', '.2f')} "
            f"| {r.repins} |"
        )
    return "\n".join(lines)


Oracles = dict[str, tuple[list[float], list[float]]]


def oracles(seed: int, quick: bool, seeds: int) -> Oracles:
    """Per workload, the pooled oracles' step times over the work bound, one per seed: requests
    sharing the pool equally, and served longest remaining chain first (see pooled())."""
    runs = range(seed, seed + seeds)
    return {
        w: ([pooled(w, s, quick, False) for s in runs], [pooled(w, s, quick, True) for s in runs])
        for w in ("agent", "grpo")
    }


def _of(xs: Sequence[float]) -> str:
    mean = sum(xs) / len(xs)
    return f"{mean:.2f}x" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def targets(rows: Sequence[Row], oracle: Oracles | None = None) -> list[str]:
    """The targets, checked against this run's figures (with the pooled oracles' figures when
    given: what the step-time target asks of a placement)."""
    by = {(r.workload, r.row): r for r in rows}
    lines = []
    sticky = by[("agent", "sticky only")]
    gate = by[("agent", "global gate 2/1.5")]
    best = min((by[("agent", f"margin {m}")] for m in (1, 2, 4)), key=lambda r: r.makespan)
    cut = 1 - best.makespan / sticky.makespan
    share = best.reprefilled / gate.reprefilled if gate.reprefilled else 0.0
    ok = cut >= 0.10 and share < 1 / 3
    lines.append(
        f"- agent long tail: {best.row} cuts the step time {cut:.0%} against sticky only "
        f"(target >= 10%) re-prefilling {share:.0%} of the tokens the aggressive global gate "
        f"does (target < 33%): {'met' if ok else 'NOT met'}"
    )
    pc = by[("grpo", "prefix-cache")]
    grp = max((by[("grpo", f"groups, cap {c}")] for c in (4, 8)), key=lambda r: r.hit_rate)
    ratio = grp.hit_rate / pc.hit_rate if pc.hit_rate else float("inf")
    lines.append(
        f"- GRPO: {grp.row} reaches {ratio:.0%} of prefix-cache's token hit rate "
        f"({grp.hit_rate:.1%} vs {pc.hit_rate:.1%}; target >= 95%): "
        f"{'met' if ratio >= 0.95 else 'NOT met'}"
    )
    every, floor = by[("agent", "every option")], by[("agent", "no affinity")]
    lines.append(
        f"- agent, every option on: max/mean in-flight in the tail {every.tail_balance:.2f} "
        f"(target <= 1.5): {'met' if every.tail_balance <= 1.5 else 'NOT met'}; "
        f"no affinity at all reaches {floor.tail_balance:.2f}"
    )
    for w in ("agent", "grpo"):
        every = by[(w, "every option")]
        mine = [r for r in rows if r.workload == w]
        best = max(mine, key=lambda r: r.hit_rate)
        share = every.hit_rate / best.hit_rate if best.hit_rate else 0.0
        ok = every.bound_ratio <= 1.05 and share >= 0.95
        lines.append(
            f"- {w}, every option on: step time {every.bound_ratio:.2f}x the work bound "
            f"(target <= 1.05) at {share:.0%} of the best locality row's hit rate ({best.row}, "
            f"{best.hit_rate:.1%}; target >= 95%): {'met' if ok else 'NOT met'}; its longest "
            f"session alone (tool calls, turns at decode speed) takes {every.chain_ratio:.2f}x "
            f"({every.lo.chain_ratio if every.lo else every.chain_ratio:.2f}-"
            f"{every.hi.chain_ratio if every.hi else every.chain_ratio:.2f}), a floor no "
            "placement goes below"
        )
        near = [r for r in mine if r.hit_rate >= 0.95 * best.hit_rate]
        fast = min(near, key=lambda r: r.bound_ratio)
        lines.append(
            f"  - {w}, the shortest step among the rows at >= 95% of the best hit rate: "
            f"{fast.row}, {fast.bound_ratio:.2f}x the work bound at "
            f"{fast.hit_rate / best.hit_rate:.0%} (target <= 1.05): "
            f"{'met' if fast.bound_ratio <= 1.05 else 'NOT met'}"
        )
        # The other end of the trade: what the rows that do end the step in time keep cached.
        quick = [r for r in mine if r.bound_ratio <= 1.05]
        if quick:
            kept = max(quick, key=lambda r: r.hit_rate)
            lines.append(
                f"  - {w}, the best hit rate among the rows within 1.05x the work bound: "
                f"{kept.row}, {kept.hit_rate / best.hit_rate:.0%} of the best at "
                f"{kept.bound_ratio:.2f}x"
            )
        else:
            lines.append(f"  - {w}: no row ends within 1.05x the work bound")
        if oracle is not None:
            fair, first = oracle[w]
            lines.append(
                f"  - {w} oracles, every token a replica could hold cached, the pool as one "
                f"replica: requests sharing it equally (perfect balance) "
                f"{_of(fair)} the work bound; served longest remaining session first "
                f"(clairvoyant) {_of(first)}"
            )
    return lines
