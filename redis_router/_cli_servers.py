"""`redis-router servers add|remove|drain|undrain`: change the pool while workers run.

Scaling a replica down without losing prefix-cache locality: ``drain`` it (no new sessions,
its sticky sessions keep going there), wait until ``status`` shows it drained, ``remove`` it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._cli_common import DEFAULT_STICKY_TTL, CliError, open_balancer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = actions.add_parser(
        "add",
        help="register a replica (or update its metadata); it takes new sessions at once",
        description="Register a replica. An existing one keeps its load, leases and draining "
        "state; only its metadata is replaced.",
    )
    add.add_argument("id", metavar="ID", help="replica id, e.g. vllm-3")
    add.add_argument(
        "--meta",
        metavar="JSON",
        default="null",
        help='JSON metadata returned to workers as the handle, e.g. \'{"url": "http://..."}\'',
    )
    add.add_argument(
        "--sticky-ttl",
        type=float,
        default=DEFAULT_STICKY_TTL,
        metavar="SECONDS",
        help="only when this creates the balancer: the sticky_ttl to pin (default: "
        f"{DEFAULT_STICKY_TTL:g}, the library's default); an existing balancer keeps its own",
    )
    for action, text in (
        ("remove", "take replicas out now; their in-flight requests' leases go with them"),
        ("drain", "send no new sessions to replicas; their sticky sessions still go there"),
        ("undrain", "let draining replicas take new sessions again"),
    ):
        p = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("ids", metavar="ID", nargs="+", help="replica id(s)")


def run(args: argparse.Namespace) -> int:
    if args.action == "add":
        return _add(args)
    with open_balancer(args) as lb:
        states = {sid: r["draining"] for sid, r in lb.get_status()["replicas"].items()}
        unknown = [sid for sid in args.ids if sid not in states]
        if unknown:
            raise CliError(
                f"balancer {lb.name!r} has no replica {', '.join(map(repr, unknown))} "
                f"(replicas: {', '.join(sorted(states)) or 'none'}); nothing was changed"
            )
        ids = list(dict.fromkeys(args.ids))
        if args.action == "remove":
            n = lb.remove_servers(ids)
            print(f"removed {n} replica(s) from balancer {lb.name!r}: {' '.join(ids)}")
        elif args.action == "drain":
            n = lb.drain_servers(ids)
            print(
                f"draining {' '.join(ids)} ({n} changed): no new sessions, sticky sessions "
                "still served; remove once `redis-router status` shows drained"
            )
        else:
            n = lb.undrain_servers(ids)
            print(f"undrained {' '.join(ids)} ({n} changed): new sessions go there again")
    return 0


def _add(args: argparse.Namespace) -> int:
    meta = _parse_meta(args.meta)
    with open_balancer(args, create_sticky_ttl=args.sticky_ttl) as lb:
        new = lb.add_servers({args.id: meta})
        draining = lb.get_status()["replicas"][args.id]["draining"]
    what = "added replica" if new else "updated the metadata of replica"
    note = " (still draining: `servers undrain` to take new sessions)" if draining else ""
    print(f"{what} {args.id!r} to balancer {lb.name!r}{note}")
    return 0


def _parse_meta(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CliError(f"--meta is not valid JSON ({exc}): {text[:60]!r}") from None
