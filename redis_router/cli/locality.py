"""`redis-router owner | bump-weight-version`: what RL trainers ask of the balancer.

``bump-weight-version`` runs after a weight update: every replica's KV cache is stale, so
every record of what the replicas hold is dropped at once for all workers (the prefix index,
group placements, the locality keys policies declared; ``--sticky``: sticky sessions too),
whatever the balancer's policy; in-flight counts and leases are untouched.

An RL trainer that cancels one rollout (a straggler, a sample whose group already finished)
must send the abort to the replica generating it; ``owner RID`` prints that replica's id (and
its metadata) from the request's live lease, or exits 1 when no replica serves it. Reads only.
"""

from __future__ import annotations

import argparse
import json

from .common import Handlers, open_balancer


def _owner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the replica serving request RID now (it holds a live lease of it), and its "
        "metadata; exit status 1 when no replica does. Reads only."
    )
    parser.add_argument("rid", metavar="RID", help="the request id given to acquire")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def _owner(args: argparse.Namespace) -> int:
    with open_balancer(args, pool_wide=True) as b:
        owner, meta = b.request_owner(args.rid)
    if args.json:
        print(json.dumps({"request_id": args.rid, "replica": owner, "metadata": meta}))
    elif owner is None:
        print(f"no replica of balancer {b.name!r} serves request {args.rid!r} now")
    else:
        extra = "" if meta is None else "  " + json.dumps(meta, separators=(",", ":"))
        print(f"{owner}{extra}")
    return 0 if owner is not None else 1


def _bump_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Drop every cache-locality record of the balancer (prefix index, group placements, "
        "policies' locality keys) in one atomic call, for every worker; leases and in-flight "
        "counts stay. Run it after the replicas load new weights."
    )
    parser.add_argument(
        "--sticky", action="store_true", help="forget the sticky sessions too (default: keep)"
    )


def _bump(args: argparse.Namespace) -> int:
    with open_balancer(args, pool_wide=True) as b:
        got = b.bump(args.sticky)
    print(
        f"balancer {b.name!r}: weight version {got['weight_version']}; dropped "
        f"{got['locality_keys_dropped']} locality key(s) and {got['sticky_entries_forgotten']} "
        "sticky session(s)"
    )
    return 0


owner = Handlers(_owner_arguments, _owner)
bump = Handlers(_bump_arguments, _bump)
