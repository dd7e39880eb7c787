"""The ``dp`` rows of `redis-router simulate --kv`: data-parallel ranks routed as units, against
routing to the server and letting the engine pick a rank.

Model. SERVERS servers of DP_SIZE data-parallel ranks each; every rank has its own block-level
LRU KV cache (:class:`~redis_router.tools.simulate_kv.Replica`, chained 16-token block hashes
as in vLLM). Multi-turn sessions: a session opens with a TASK-token prompt of its own, each
turn's answer is OUTPUT tokens and the next turn adds a TOOL-token observation, so turn k's
prompt is turn k-1's prompt, answer and observation. Rounds: every session sends one turn
(all in flight at once, acquired in a shuffled order, then all released), and a turn's prompt
and answer enter the cache of the rank that served it.

Routers. ``rank-aware``: the servers registered with ``"dp_size": DP_SIZE``, so the balancer's
pool holds SERVERS x DP_SIZE units (sticky, least loaded) and the grant names the rank.
``rank-blind``: the servers registered plain (sticky, least loaded over SERVERS members) and
the engine picks one of the server's ranks uniformly at random for each request.

Columns: token hit rate = cached prompt tokens / prompt tokens; same rank = the share of turns
(after a session's first) that reach the rank of the session's previous turn; the mean of the
seeds, the lowest and the highest in brackets.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from .. import dp
from ..balancer import RedisLoadBalancer
from .simulate_kv import BLOCK, VOCAB, Replica, chain

SERVERS = 2
DP_SIZE = 8
TASK = 512  # tokens of a session's first prompt (its own)
OUTPUT = 128  # tokens of each answer
TOOL = 256  # tokens of the observation each later turn adds
ROUTERS = ("rank-aware", "rank-blind")
# Targets: the share of turns on their session's rank, and rank-aware's hit rate over
# rank-blind's.
SAME_RANK_TARGET = 0.99
HIT_RATIO_TARGET = 5.0


@dataclass(frozen=True)
class Params:
    sessions: int
    turns: int
    cache_blocks: int  # per rank

    @staticmethod
    def full() -> Params:
        return Params(sessions=128, turns=8, cache_blocks=1024)

    @staticmethod
    def quick() -> Params:
        return Params(sessions=32, turns=8, cache_blocks=256)


@dataclass
class Row:
    router: str
    requests: int
    hit_rate: float
    same_rank: float
    hit_lo: float = 0.0
    hit_hi: float = 0.0
    same_lo: float = 0.0
    same_hi: float = 0.0


def _servers(aware: bool) -> dict[str, Any]:
    extra = {dp.DP_SIZE: DP_SIZE} if aware else {}
    return {f"g{i}": {"url": f"http://sim-g{i}:8000", **extra} for i in range(SERVERS)}


def run(url: str, router: str, seed: int, p: Params) -> Row:
    """One run of ``router`` (ROUTERS) on a balancer of its own, destroyed at the end."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    aware = router == "rank-aware"
    rng = random.Random(seed)
    contexts = {f"conv-{i}": [rng.randrange(VOCAB) for _ in range(TASK)] for i in range(p.sessions)}
    caches = {(f"g{i}", k): Replica(p.cache_blocks) for i in range(SERVERS) for k in range(DP_SIZE)}
    last: dict[str, tuple[str, int]] = {}
    hit = total = same = later = requests = 0
    lb = RedisLoadBalancer(
        _servers(aware), redis=url, name=f"kvdp-{secrets.token_hex(4)}", rng=random.Random(seed)
    )
    try:
        order = list(contexts)
        for turn in range(p.turns):
            rng.shuffle(order)
            leases = [lb.acquire(s) for s in order]
            for s, lease in zip(order, leases, strict=True):
                requests += 1
                server = dp.replica_of(lease.server_id)[0]
                rank = dp.rank_of(lease.handle) if aware else rng.randrange(DP_SIZE)
                assert rank is not None
                where = (server, rank)
                if turn:
                    later += 1
                    same += last[s] == where
                last[s] = where
                cache, prompt = caches[where], contexts[s]
                hashes = chain(prompt, len(prompt) // BLOCK)
                hit += cache.cached(hashes) * BLOCK
                total += len(prompt)
                prompt += [rng.randrange(VOCAB) for _ in range(OUTPUT)]
                cache.store(prompt, chain(prompt, len(prompt) // BLOCK))
                cache.pending.clear()  # no event stream here
                prompt += [rng.randrange(VOCAB) for _ in range(TOOL)]
            for lease in leases:
                lease.release()
        lb.destroy()
    finally:
        lb.close()
    return Row(router, requests, hit / total, same / later if later else 1.0)


def _mean(rows: Sequence[Row]) -> Row:
    n = len(rows)
    return Row(
        router=rows[0].router,
        requests=sum(r.requests for r in rows) // n,
        hit_rate=sum(r.hit_rate for r in rows) / n,
        same_rank=sum(r.same_rank for r in rows) / n,
        hit_lo=min(r.hit_rate for r in rows),
        hit_hi=max(r.hit_rate for r in rows),
        same_lo=min(r.same_rank for r in rows),
        same_hi=max(r.same_rank for r in rows),
    )


def run_all(url: str, seed: int, quick: bool, seeds: int) -> list[Row]:
    """Both routers, each the mean over seeds ``seed`` ... ``seed + seeds - 1``."""
    p = Params.quick() if quick else Params.full()
    return [_mean([run(url, r, seed + k, p) for k in range(seeds)]) for r in ROUTERS]


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| workload | router | units | token hit rate (lowest-highest) "
        "| same rank (lowest-highest) | requests |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        units = SERVERS * DP_SIZE if r.router == "rank-aware" else SERVERS
        lines.append(
            f"| dp | {r.router} | {units} "
            f"| {r.hit_rate:.1%} ({100 * r.hit_lo:.1f}-{100 * r.hit_hi:.1f}) "
            f"| {r.same_rank:.1%} ({100 * r.same_lo:.1f}-{100 * r.same_hi:.1f}) "
            f"| {r.requests} |"
        )
    return "\n".join(lines)


def targets(rows: Sequence[Row]) -> list[str]:
    by = {r.router: r for r in rows}
    aware, blind = by["rank-aware"], by["rank-blind"]
    ratio = aware.hit_rate / blind.hit_rate if blind.hit_rate else float("inf")
    return [
        f"- dp: rank-aware turns on their session's rank {aware.same_rank:.1%} "
        f"(target >= {SAME_RANK_TARGET:.0%}; rank-blind {blind.same_rank:.1%})",
        f"- dp: rank-aware hit rate {ratio:.1f}x rank-blind's (target >= {HIT_RATIO_TARGET:g}x)",
    ]


def main(url: str, seed: int, quick: bool, out: TextIO, seeds: int) -> None:
    """Print the dp rows and their targets."""
    p = Params.quick() if quick else Params.full()
    print(
        f"\ndp: {SERVERS} servers x {DP_SIZE} data-parallel ranks, {p.cache_blocks} KV blocks "
        f"of {BLOCK} tokens per rank, {p.sessions} sessions of {p.turns} turns, each row the "
        f"mean of seeds {seed}-{seed + seeds - 1}\n",
        file=out,
    )
    rows = run_all(url, seed, quick, seeds)
    print(table(rows) + "\n", file=out)
    for line in targets(rows):
        print(line, file=out)
