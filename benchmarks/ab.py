"""``python -m benchmarks.ab REV [--rounds N] [--seconds S] [--pairs N]``

Before and after, interleaved: this checkout against git revision REV on one private server,
the two trees taking turns run by run (order flipped every round), so that a machine whose
speed drifts by tens of percent within minutes (shared cores) moves both alike. Each run is a
fresh set of processes importing its tree's ``redis_router`` (through the public API only, so
any revision with ``acquire_server`` / ``release_server`` can be measured).

Measured per run, as the benchmark's rows (1) and (5) do:

- ``pair``: one process, sync, acquire + release with a new request id each time; wall time
  per pair, and the Redis server time per pair (``INFO commandstats``, every command);
- ``apair``: the same with an asyncio balancer, one session (the release not awaited, as a
  caller that goes on does): wall time and the process's CPU time per pair;
- ``ahttp``: as the peers benchmark's asyncio row: one asyncio session sends each request to a
  fake replica (benchmarks.peers_http), routed (acquire, the request, the release not awaited)
  and direct, in alternating blocks in one process; the p50 of each and the routed p50's excess;
- ``instructions``: the asyncio pair's client instructions, counted by valgrind's callgrind
  (user space only: not the kernel's part of a send, nor any waiting), the difference between
  runs of 1,200 and 200 pairs over 1,000. Instruction counts do not move with the machine's
  load, so this shows a change in the client's own work that wall times hide (within ~3 %:
  how replies fall into reads moves it a little);
- ``throughput``: 4 processes x 8 asyncio sessions (coalesced, then ``coalesce=False``);
  pairs per second, the processes' own CPU time per pair, and Redis's CPU time per pair
  (``INFO cpu``): on a machine whose cores the clients share with Redis, their sum is what
  bounds the rate.

The table shows each measure's median over the rounds for both trees, and the median of the
per-round ratios after / before (the load moves between rounds, less within one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from redis_router.local_server import LocalServer, first_server_binary

from .compare import HERE, worktree
from .peers_gateways import free_port
from .peers_http import FakeReplicas

NAME = "bench-ab"
REPLICAS = 8
PROCESSES = 4
SESSIONS = 8

# The code each tree runs (argv: URL, balancer name, then its own), public API only.
_SETUP = """
import sys
from redis_router import RedisLoadBalancer
url, name, urls = sys.argv[1], sys.argv[2], sys.argv[3:]
RedisLoadBalancer({f"s{i}": u for i, u in enumerate(urls)}, redis=url, name=name).close()
"""

_PAIR = """
import json, sys, time, uuid
from redis_router import RedisLoadBalancer
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
lb = RedisLoadBalancer(redis=url, name=name)
ids = [uuid.uuid4().hex for _ in range(n + 200)]
for rid in ids[:200]:  # warm: connection, scripts loaded
    lb.release_server(lb.acquire_server(rid)[0], rid)
print("ready", flush=True)
sys.stdin.readline()
t = time.perf_counter()
for rid in ids[200:]:
    lb.release_server(lb.acquire_server(rid)[0], rid)
print(json.dumps((time.perf_counter() - t) / n))
lb.close()
"""

_APAIR = """
import asyncio, json, sys, time, uuid
from redis_router import AsyncRedisLoadBalancer
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

async def main():
    async with AsyncRedisLoadBalancer(redis=url, name=name) as lb:
        ids = [uuid.uuid4().hex for _ in range(n + 200)]
        for rid in ids[:200]:  # warm: connections, scripts loaded
            lb.release_server((await lb.acquire_server(rid))[0], rid)
        t, cpu = time.perf_counter(), time.process_time()
        for rid in ids[200:]:
            lb.release_server((await lb.acquire_server(rid))[0], rid)
        return (time.perf_counter() - t) / n, (time.process_time() - cpu) / n

print(json.dumps(asyncio.run(main())))
"""

_AHTTP = """
import asyncio, json, statistics, sys, time, uuid
from redis_router import AsyncRedisLoadBalancer
from benchmarks.peers_http import AsyncClient, completion_body
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
urls = sys.argv[4:]
servers = {f"s{i}": u for i, u in enumerate(urls)}
BODY, PATH = completion_body("hello", 1), "/v1/completions"

