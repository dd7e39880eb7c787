"""Targets 1 and 2: an acquire + release pair against two bare round trips, and flat in the
number of replicas.

Each pair routes a new session (a uuid4 request id, as verl's), so it takes the full path:
sticky lookup miss, least-loaded pick, lease, sticky entry; then releases it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import redis

from redis_router import EngineLoad, EngineScoring, RedisLoadBalancer

from .harness import Row, Sizes, interleaved

NOOP = "return 1"


def servers(n: int) -> dict[str, str]:
    return {f"replica-{i}": f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n)}


def pair_loop(lb: RedisLoadBalancer) -> Callable[[int], None]:
    """n acquire + release pairs through verl's protocol (acquire_server / release_server)."""

    def run(n: int) -> None:
        acquire, release = lb.acquire_server, lb.release_server
        for rid in [uuid.uuid4().hex for _ in range(n)]:
            sid, _ = acquire(rid)
            release(sid, rid)

    return run


def group_pair_loop(lb: RedisLoadBalancer) -> Callable[[int], None]:
    """n pairs whose request ids name GRPO groups of 8 ("<prompt>-<sample>", group_by "-"):
    the first of a group is placed by the policy, the others follow it."""

    def run(n: int) -> None:
        acquire, release = lb.acquire_server, lb.release_server
        for k in range(n):
            if k % 8 == 0:
                prompt = uuid.uuid4().hex
            rid = f"{prompt}-{k % 8}"
            sid, _ = acquire(rid)
            release(sid, rid)

    return run


