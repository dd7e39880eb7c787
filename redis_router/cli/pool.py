"""`redis-router servers|sessions|reap`: change the pool and its sessions while workers run.

Scaling a replica down without losing prefix-cache locality: ``servers drain`` it (no new
sessions, its sticky sessions keep going there), wait until ``status`` shows it drained,
``servers remove`` it. ``sessions clear`` forgets every sticky session; ``reap`` reclaims the
leases of worker processes that died (acquires and heartbeats take a few each; this takes the
rest at once, e.g. after a mass crash on an otherwise idle pool).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .. import dp, validation
from ..core import probation_wait
from .common import CliError, Handlers, open_balancer


def _servers_arguments(parser: argparse.ArgumentParser) -> None:
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
        help='JSON metadata returned to workers as the handle, e.g. \'{"url": "http://..."}\', '
        'or a plain URL (http://...), which every reader takes for {"url": URL}',
    )
    add.add_argument(
        "--capacity",
        type=int,
        default=None,
        metavar="N",
        help="requests the replica can hold, never exceeded (default: its metadata's "
        '"capacity", else no limit; registering without one lifts a capacity declared before)',
    )
    add.add_argument(
        "--sticky-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="pin this sticky_ttl if the balancer has none pinned yet (default: pin nothing; "
        "the first worker to acquire pins its own); a pinned one is kept",
    )
    for action, text in (
        ("remove", "take replicas out now; their in-flight requests' leases go with them"),
        ("drain", "send no new sessions to replicas; their sticky sessions still go there"),
        ("undrain", "let draining replicas take new sessions again"),
    ):
        p = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("ids", metavar="ID", nargs="+", help="replica id(s)")


def _servers(args: argparse.Namespace) -> int:
    if args.action == "add":
        return _add(args)
    with open_balancer(args, pool_wide=True) as b:
        states = {sid: r["draining"] for sid, r in b.status()["replicas"].items()}
        replicas = {dp.replica_of(sid)[0] for sid in states}  # a rank's replica (its id)
        unknown = [sid for sid in args.ids if sid not in states and sid not in replicas]
        if unknown:
            raise CliError(
                f"balancer {b.name!r} has no replica {', '.join(map(repr, unknown))} "
                f"(replicas: {', '.join(sorted(states)) or 'none'}); nothing was changed"
            )
        ids = list(dict.fromkeys(args.ids))
        if args.action == "remove":
            n = b.remove_servers(ids)
            print(f"removed {n} replica(s) from balancer {b.name!r}: {' '.join(ids)}")
        elif args.action == "drain":
            n = b.set_draining(ids, True)
            print(
                f"draining {' '.join(ids)} ({n} changed): no new sessions, sticky sessions "
                "still served; remove once `redis-router status` shows drained"
            )
        else:
            n = b.set_draining(ids, False)
            print(f"undrained {' '.join(ids)} ({n} changed): new sessions go there again")
    return 0


def _add(args: argparse.Namespace) -> int:
    validation.server_id(args.id, "replica id")  # named as the command line names it
    meta = _parse_meta(args.meta)
    with open_balancer(args, create=True, pool_wide=True) as b:
        capacity = None if args.capacity is None else {args.id: args.capacity}
        new = b.add_servers({args.id: meta}, capacity)
        if args.sticky_ttl is not None:
            b.pin_sticky_ttl(args.sticky_ttl)
        rows = b.status()["replicas"]
    units = sorted(
        (sid for sid in rows if sid == args.id or dp.replica_of(sid)[0] == args.id),
        key=lambda sid: dp.replica_of(sid)[1] or 0,
    )
    draining = any(rows[sid]["draining"] for sid in units)
    what = "added replica" if new else "updated the metadata of replica"
    ranks = ""
    if units != [args.id]:  # registered as its data-parallel ranks (redis_router.dp)
        ranks = f" as {len(units)} data-parallel ranks ({units[0]} ... {units[-1]})"
    note = " (still draining: `servers undrain` to take new sessions)" if draining else ""
    print(f"{what} {args.id!r}{ranks} to balancer {b.name!r}{note}")
    return 0


def _parse_meta(text: str) -> Any:
    """JSON, or a plain http(s) URL: registered as the library registers a URL string, which
    every reader takes for {"url": it} (validation.metadata)."""
    if text.startswith(validation.URL_SCHEMES):
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CliError(
            f"--meta is not valid JSON, nor an http:// or https:// URL ({exc}): {text[:60]!r}"
        ) from None


def _sessions_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser(
        "clear",
        help="forget every sticky session; each session's next turn is balanced anew",
        description="Forget every sticky session (e.g. after replicas lost their KV caches). "
        "Leases and in-flight counts are untouched.",
    )


def _sessions(args: argparse.Namespace) -> int:
    with open_balancer(args, pool_wide=True) as b:
        before = b.status()["sticky_sessions"]
        b.clear_sticky()
    print(f"cleared {before} sticky session(s) of balancer {b.name!r}")
    return 0


def _reap_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Reclaim now every lease of a worker process that died; each is reclaimed once, with "
        "its in-flight count. After a gap in heartbeats (a pause of Redis, or no process "
        "alive) the processes unheard during it are on probation first: `status` shows them "
        "unheard."
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="wait out such a probation (half the longest lease ttl in use: 10 s with the "
        "default lease_ttl; at most that plus 5 s), then reclaim the leases of the processes "
        "still unheard and forget them",
    )


def _reap(args: argparse.Namespace) -> int:
    with open_balancer(args, pool_wide=True) as b:
        n, limbo, listen = b.reap_all()
        if limbo > 0 and args.wait:
            # After a gap in heartbeats (a pause of Redis, or no process alive) the holders
            # unheard during it are on probation: wait it out, calling so Redis hears this.
            print(
                f"waiting {limbo:.1f}s: processes unheard during a gap in heartbeats are on "
                "probation",
                file=sys.stderr,
                flush=True,
            )
            until = time.monotonic() + limbo + 5.0
            while limbo > 0 and time.monotonic() < until:
                time.sleep(probation_wait(limbo, listen))
                more, limbo, listen = b.reap_all()
                n += more
        elif limbo > 0:
            print(
                f"{limbo:.1f}s of probation left for processes unheard during a gap in "
                "heartbeats: run again then, or with --wait",
                file=sys.stderr,
            )
    print(f"reclaimed {n} lease(s) of dead processes in balancer {b.name!r}")
    return 0


servers = Handlers(_servers_arguments, _servers)
sessions = Handlers(_sessions_arguments, _sessions)
reap = Handlers(_reap_arguments, _reap)
