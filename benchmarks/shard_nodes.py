"""``python -m benchmarks.shard_nodes [--pairs N] [--rounds R] [--turns T] [--server-bin PATH]``

Whether a sharded pool spreads its Redis time over a Cluster's primaries, and what it costs
beyond an unsharded one. A local Cluster of 3 primaries (no replicas), 24 replicas; the
pools, taking turns in each round:

- ``K = 1``: one :class:`~redis_router.RedisLoadBalancer` (one slot, so one primary);
- ``K = 3``, ``K = 6``: a :class:`~redis_router.ShardedLoadBalancer` of K shards, whose names
  the pool picks so that shard i's slot is on primary i mod 3, plus its directory's slot.

One process sends ``pairs`` acquire+release pairs per pool and round: sessions of ``turns``
turns each (a new session asks the directory for its shard once; its later turns go to the
shard it remembers), the pool's publisher thread running as it does in use. Printed per pool:
where its slots are (shards per primary, and the directory's primary), the Redis time per pair
summed over the primaries (``INFO commandstats``: FCALL and EVALSHA), its ratio to K = 1's in
the same round (median over rounds), max/mean of the primaries' time (1.0: even; 3.0 for
K = 1), the primaries' process CPU per pair, summed (``INFO cpu``), with its ratio, and the
script calls per pair (what noise cannot move: a pair is 2, a new session's directory call
adds 1/``turns``, the publisher a few per 0.1 s). Where
the primaries share fewer cores than they are, a command's elapsed time grows when its process
is preempted; the CPU column does not.

Pacing (``--period``, µs per pair): on a machine whose cores are shared, a call's server time
depends on how long the server idled before it (its caches go cold): the same balancer's pairs
cost 20-30 % more Redis time when its client does ~100 µs more work between calls. A sharded
pool's client does more per pair than an unsharded one's (its directory lookup, its generator),
so back to back (``--period 0``) the comparison charges the pool for its client's pace. Paced,
every pool's pairs start at the same period, so each server sees the same gaps; a pool whose
client cannot keep the pace is reported (``late``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from redis_router import RedisLoadBalancer, ShardedLoadBalancer
from redis_router.local_server import LocalServer
from redis_router.shards import slot_of

from .__main__ import _binary

PRIMARIES = 3
REPLICAS = 24
SHARDS = (1, 3, 6)


def node_of(name: str, ranges: Sequence[tuple[int, int]]) -> int:
    """The primary whose slots hold balancer ``name``'s keys (one hash tag: ``{name}``)."""
    slot = slot_of(name)
    return next(i for i, (lo, hi) in enumerate(ranges) if lo <= slot <= hi)


def cpu(nodes: Sequence[redis.Redis]) -> list[float]:
    """µs of CPU (user and system, ``INFO cpu``) each primary's process has used so far: what
    a preempted command's elapsed time does not inflate, where the primaries share cores."""
    out = []
    for node in nodes:
        info = node.info("cpu")
        out.append(1e6 * (float(info["used_cpu_user"]) + float(info["used_cpu_sys"])))
    return out


def spent(nodes: Sequence[redis.Redis], field: str = "usec") -> list[float]:
    """µs each primary has spent in script calls so far (``field="calls"``: how many)."""
    out = []
    for node in nodes:
        stats = node.info("commandstats")
        out.append(
            float(sum(stats.get(f"cmdstat_{v}", {}).get(field, 0) for v in ("fcall", "evalsha")))
        )
    return out


def make_pool(
    k: int, servers: dict[str, str], url: str, ranges: Sequence[tuple[int, int]]
) -> tuple[Any, tuple[list[int], int | None]]:
    """A pool of K shards (K = 1: an unsharded balancer) with a fresh name, and where its
    slots are: each shard's primary, the directory's."""
    tag = uuid.uuid4().hex[:6]
    if k == 1:
        one = RedisLoadBalancer(servers, redis=url, name=f"one-{tag}")
        return one, ([node_of(one.name, ranges)], None)
    pool = ShardedLoadBalancer(servers, shards=k, redis=url, name=f"k{k}-{tag}")
    return pool, ([node_of(n, ranges) for n in pool.shard_names], node_of(pool.name, ranges))


