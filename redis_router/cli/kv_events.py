"""`redis-router kv-events`: keep the exact KV-block index from every replica's KV-cache events.

Follows each replica registered under the balancer whose metadata names a publisher
(``kv_events``), picking up added and removed ones, until Ctrl-C or SIGTERM. Several may run at
once; none is needed for routing. Needs the kv-events extra (msgspec, pyzmq).
"""

from __future__ import annotations

import argparse
import logging

from ..connection import redact
from .common import CliError, open_balancer, url_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "A replica's metadata names its publisher: "
        '{"kv_events": "tcp://HOST:5557", "kv_events_replay": "tcp://HOST:5565"} (or lists, '
        "one per data-parallel rank). See docs/kv_events.md. Needs: pip install msgspec "
        "pyzmq."
    )
    parser.add_argument(
        "--stale",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a replica stops counting as exact this long after the last subscriber vouched "
        "for it (default: 10)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between reads of the pool for added and removed replicas (default: 2)",
    )
    parser.add_argument(
        "--max-blocks",
        type=int,
        default=1 << 20,
        metavar="N",
        help="blocks indexed per replica and dp rank at most (default: 1048576)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log every gap and replay")


def run(args: argparse.Namespace) -> int:
    try:
        from ..kv_events import KVEventSubscriber
    except ImportError:
        raise CliError(
            "kv-events needs msgspec and pyzmq (the kv-events extra): pip install msgspec pyzmq"
        ) from None
    for value, flag in ((args.stale, "--stale"), (args.poll, "--poll")):
        if not value > 0:
            raise CliError(f"{flag} must be > 0 seconds, got {value:g}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="redis-router kv-events: %(message)s",
    )
    with open_balancer(args) as balancer:
        sub = KVEventSubscriber(
            balancer.client,
            balancer.name,
            stale=args.stale,
            poll=args.poll,
            heartbeat=min(1.0, args.stale / 3),
            max_blocks=args.max_blocks,
        )
        sub.on_change = lambda text: print(text, flush=True)
        try:  # from the first line out, Ctrl-C or SIGTERM is a clean stop
            print(
                f"keeping the KV-block index of balancer {balancer.name!r} at "
                f"{redact(url_of(args))} (Ctrl-C to stop)",
                flush=True,
            )
            sub.run()
        except KeyboardInterrupt:
            return 0
        finally:
            sub.close()
    return 0
