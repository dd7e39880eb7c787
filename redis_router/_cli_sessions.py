"""`redis-router sessions clear`: forget every sticky session of the balancer."""

from __future__ import annotations

import argparse

from ._cli_common import open_balancer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser(
        "clear",
        help="forget every sticky session; each session's next turn is balanced anew",
        description="Forget every sticky session (e.g. after replicas lost their KV caches). "
        "Leases and in-flight counts are untouched.",
    )


def run(args: argparse.Namespace) -> int:
    with open_balancer(args) as lb:
        before = lb.get_status()["sticky_sessions"]
        lb.clear_sticky_cache()
    print(f"cleared {before} sticky session(s) of balancer {lb.name!r}")
    return 0
