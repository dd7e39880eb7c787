"""``python -m benchmarks.shard_nodes [--pairs N] [--rounds R] [--server-bin PATH]``

Whether a pool split over K hash tags spreads its Redis time over a Cluster's primaries, and
what the tags must be for it to. A local Cluster of 3 primaries (no replicas); for K = 1, 3
and 6, one balancer per shard over an equal share of 24 replicas, their names chosen two ways:

- ``spread``: each shard's name picked so that its hash tag's slot falls on the primaries in
  turn (shard k on primary k mod 3), as a sharded pool would pick them;
- ``numbered``: ``pool<K>.0``, ``pool<K>.1``, ...: wherever CRC16 puts them.

One process sends ``pairs`` new-session acquire+release pairs per round, the shards in turn,
``block`` pairs to a shard in a row (each shard's sessions are its own: what a sharded pool's
placement spreads). Printed per K
and layout: the Redis time per pair summed over the primaries (``INFO commandstats``: FCALL
and EVALSHA), its ratio to K = 1's in the same round (median over rounds), and max/mean of the
primaries' time (1.0: even; 3.0 for K = 1, which lives on one primary); then the primaries'
process CPU per pair, summed (``INFO cpu``: scripts, network and the rest), and its ratio to
K = 1's. Where the primaries share fewer cores than they are, a command's elapsed time grows
when its process is preempted; the CPU column does not. What a sharded pool
adds to this, one directory call per new session, is not included: there is no sharded
balancer yet (docs/design.md, "One pool past one core").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Sequence

import redis
from redis.crc import key_slot

from redis_router import RedisLoadBalancer

from .__main__ import _binary

PRIMARIES = 3
REPLICAS = 24
SHARDS = (1, 3, 6)


def node_of(name: str, ranges: Sequence[tuple[int, int]]) -> int:
    """The primary whose slots hold balancer ``name``'s keys (one hash tag: ``{name}``)."""
    slot = key_slot(f"rr:{{{name}}}:".encode())
    return next(i for i, (lo, hi) in enumerate(ranges) if lo <= slot <= hi)


def spread_names(prefix: str, k: int, ranges: Sequence[tuple[int, int]]) -> list[str]:
    """K balancer names whose slots fall on the primaries in turn (shard i on primary i mod
    the primaries): the first free ``<prefix>-<n>`` for each."""
    names, n = [], 0
    for i in range(k):
        while node_of(f"{prefix}-{n}", ranges) != i % len(ranges):
            n += 1
        names.append(f"{prefix}-{n}")
        n += 1
    return names


def cpu(nodes: Sequence[redis.Redis]) -> list[float]:
    """µs of CPU (user and system, ``INFO cpu``) each primary's process has used so far: what
    a preempted command's elapsed time does not inflate, where the primaries share cores."""
    out = []
    for node in nodes:
        info = node.info("cpu")
        out.append(1e6 * (float(info["used_cpu_user"]) + float(info["used_cpu_sys"])))
    return out


def spent(nodes: Sequence[redis.Redis]) -> list[float]:
    """µs each primary has spent in script calls so far."""
    out = []
    for node in nodes:
        stats = node.info("commandstats")
        out.append(
            float(sum(stats.get(f"cmdstat_{v}", {}).get("usec", 0) for v in ("fcall", "evalsha")))
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shard_nodes", description=__doc__)
    ap.add_argument("--pairs", type=int, default=3000, help="pairs per layout and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    ap.add_argument(
        "--block", type=int, default=1, help="pairs sent to one shard in a row (default 1)"
    )
    ap.add_argument("--server-bin", help="redis-server / valkey-server to start (7+)")
    args = ap.parse_args(argv)
    binary = _binary(args.server_bin)
    from tests.servers import LocalCluster  # the test suite's local Cluster (a checkout only)

    with LocalCluster(binary, masters=PRIMARIES) as cluster:
        ranges = cluster.slot_ranges()
        nodes = [n.client() for n in cluster.nodes]
        layouts: dict[tuple[int, str], list[RedisLoadBalancer]] = {}
        for k in SHARDS:
            for layout in ("spread", "numbered"):
                if k == 1 and layout == "numbered":
                    continue
                names = (
                    spread_names(f"spread{k}", k, ranges)
                    if layout == "spread"
                    else [f"pool{k}.{i}" for i in range(k)]
                )
                per = REPLICAS // k
                layouts[(k, layout)] = [
                    RedisLoadBalancer(
                        {f"r{j}": f"http://h{j}" for j in range(i * per, (i + 1) * per)},
                        redis=cluster.url,
                        name=name,
                    )
                    for i, name in enumerate(names)
                ]
        where = {key: [node_of(lb.name, ranges) for lb in lbs] for key, lbs in layouts.items()}
        for lbs in layouts.values():  # warm: scripts loaded, holders known
            for lb in lbs:
                lb.release_server(lb.acquire_server("warm")[0], "warm")
        per_pair: dict[tuple[int, str], list[float]] = {key: [] for key in layouts}
        skew: dict[tuple[int, str], list[float]] = {key: [] for key in layouts}
        cpu_pair: dict[tuple[int, str], list[float]] = {key: [] for key in layouts}
        for _ in range(args.rounds):
            for key, lbs in layouts.items():
                before, cpu_before = spent(nodes), cpu(nodes)
                for p in range(args.pairs):
                    lb = lbs[p // args.block % len(lbs)]
                    rid = uuid.uuid4().hex
                    lb.release_server(lb.acquire_server(rid)[0], rid)
                for lb in lbs:  # every release answered before the time is read
                    if lb._outbox is not None:
                        lb._outbox.drain()
                used = [a - b for a, b in zip(spent(nodes), before, strict=True)]
                burnt = [a - b for a, b in zip(cpu(nodes), cpu_before, strict=True)]
                cpu_pair[key].append(sum(burnt) / args.pairs)
                per_pair[key].append(sum(used) / args.pairs)
                skew[key].append(max(used) / (sum(used) / len(used)))
        for lbs in layouts.values():
            for lb in lbs:
                lb.destroy()
                lb.close()
    base = per_pair[(1, "spread")]
    print(
        f"{binary.label}, a local Cluster of {PRIMARIES} primaries; {REPLICAS} replicas split over "
        f"K shards; {args.pairs} pairs per layout and round, {args.block} in a row to a shard, "
        f"{args.rounds} rounds, medians"
    )
    print(
        f"{'K':>2s} {'layout':9s} {'shards per primary':>18s} {'us/pair, all':>13s} "
        f"{'x K=1':>6s} {'max/mean':>9s} {'CPU us/pair, all':>17s} {'x K=1':>6s}"
    )
    for (k, layout), values in per_pair.items():
        counts = [where[(k, layout)].count(i) for i in range(PRIMARIES)]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        burnt = cpu_pair[(k, layout)]
        cpu_ratio = statistics.median(
            v / b for v, b in zip(burnt, cpu_pair[(1, "spread")], strict=True)
        )
        print(
            f"{k:2d} {layout:9s} {counts!s:>18s} {statistics.median(values):13.1f} "
            f"{ratio:6.2f} {statistics.median(skew[(k, layout)]):9.2f} "
            f"{statistics.median(burnt):17.1f} {cpu_ratio:6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
