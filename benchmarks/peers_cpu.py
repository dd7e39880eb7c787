"""The peers benchmark's CPU measure: CPU time per routed request, every process counted.

A request routed by the library costs CPU in the caller's process (the acquire, the release,
the keeper) and in Redis (the scripts); a request through a gateway costs CPU in the gateway's
process (and, for ``redis-router serve``, in Redis). Wall time on a shared 2-core machine
swings 2-4x; CPU time barely moves, so this is the comparison noise cannot decide. The
requests are the latency measure's, each row interleaved with its direct request through the
same HTTP client; per request:

- the caller's process: its CPU (every thread, ``/proc/self/task/*/schedstat``, nanoseconds)
  minus the direct request's;
- Redis: ``INFO cpu`` (user + system) minus the direct request's;
- a gateway or front: its process's CPU (every thread of it and of its children).

The row's CPU is their sum. The fake replicas' process serves every row alike and is not
counted.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Sequence
from typing import Any

import redis


def process_cpu_ns(pid: int | str, children: bool = False) -> int:
    """CPU time of every thread of process ``pid`` ("self": this one), in nanoseconds; with
    ``children``, of its child processes' too (a gateway started through a wrapper)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    if children:
        for path in glob.glob(f"/proc/{pid}/task/*/children"):
            try:
                with open(path) as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            total += sum(process_cpu_ns(k, True) for k in kids)
    return total


def redis_cpu_ns(client: redis.Redis) -> int:
    info = client.info("cpu")
    return round((float(info["used_cpu_user"]) + float(info["used_cpu_sys"])) * 1e9)


async def measure(
    sync: dict[str, Callable[[], Any]],
    asyncio: dict[str, Callable[[], Any]],
    base: dict[str, str],
    pids: dict[str, int],
    redis_url: str,
    sizes: Any,
    reps: int,
    rotated: Callable[[Sequence[str], int], list[str]],
) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Per row of ``base`` (a row -> its direct request), per repetition: ``cpu_us``,
    ``client_us``, ``redis_us`` and, for a row of ``pids`` (a row -> its gateway's process),
    ``gateway_us``. Also the rows that failed, and why."""
    rinfo = redis.Redis.from_url(redis_url)
    names = [*sync, *asyncio]
    spent: dict[str, list[tuple[int, int, int]]] = {k: [] for k in names}
    failed: dict[str, str] = {}

    def read(name: str) -> tuple[int, int, int]:
        pid = pids.get(name)
        gateway = process_cpu_ns(pid, children=True) if pid is not None else 0
        return process_cpu_ns("self"), redis_cpu_ns(rinfo), gateway

    try:
        for rep in range(reps):
            for name in rotated(names, rep):
                if name in failed:
                    continue
                try:
                    for k in range(sizes.warmup + sizes.requests):
                        if k == sizes.warmup:
                            before = read(name)
                        await asyncio[name]() if name in asyncio else sync[name]()
                    after = read(name)
                except Exception as exc:  # a gateway that fails mid-run: its row says why
                    failed[name] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                spent[name].append(
                    (after[0] - before[0], after[1] - before[1], after[2] - before[2])
                )
    finally:
        rinfo.close()
    n = sizes.requests
    out: dict[str, dict[str, list[float]]] = {}
    for name, direct in base.items():
        if name in failed or direct in failed or name not in spent:
            continue
        pairs = list(zip(spent[name], spent[direct], strict=True))
        client = [(r[0] - d[0]) / n / 1e3 for r, d in pairs]
        server = [(r[1] - d[1]) / n / 1e3 for r, d in pairs]
        gateway = [r[2] / n / 1e3 for r, _ in pairs]
        out[name] = {
            "cpu_us": [sum(x) for x in zip(client, server, gateway, strict=True)],
            "client_us": client,
            "redis_us": server,
        }
        if name in pids:
            out[name]["gateway_us"] = gateway
    return out, failed