async def main():
    client = AsyncClient()
    async with AsyncRedisLoadBalancer(redis=url, name=name) as lb:
        async def routed(k):
            rid = uuid.uuid4().hex
            sid, _ = await lb.acquire_server(rid)
            try:
                await client.post(servers[sid], PATH, BODY)
            finally:
                lb.release_server(sid, rid)

        async def direct(k):
            await client.post(urls[k % len(urls)], PATH, BODY)

        lat = {"routed": [], "direct": []}
        block = max(50, n // 6)
        for b in range(13):  # a warm-up block, then 6 of each, alternating
            for name_, fn in (("routed", routed), ("direct", direct))[:: 1 if b % 2 else -1]:
                for k in range(block):
                    t = time.perf_counter()
                    await fn(k)
                    if b:
                        lat[name_].append(time.perf_counter() - t)
        p50 = {k: statistics.median(v) * 1e6 for k, v in lat.items()}
        await client.close()
        return p50["routed"], p50["direct"]

print(json.dumps(asyncio.run(main())))
"""

_WORKER = """
import asyncio, json, sys, time, uuid
from redis_router import AsyncRedisLoadBalancer
url, name, start_at, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
coalesce, sessions = sys.argv[5] == "1", int(sys.argv[6])

async def main():
    async with AsyncRedisLoadBalancer(redis=url, name=name, coalesce=coalesce) as lb:
        sid, _ = await lb.acquire_server("warm-" + uuid.uuid4().hex)
        await lb.release_server(sid, None)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu, deadline = time.process_time(), start_at + seconds

        async def session():
            n = 0
            while time.time() < deadline:
                rid = uuid.uuid4().hex
                sid, _ = await lb.acquire_server(rid)
                await lb.release_server(sid, rid)
                n += 1
            return n

        pairs = sum(await asyncio.gather(*(session() for _ in range(sessions))))
        return pairs, time.process_time() - cpu

print(json.dumps(asyncio.run(main())))
"""


def _python(tree: Path, code: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=tree, env=env, text=True, **kw)


def _redis_cpu(r: redis.Redis) -> float:
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _server_usec(r: redis.Redis) -> float:
    scripts = ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_eval")
    return float(sum(v["usec"] for k, v in r.info("commandstats").items() if k in scripts))


def pair(tree: Path, r: redis.Redis, url: str, n: int) -> dict[str, float]:
    proc = _python(tree, _PAIR, url, NAME, str(n), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdout.readline()  # "ready"
    r.config_resetstat()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    wall = json.loads(proc.stdout.readline())
    usec = _server_usec(r)
    proc.wait()
    return {"pair_us": wall * 1e6, "pair_redis_us": usec / n}


def apair(tree: Path, url: str, n: int) -> dict[str, float]:
    proc = _python(tree, _APAIR, url, NAME, str(n), stdout=subprocess.PIPE)
    wall, cpu = json.loads(proc.communicate()[0])
    return {"apair_us": wall * 1e6, "apair_client_cpu_us": cpu * 1e6}


def instructions(tree: Path, url: str) -> dict[str, float]:
    counts = []
    for n in (200, 1200):
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        argv += [sys.executable, "-c", _APAIR, url, NAME, str(n)]
        env = dict(os.environ, PYTHONPATH=str(tree))
        out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True)
        found = re.search(r"Collected : (\d+)", out.stderr)
        if found is None:
            raise RuntimeError(f"callgrind printed no count: {out.stderr[-300:]}")
        counts.append(int(found.group(1)))
    return {"apair_instructions": (counts[1] - counts[0]) / 1000}


def ahttp(tree: Path, url: str, n: int, urls: list[str]) -> dict[str, float]:
    proc = _python(tree, _AHTTP, url, NAME, str(n), *urls, stdout=subprocess.PIPE)
    routed, direct = json.loads(proc.communicate()[0])
    return {"ahttp_p50_us": routed, "ahttp_added_p50_us": routed - direct}


def throughput(
    tree: Path, r: redis.Redis, url: str, seconds: float, coalesce: bool
) -> dict[str, float]:
    tag = "tp" if coalesce else "tp_solo"
    start = time.time() + 1.5
    procs = [
        _python(
            tree,
            _WORKER,
            url,
            NAME,
            str(start),
            str(seconds),
            "1" if coalesce else "0",
            str(SESSIONS),
            stdout=subprocess.PIPE,
        )
        for _ in range(PROCESSES)
    ]
    time.sleep(max(0.0, start - time.time()))
    cpu0 = _redis_cpu(r)
    outs = [json.loads(p.communicate()[0]) for p in procs]
    cpu1 = _redis_cpu(r)
    pairs = sum(o[0] for o in outs)
    return {
        f"{tag}_per_s": pairs / seconds,
        f"{tag}_client_cpu_us": 1e6 * sum(o[1] for o in outs) / pairs,
        f"{tag}_redis_cpu_us": 1e6 * (cpu1 - cpu0) / pairs,
    }


def measure(
    tree: Path, r: redis.Redis, url: str, args: argparse.Namespace, urls: list[str]
) -> dict[str, float]:
    out: dict[str, float] = {}
    if "pair" in args.only:
        out.update(pair(tree, r, url, args.pairs))
    if "apair" in args.only:
        out.update(apair(tree, url, args.pairs))
    if "ahttp" in args.only:
        out.update(ahttp(tree, url, args.pairs, urls))
    if "instructions" in args.only:
        out.update(instructions(tree, url))
    if "throughput" in args.only:
        out.update(throughput(tree, r, url, args.seconds, True))
        out.update(throughput(tree, r, url, args.seconds, False))
    return out


MEASURES = ("pair", "apair", "ahttp", "instructions", "throughput")
UNITS = {"_per_s": "/s", "_us": " us", "_instructions": ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
    ap.add_argument("rev", help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=6, help="runs of each tree (default 6)")
    ap.add_argument("--seconds", type=float, default=5.0, help="one throughput run (default 5)")
    ap.add_argument("--pairs", type=int, default=3000, help="pairs of one pair run (default 3000)")
    ap.add_argument(
        "--only",
        default=",".join(m for m in MEASURES if m != "instructions"),
        help=f"comma-separated measures of {', '.join(MEASURES)} (default: all but instructions)",
    )
    args = ap.parse_args(argv)
    args.only = set(args.only.split(","))
    if "instructions" in args.only and shutil.which("valgrind") is None:
        ap.error("--only instructions needs valgrind on PATH")
    if unknown := args.only - set(MEASURES):
        ap.error(f"--only: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(MEASURES)}")
    binary = first_server_binary()
    if binary is None:
        raise SystemExit("no redis-server / valkey-server found (see redis_router.local_server)")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalServer(binary) as server,
        worktree(args.rev, Path(tmp) / "before") as before,
        contextlib.ExitStack() as stack,
    ):
        urls = [f"http://h{i}" for i in range(REPLICAS)]  # never reached but by ahttp
        if "ahttp" in args.only:
            replicas = FakeReplicas([free_port() for _ in range(REPLICAS)])
            stack.callback(replicas.close)
            urls = replicas.urls
        trees = {"before": before, "after": HERE}
        r = redis.Redis.from_url(server.url, decode_responses=True)
        _python(HERE, _SETUP, server.url, NAME, *urls).wait()  # one pool for both
        for k in range(args.rounds):
            order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
            for label in order:
                runs[label].append(measure(trees[label], r, server.url, args, urls))
                print(f"  round {k + 1}: {label} {runs[label][-1]}", file=sys.stderr, flush=True)
    print(
        f"before = {args.rev}, after = this checkout; {binary.label}; "
        f"{args.rounds} interleaved rounds, medians"
    )
    print(f"{'measure':<28} {'before':>12} {'after':>12} {'after/before':>13}")
    for key in runs["after"][0]:
        b = statistics.median(run[key] for run in runs["before"])
        a = statistics.median(run[key] for run in runs["after"])
        ratio = statistics.median(
            x[key] / y[key] for x, y in zip(runs["after"], runs["before"], strict=True)
        )
        unit = next(u for suffix, u in UNITS.items() if key.endswith(suffix))
        print(f"{key:<28} {b:>10,.1f}{unit:<2} {a:>10,.1f}{unit:<2} {ratio:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
