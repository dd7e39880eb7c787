"""Target 5: 4 worker processes x 8 concurrent asyncio sessions, acquire + release pairs.

redis-router (AsyncRedisLoadBalancer, one client per process, coalescing on as by default;
also measured with coalesce=False) against the verl-style
balancer in one Ray actor (workers are Ray actors, as verl's AgentLoopWorkers) and against
WATCH/MULTI optimistic transactions over the same Redis. Every session routes a new
request id per pair. The systems take turns, `runs` times; the ratio is the median of the
per-run ratios. Workers start together at an agreed wall-clock instant.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from redis_router import RedisLoadBalancer

from .harness import Row, Sizes, median
from .latency import servers

PROCESSES = 4
CONCURRENCY = 8
REPLICAS = 8
NAME = "bench-tp"
START_DELAY = 1.5  # seconds for every worker to connect and warm up before the start


def _router_worker(
    url: str, start_at: float, seconds: float, coalesce: bool = True
) -> tuple[int, int]:
    from redis_router import AsyncRedisLoadBalancer

    async def main() -> tuple[int, int]:
        async with AsyncRedisLoadBalancer(redis=url, name=NAME, coalesce=coalesce) as lb:
            sid, _ = await lb.acquire_server("warm-" + uuid.uuid4().hex)
            await lb.release_server(sid, None)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            deadline = start_at + seconds

            async def session() -> int:
                pairs = 0
                while time.time() < deadline:
                    rid = uuid.uuid4().hex
                    sid, _ = await lb.acquire_server(rid)
                    await lb.release_server(sid, rid)
                    pairs += 1
                return pairs

            done = await asyncio.gather(*(session() for _ in range(CONCURRENCY)))
            return sum(done), 0

    return asyncio.run(main())


def _solo_worker(url: str, start_at: float, seconds: float) -> tuple[int, int]:
    return _router_worker(url, start_at, seconds, coalesce=False)


def _noop_worker(url: str, start_at: float, seconds: float) -> tuple[int, int]:
    """Reference: two no-op EVALSHA per pair, one round trip each, through a client made as
    the balancer makes its own (same options, same retry policy)."""
    from redis_router.connection import connect

    async def main() -> tuple[int, int]:
        client = connect(url, asyncio=True)
        sha = await client.script_load("return 1")
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = start_at + seconds

        async def session() -> int:
            pairs = 0
            while time.time() < deadline:
                await client.evalsha(sha, 1, NAME)
                await client.evalsha(sha, 1, NAME)
                pairs += 1
            return pairs

        done = sum(await asyncio.gather(*(session() for _ in range(CONCURRENCY))))
        await client.aclose()
        return done, 0

    return asyncio.run(main())


def _watch_worker(url: str, start_at: float, seconds: float) -> tuple[int, int]:
    import redis.asyncio

    from benchmarks.naive import WatchMultiBalancer

    async def main() -> tuple[int, int]:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        lb = WatchMultiBalancer(client, NAME)
        await lb.release_server(await lb.acquire_server("warm-" + uuid.uuid4().hex))
        lb.retries = 0
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = start_at + seconds

        async def session() -> int:
            pairs = 0
            while time.time() < deadline:
                sid = await lb.acquire_server(uuid.uuid4().hex)
                await lb.release_server(sid)
                pairs += 1
            return pairs

        done = sum(await asyncio.gather(*(session() for _ in range(CONCURRENCY))))
        await client.aclose()
        return done, lb.retries

    return asyncio.run(main())


def _nap(seconds: float) -> int:
    time.sleep(seconds)
    return 0


class Systems:
    """The three systems under test, set up once and run in turns."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pool = ProcessPoolExecutor(PROCESSES, mp_context=multiprocessing.get_context("spawn"))
        list(self.pool.map(_nap, [0.3] * PROCESSES))  # start every worker process now
        self.ray: Any = None
        self.ray_workers: list[Any] = []

    def setup(self, with_ray: bool) -> None:
        lb = RedisLoadBalancer(servers(REPLICAS), redis=self.url, name=NAME)
        lb.close()
        if with_ray:
            import ray

            from .verl_actor import AgentLoopWorker, GlobalRequestLoadBalancer

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            self.ray = ray
            balancer = GlobalRequestLoadBalancer.remote(servers(REPLICAS))
            self.ray_workers = [AgentLoopWorker.remote(balancer) for _ in range(PROCESSES)]
            ray.get([w.ready.remote() for w in self.ray_workers])

    async def _watch_setup(self) -> None:
        import redis.asyncio

        from .naive import WatchMultiBalancer

        client = redis.asyncio.Redis.from_url(self.url, decode_responses=True)
        await WatchMultiBalancer(client, NAME).add_servers(list(servers(REPLICAS)))
        await client.aclose()

    def run(self, system: str, seconds: float) -> tuple[float, int, int]:
        """(pairs per second, pairs, retries) of one run."""
        start_at = time.time() + START_DELAY
        if system == "ray":
            pairs = sum(
                self.ray.get(
                    [w.run.remote(start_at, seconds, CONCURRENCY) for w in self.ray_workers]
                )
            )
            return pairs / seconds, pairs, 0
        fn = {
            "router": _router_worker,
            "solo": _solo_worker,
            "watch": _watch_worker,
            "noop": _noop_worker,
        }[system]
        futures = [self.pool.submit(fn, self.url, start_at, seconds) for _ in range(PROCESSES)]
        done = [f.result() for f in futures]
        pairs, retries = sum(d[0] for d in done), sum(d[1] for d in done)
        return pairs / seconds, pairs, retries

    def close(self) -> None:
        self.pool.shutdown()
        if self.ray is not None:
            self.ray.shutdown()


