"""``python -m benchmarks [--quick] [--json FILE] [--server-bin PATH] [--no-ray] [--only STEPS]``

Starts a private server (never the one on 6379), runs every comparison side by
side in this process, prints the table and optionally writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import redis
import redis.utils

from redis_router.local_server import (
    ENV_SERVER_BIN,
    LocalServer,
    ServerBinary,
    find_server_binaries,
    first_server_binary,
)

from . import batch, latency, memory, reaping, throughput
from .harness import Row, Sizes, table

STEPS = ("latency", "batch", "memory", "throughput", "reaping", "kv_lag")
ROW_IDS = (
    "pair_vs_noop",
    "pair_4096_vs_8",
    "server_time_pair",
    "server_time_pair_batched",
    "server_time_pair_capacity",
    "server_time_pair_engine",
    "capacity_pair_vs_default",
    "ejection_pair_vs_default",
    "engine_pair_vs_default",
    "batch_sync",
    "batch_async",
    "memory_sticky",
    "memory_string_ttl",
    "memory_hash_field",
    "memory_lease",
    "memory_release_record",
    "memory_release_record_doubled",
    "throughput_vs_ray",
    "throughput_vs_watch",
    "throughput_uncoalesced",
    "throughput_noop_round_trips",
    "watch_retry_rate",
    "reap_slowest_acquire",
    "kv_lag_p99",
    "kv_lag_p99_2_subscribers",
    "kv_lag_p99_vs_light_load",
    "kv_lag_p99_64_replicas",
    "kv_redis_cpu_per_event",
)
KV_LAG_ROWS = tuple(rid for rid in ROW_IDS if rid.startswith("kv_"))


def _kv_events_missing() -> str | None:
    """Why the kv_lag step cannot run here (its publishers need msgspec and pyzmq), else None."""
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or exc} is not installed (pip install -e '.[kv-events]')"
    return None


def _kv_lag(url: str, sizes: Sizes) -> list[Row]:
    from . import kv_lag  # imported here: msgspec and pyzmq are an extra

    return kv_lag.run(url, sizes)


def _binary(path: str | None) -> ServerBinary:
    if path is None:
        found = first_server_binary()
        if found is None:
            sys.exit("no redis-server / valkey-server found: install one or pass --server-bin")
        return found
    # Absolute (the server runs in its own directory) but not resolved: a link's name can
    # matter (Debian's redis-server links to redis-check-rdb, which runs as named).
    given = os.path.abspath(path)
    os.environ[ENV_SERVER_BIN] = given
    for b in find_server_binaries(refresh=True):
        if os.path.realpath(b.path) == os.path.realpath(given):
            return b
    sys.exit(f"--server-bin {path!r} is not a runnable redis-server / valkey-server")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test), ~20 s")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--server-bin", metavar="PATH", help="server binary (default: first found)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray actor comparison")
    ap.add_argument(
        "--only",
        metavar="STEPS",
        help=f"comma-separated subset of {','.join(STEPS)} (default: all)",
    )
    args = ap.parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes.default()
    only = set(args.only.split(",")) if args.only else set(STEPS)
    if only - set(STEPS):
        ap.error(f"--only: unknown step(s) {sorted(only - set(STEPS))}; choose from {STEPS}")
    binary = _binary(args.server_bin)
    started = time.time()
    skipped: dict[str, str] = {}
    if args.no_ray:
        skipped["throughput_vs_ray"] = "--no-ray"
    elif not throughput.ray_available():
        skipped["throughput_vs_ray"] = "ray is not installed (pip install -e '.[ray]')"
    kv_missing = _kv_events_missing() if "kv_lag" in only else None
    if kv_missing:
        only.discard("kv_lag")
        skipped.update(dict.fromkeys(KV_LAG_ROWS, kv_missing))
    print(
        f"server: {binary.label} ({binary.path}); hiredis: {redis.utils.HIREDIS_AVAILABLE}; "
        f"python {platform.python_version()}; {'quick' if args.quick else 'full'} sizes",
        flush=True,
    )
    rows: list[Row] = []
    with LocalServer(binary) as server:
        client = server.client(decode_responses=True)
        try:
            with_ray = "throughput_vs_ray" not in skipped
            for step, fn in (
                ("latency", lambda: latency.run(client, sizes)),
                (
                    "batch",
                    lambda: [batch.run_sync(client, sizes), batch.run_async(server.url, sizes)],
                ),
                ("memory", lambda: memory.run(client, sizes)),
                ("throughput", lambda: throughput.run(server.url, sizes, with_ray=with_ray)),
                ("reaping", lambda: reaping.run(client, sizes)),
                ("kv_lag", lambda: _kv_lag(server.url, sizes)),
            ):
                if step not in only:
                    continue
                t0 = time.time()
                got = fn()
                rows += got
                print(f"  {step}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        finally:
            client.close()
    print()
    print(table(rows))
    for rid, why in skipped.items():
        print(f"skipped {rid}: {why}")
    print(f"({time.time() - started:.0f} s)")
    if args.json:
        doc: dict[str, Any] = {
            "server": {"label": binary.label, "path": binary.path},
            "hiredis": redis.utils.HIREDIS_AVAILABLE,
            "redis_py": redis.__version__,
            "python": platform.python_version(),
            "quick": args.quick,
            "sizes": vars(sizes),
            "rows": [r.to_json() for r in rows],
            "skipped": skipped,
            "seconds": round(time.time() - started, 1),
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    failed = [r.id for r in rows if r.passed is False]
    return 1 if failed and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
