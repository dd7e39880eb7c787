"""``python -m benchmarks.option_cost [--pairs N] [--rounds R] [--server-bin PATH]``

What each option costs a pair, in Redis server time and Redis commands, against the default
pair and a no-op script call in the same run. Every variant is a balancer of its own over the
same 8 replicas, routing new sessions (a request id never seen, one acquire and its release
at a time, as verl's protocol sends them); the variants take turns in blocks of ``pairs``
pairs, ``rounds`` times, and the server's own ``INFO commandstats`` gives each block's time
in script calls (FCALL, EVALSHA) and the commands those calls made. Printed per variant: the
median µs of Redis time per pair, the median of its per-round ratio to the default pair's
(and the lowest and highest of those ratios),
the commands per pair and those it makes beyond the default pair's, and the ratio to one
no-op FCALL (one key) of the same rounds. Then the targets: a default pair at most 8 no-op
calls, a pair batched 64 to a call at most 4.

An option on should cost its own work and no more: its extra commands are that work; the
time beyond them is the Lua that decides it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import uuid
from collections.abc import Callable
from typing import Any

import redis

from redis_router import EngineLoad, EngineScoring, RedisLoadBalancer
from redis_router.local_server import LocalServer
from redis_router.plugins.prefix_cache import PrefixCacheRouter

from .__main__ import _binary
from .latency import BATCH, batch_loop, group_pair_loop, pair_loop, servers

NOOP = (
    "#!lua name=rr_bench_noop\n"
    "redis.register_function{function_name='rr_bench_noop', "
    "callback=function(keys, argv) return 1 end}\n"
)
SCRIPT_CALLS = ("fcall", "fcall_ro", "evalsha", "eval", "evalsha_ro", "eval_ro")
NOT_THE_PAIRS = (*SCRIPT_CALLS, "info", "config", "function", "ping", "client", "hello")


def prompt_loop(lb: PrefixCacheRouter, seed: int) -> Callable[[int], None]:
    """n pairs with 1,024-token prompts: a 512-token system prompt shared by all and 512 of
    the session's own (the index records the prompt's hashes for its replica)."""
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(512)]

    def run(n: int) -> None:
        for _ in range(n):
            rid = uuid.uuid4().hex
            sid, _ = lb.acquire_server(rid, prompt_ids=system + rng.sample(range(50_000), 512))
            lb.release_server(sid, rid)

    return run


def spent(client: redis.Redis) -> tuple[float, dict[str, int]]:
    """µs in script calls so far, and every other command's calls."""
    stats = client.info("commandstats")
    us = sum(stats.get(f"cmdstat_{v}", {}).get("usec", 0) for v in SCRIPT_CALLS)
    calls = {
        k.removeprefix("cmdstat_"): int(v["calls"])
        for k, v in stats.items()
        if k.removeprefix("cmdstat_") not in NOT_THE_PAIRS
    }
    return float(us), calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.option_cost", description=__doc__)
    ap.add_argument("--pairs", type=int, default=1000, help="pairs per block (default 1000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of blocks (default 7)")
    ap.add_argument("--server-bin", help="redis-server / valkey-server to start")
    args = ap.parse_args(argv)
    binary = _binary(args.server_bin)
    pool = servers(8)
    with LocalServer(binary) as server:
        client = redis.Redis.from_url(server.url)
        common: dict[str, Any] = {
            "redis": server.url,
            "lease_ttl": 600.0,
        }  # no keeper beat in a round
        default = RedisLoadBalancer(pool, name="cost-default", **common)
        capped = RedisLoadBalancer(name="cost-capacity", **common)
        capped.add_servers(pool, capacity=dict.fromkeys(pool, 1_000_000))
        scored = RedisLoadBalancer(
            pool, name="cost-engine", engine_scoring=EngineScoring(3600.0), **common
        )
        scored.report_engine_load({sid: EngineLoad(2, 1, 0.5) for sid in pool})
        grouped = RedisLoadBalancer(pool, name="cost-groups", group_by="-", **common)
        prefix = PrefixCacheRouter(pool, name="cost-prefix", **common)
        balancers = {
            "default": default,
            "capacity (declared, none full)": capped,
            "groups (GRPO groups of 8)": grouped,
            "ejection (eject_after=5, none ejected)": RedisLoadBalancer(
                pool, name="cost-ejection", eject_after=5, **common
            ),
            "engine scoring (fresh reports)": scored,
            "spread_sessions": RedisLoadBalancer(
                pool, name="cost-spread", spread_sessions=True, **common
            ),
            "prefix_cache (1,024-token prompts)": prefix,
        }
        work: dict[str, Callable[[int], None]] = {
            label: pair_loop(lb) for label, lb in balancers.items()
        }
        work["groups (GRPO groups of 8)"] = group_pair_loop(grouped)
        work["prefix_cache (1,024-token prompts)"] = prompt_loop(prefix, seed=1)
        work[f"default, batched {BATCH} a call"] = batch_loop(default, BATCH)
        client.function_load(NOOP, replace=True)
        key = default._core.prefix

        def noop(n: int) -> None:
            for _ in range(n):
                client.fcall("rr_bench_noop", 1, key)

        work["no-op FCALL, one key"] = noop
        for run in work.values():  # warm: keepers, scripts loaded, sticky buckets made
            run(50)
        us: dict[str, list[float]] = {label: [] for label in work}
        cmds: dict[str, dict[str, float]] = {}
        labels = list(work)
        for rnd in range(args.rounds):
            order = labels if rnd % 2 == 0 else labels[::-1]
            for label in order:
                t0, c0 = spent(client)
                work[label](args.pairs)
                t1, c1 = spent(client)
                us[label].append((t1 - t0) / args.pairs)
                cmds[label] = {c: (n - c0.get(c, 0)) / args.pairs for c, n in c1.items()}
        for lb in balancers.values():
            lb.destroy()
            lb.close()
    per_round_default = us["default"]
    noop_us = statistics.median(us["no-op FCALL, one key"])
    print(
        f"{binary.label}; 8 replicas, new sessions; {args.pairs} pairs a block, {args.rounds} "
        "rounds taking turns; medians; Redis time from INFO commandstats"
    )
    width = max(len(label) for label in labels)
    print(
        f"{'pair':{width}s} {'µs/pair':>8s} {'x default':>9s} {'(rounds)':>11s} {'x no-op':>8s}"
        f" {'cmds':>6s}"
        "  commands beyond the default pair's"
    )
    base = cmds["default"]
    for label in labels:
        m = statistics.median(us[label])
        ratios = [a / b for a, b in zip(us[label], per_round_default, strict=True)]
        ratio, spread = statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}"
        n = sum(cmds[label].values())
        extra = ", ".join(
            f"{c.upper()} {d:+.1f}"
            for c, d in sorted(
                ((c, v - base.get(c, 0.0)) for c, v in cmds[label].items()), key=lambda x: -x[1]
            )
            if abs(d) >= 0.05
        )
        if label == "no-op FCALL, one key":
            extra = ""
        print(
            f"{label:{width}s} {m:8.1f} {ratio:9.2f} {spread:>11s} {m / noop_us:8.1f} {n:6.1f}"
            f"  {extra}"
        )
    single = statistics.median(us["default"]) / noop_us
    batched = statistics.median(us[f"default, batched {BATCH} a call"]) / noop_us
    print(f"target: default pair <= 8 no-op calls: {single:.1f}x ({_verdict(single <= 8)})")
    print(f"target: batched pair <= 4 no-op calls: {batched:.1f}x ({_verdict(batched <= 4)})")
    return 0


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


if __name__ == "__main__":
    sys.exit(main())