def run(client: redis.Redis, sizes: Sizes) -> list[Row]:
    small = RedisLoadBalancer(servers(8), redis=client, name="bench-lat-8")
    grouped = RedisLoadBalancer(servers(8), redis=client, name="bench-lat-group", group_by="-")
    large = RedisLoadBalancer(servers(4096), redis=client, name="bench-lat-4096")
    # Health and admission on, nothing full or ejected: what declaring them costs.
    capped = RedisLoadBalancer(redis=client, name="bench-lat-capacity")
    capped.add_servers(servers(8), capacity=dict.fromkeys(servers(8), 1_000_000))
    ejecting = RedisLoadBalancer(servers(8), redis=client, name="bench-lat-eject", eject_after=5)
    # Engine-aware scoring with a fresh report on every replica (a long ttl: fresh throughout).
    scored = RedisLoadBalancer(
        servers(8), redis=client, name="bench-lat-engine", engine_scoring=EngineScoring(3600.0)
    )
    scored.report_engine_load({sid: EngineLoad(2, 1, 0.5) for sid in servers(8)})
    noop_sha = client.script_load(NOOP)
    prefix = small._core.prefix

    def noop(n: int) -> None:
        evalsha = client.evalsha
        for _ in range(n):
            evalsha(noop_sha, 1, prefix)
            evalsha(noop_sha, 1, prefix)

    pair8, pair4096, group8 = pair_loop(small), pair_loop(large), group_pair_loop(grouped)
    pair_cap, pair_eject, pair_engine = pair_loop(capped), pair_loop(ejecting), pair_loop(scored)
    for warm in (noop, pair8, pair4096, group8, pair_cap, pair_eject, pair_engine):
        warm(max(50, sizes.block // 2))
    t_pair, t_noop, ratio = interleaved(pair8, noop, sizes.rounds, sizes.block)
    t_large, t_small, flat = interleaved(pair4096, pair8, sizes.rounds, sizes.block)
    t_group, t_plain, by_group = interleaved(group8, pair8, sizes.rounds, sizes.block)
    t_cap, t_plain2, by_cap = interleaved(pair_cap, pair8, sizes.rounds, sizes.block)
    t_eject, t_plain3, by_eject = interleaved(pair_eject, pair8, sizes.rounds, sizes.block)
    t_engine, t_plain4, by_engine = interleaved(pair_engine, pair8, sizes.rounds, sizes.block)
    n = sizes.rounds * sizes.block
    single = server_time(client, pair8, n) / n
    batched = server_time(client, batch_loop(small, BATCH), n) / n
    single_cap = server_time(client, pair_cap, n) / n
    # Server time, the engine-scored and the default pair taking turns in blocks.
    engine_spent = plain_spent = 0.0
    for _ in range(sizes.rounds):
        engine_spent += server_time(client, pair_engine, sizes.block)
        plain_spent += server_time(client, pair8, sizes.block)
    for lb in (small, large, grouped, capped, ejecting, scored):
        lb.destroy()
        lb.close()  # no heartbeats left to find their holder gone after later steps
    return [
        Row(
            "pair_vs_noop",
            "(1) acquire+release pair, 8 replicas",
            t_pair,
            "s",
            baseline="2 no-op EVALSHA",
            baseline_value=t_noop,
            ratio=ratio,
            target=("<=", 1.3),
        ),
        Row(
            "pair_4096_vs_8",
            "(2) acquire+release pair, 4096 replicas",
            t_large,
            "s",
            baseline="8 replicas",
            baseline_value=t_small,
            ratio=flat,
            target=("<=", 1.3),
        ),
        Row(
            "group_pair_vs_default",
            "acquire+release pair with a group id (GRPO groups of 8), 8 replicas",
            t_group,
            "s",
            baseline="default pair",
            baseline_value=t_plain,
            ratio=by_group,
            target=("<=", 1.2),
        ),
        Row(
            "capacity_pair_vs_default",
            "acquire+release pair, 8 replicas declaring a capacity (none full)",
            t_cap,
            "s",
            baseline="default pair",
            baseline_value=t_plain2,
            ratio=by_cap,
            target=("<=", 1.2),
        ),
        Row(
            "ejection_pair_vs_default",
            "acquire+release pair with ejection on (eject_after=5, none ejected)",
            t_eject,
            "s",
            baseline="default pair",
            baseline_value=t_plain3,
            ratio=by_eject,
            target=("<=", 1.1),
        ),
        Row(
            "engine_pair_vs_default",
            "acquire+release pair with engine scoring, a fresh report on each of 8 replicas",
            t_engine,
            "s",
            baseline="default pair",
            baseline_value=t_plain4,
            ratio=by_engine,
            target=("<=", 1.15),
        ),
        Row(
            "server_time_pair",
            "Redis server time per acquire+release pair (commandstats)",
            single,
            "s",
            note=f"bounds one balancer at ~{1 / single:,.0f} pairs/s",
        ),
        Row(
            "server_time_pair_batched",
            f"    ... batched, {BATCH} acquires then {BATCH} releases per call",
            batched,
            "s",
            baseline="single",
            baseline_value=single,
            ratio=batched / single,
            note=f"bounds one balancer at ~{1 / batched:,.0f} pairs/s",
        ),
        Row(
            "server_time_pair_capacity",
            "    ... with a capacity declared on each replica",
            single_cap,
            "s",
            baseline="single",
            baseline_value=single,
            ratio=single_cap / single,
        ),
        Row(
            "server_time_pair_engine",
            "    ... with engine scoring and fresh reports (blocks taking turns with the default)",
            engine_spent / n,
            "s",
            baseline="default, same blocks",
            baseline_value=plain_spent / n,
            ratio=engine_spent / plain_spent,
            target=("<=", 1.15),
        ),
    ]


BATCH = 64


def batch_loop(lb: RedisLoadBalancer, k: int) -> Callable[[int], None]:
    """n pairs as acquire_many / release_many calls of k requests (what coalescing sends)."""

    def run(n: int) -> None:
        for lo in range(0, n, k):
            rids = [uuid.uuid4().hex for _ in range(min(k, n - lo))]
            grants = lb.acquire_many(rids)
            lb._run(
                lb._core.release_many(
                    [(sid, rid, None) for (sid, _), rid in zip(grants, rids, strict=True)]
                )
            )

    return run


def server_time(client: redis.Redis, work: Callable[[int], None], n: int) -> float:
    """Seconds Redis spent running scripts (FCALL or EVALSHA) while ``work(n)`` ran."""

    def spent() -> float:
        stats = client.info("commandstats")
        verbs = ("evalsha", "fcall", "fcall_ro", "eval")
        return float(sum(stats.get(f"cmdstat_{v}", {}).get("usec", 0) for v in verbs))

    before = spent()
    work(n)
    return (spent() - before) / 1e6
