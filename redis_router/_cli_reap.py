"""`redis-router reap`: reclaim expired leases now (their holders died or never released).

Acquires and releases already reclaim a few each; this takes the rest at once, e.g. after a
mass crash on an otherwise idle pool.
"""

from __future__ import annotations

import argparse

from ._cli_common import open_balancer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Reclaim every expired lease now; each is reclaimed once, with its in-flight count."
    )


def run(args: argparse.Namespace) -> int:
    with open_balancer(args) as lb:
        n = lb.reap()
    print(f"reclaimed {n} expired lease(s) of balancer {lb.name!r}")
    return 0