def settle(pool: Any) -> None:
    """Every release of the pool answered before the time is read."""
    for lb in getattr(pool, "_shards", [pool]):
        if lb._outbox is not None:
            lb._outbox.drain()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shard_nodes", description=__doc__)
    ap.add_argument("--pairs", type=int, default=3000, help="pairs per pool and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--turns", type=int, default=1, help="turns per session (default 1)")
    ap.add_argument(
        "--one-server",
        action="store_true",
        help="every pool on one server (no Cluster): the pools' own cost, without the cost of "
        "spreading calls over processes that share the machine's cores",
    )
    ap.add_argument(
        "--period",
        type=float,
        default=1000.0,
        help="µs from one pair's start to the next (default 1000; 0: back to back)",
    )
    ap.add_argument("--server-bin", help="redis-server / valkey-server to start (7+)")
    args = ap.parse_args(argv)
    binary = _binary(args.server_bin)
    from tests.servers import LocalCluster  # the test suite's local Cluster (a checkout only)

    servers = {f"r{j}": f"http://h{j}" for j in range(REPLICAS)}
    with contextlib.ExitStack() as stack:
        if args.one_server:
            server = stack.enter_context(LocalServer(binary))
            ranges, url, nodes = [(0, 16383)], server.url, [server.client()]
        else:
            cluster = stack.enter_context(LocalCluster(binary, masters=PRIMARIES))
            ranges, url = cluster.slot_ranges(), cluster.url
            nodes = [n.client() for n in cluster.nodes]
        where: dict[int, tuple[list[int], int | None]] = {}
        per_pair: dict[int, list[float]] = {k: [] for k in SHARDS}
        skew: dict[int, list[float]] = {k: [] for k in SHARDS}
        cpu_pair: dict[int, list[float]] = {k: [] for k in SHARDS}
        calls_pair: dict[int, list[float]] = {k: [] for k in SHARDS}
        late_pairs: dict[int, list[float]] = {k: [] for k in SHARDS}
        for _ in range(args.rounds):
            for k in SHARDS:  # one pool at a time: no other pool's publisher meanwhile
                pool, where[k] = make_pool(k, servers, url, ranges)
                try:
                    for i in range(12):  # warm: scripts loaded, holders known
                        pool.release_server(pool.acquire_server(f"warm{i}")[0], f"warm{i}")
                    settle(pool)
                    before, cpu_before = spent(nodes), cpu(nodes)
                    calls_before = spent(nodes, "calls")
                    rid = ""
                    period, late, start = args.period / 1e6, 0, time.perf_counter()
                    for p in range(args.pairs):
                        if p % args.turns == 0:
                            rid = uuid.uuid4().hex
                        pool.release_server(pool.acquire_server(rid)[0], rid)
                        if period:
                            wait = start + (p + 1) * period - time.perf_counter()
                            if wait > 0:
                                time.sleep(wait)
                            else:
                                late += 1
                    settle(pool)
                    used = [a - b for a, b in zip(spent(nodes), before, strict=True)]
                    burnt = [a - b for a, b in zip(cpu(nodes), cpu_before, strict=True)]
                    calls = sum(spent(nodes, "calls")) - sum(calls_before)
                finally:
                    pool.destroy()
                    pool.close()
                cpu_pair[k].append(sum(burnt) / args.pairs)
                calls_pair[k].append(calls / args.pairs)
                late_pairs[k].append(late / args.pairs)
                per_pair[k].append(sum(used) / args.pairs)
                skew[k].append(max(used) / (sum(used) / len(used)))
    base = per_pair[1]
    where_ = "one server" if args.one_server else f"a local Cluster of {PRIMARIES} primaries"
    print(
        f"{binary.label}, {where_}; {REPLICAS} replicas; "
        f"{args.pairs} pairs per pool and round, sessions of {args.turns} turn(s), "
        f"{args.rounds} rounds, medians; "
        + (f"a pair every {args.period:g} us" if args.period else "pairs back to back")
    )
    print(
        f"{'K':>2s} {'shards per primary':>18s} {'directory':>9s} {'us/pair, all':>13s} "
        f"{'x K=1':>6s} {'max/mean':>9s} {'CPU us/pair, all':>17s} {'x K=1':>6s} "
        f"{'calls/pair':>10s} {'late':>5s}"
    )
    for k, values in per_pair.items():
        shards, directory = where[k]
        counts = [shards.count(i) for i in range(len(nodes))]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        burnt = cpu_pair[k]
        cpu_ratio = statistics.median(v / b for v, b in zip(burnt, cpu_pair[1], strict=True))
        print(
            f"{k:2d} {str(counts).replace(' ', ''):>18s} "
            f"{'-' if directory is None else directory:>9} {statistics.median(values):13.1f} "
            f"{ratio:6.2f} {statistics.median(skew[k]):9.2f} "
            f"{statistics.median(burnt):17.1f} {cpu_ratio:6.2f} "
            f"{statistics.median(calls_pair[k]):10.2f} {max(late_pairs[k]):5.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