def _per_run_ratio(systems: list[float], baselines: list[float]) -> float:
    """Median of the ratios of runs made in the same turn (the load moves between turns)."""
    return median([a / b for a, b in zip(systems, baselines, strict=True)])


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def run(url: str, sizes: Sizes, *, with_ray: bool = True) -> list[Row]:
    with_ray = with_ray and ray_available()
    systems = Systems(url)
    try:
        systems.setup(with_ray)
        asyncio.run(systems._watch_setup())
        order = ["router", "solo", "noop", "watch", *(["ray"] if with_ray else [])]
        rates: dict[str, list[float]] = {s: [] for s in order}
        pairs = retries = 0
        for r in range(sizes.throughput_runs):
            for system in order[r % len(order) :] + order[: r % len(order)]:
                rate, n, retried = systems.run(system, sizes.seconds)
                rates[system].append(rate)
                if system == "watch":
                    pairs, retries = pairs + n, retries + retried
    finally:
        systems.close()
    router = rates["router"]
    shape = f"{PROCESSES} processes x {CONCURRENCY} asyncio sessions, {REPLICAS} replicas"
    rows = []
    if with_ray:
        rows.append(
            Row(
                "throughput_vs_ray",
                "(5) throughput, redis-router vs verl Ray actor",
                median(router),
                "pairs/s",
                baseline="Ray actor",
                baseline_value=median(rates["ray"]),
                ratio=_per_run_ratio(router, rates["ray"]),
                target=(">=", 10),
                note=shape + "; the actor's release is fire-and-forget, as in verl",
            )
        )
    rows.append(
        Row(
            "throughput_vs_watch",
            "(5) throughput, redis-router vs WATCH/MULTI (no Lua)",
            median(router),
            "pairs/s",
            baseline="WATCH/MULTI",
            baseline_value=median(rates["watch"]),
            ratio=_per_run_ratio(router, rates["watch"]),
            note=shape if not with_ray else "",
        )
    )
    against = "ray" if with_ray else "watch"
    rows.append(
        Row(
            "throughput_uncoalesced",
            "    redis-router with coalesce=False (a round trip per call)",
            median(rates["solo"]),
            "pairs/s",
            baseline="Ray actor" if with_ray else "WATCH/MULTI",
            baseline_value=median(rates[against]),
            ratio=_per_run_ratio(rates["solo"], rates[against]),
        )
    )
    rows.append(
        Row(
            "throughput_noop_round_trips",
            "    2 no-op EVALSHA per pair, a round trip each, same clients",
            median(rates["noop"]),
            "pairs/s",
            baseline="redis-router",
            baseline_value=median(router),
            ratio=_per_run_ratio(rates["noop"], router),
            note="what a round trip per call allows here; ratio = this / redis-router",
        )
    )
    rows.append(
        Row(
            "watch_retry_rate",
            "    WATCH/MULTI retries per successful acquire",
            100.0 * retries / max(1, pairs),
            "%",
            extra={"pairs": pairs, "retries": retries},
        )
    )
    return rows
