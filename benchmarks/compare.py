"""``python -m benchmarks.compare REV [--rounds N] [--only STEPS] [--quick]``

Before and after in one run: the benchmark of this checkout and of git revision REV (checked
out into a temporary worktree), alternately, ``--rounds`` times each, on the same server
binary. Each run is a subprocess importing that tree's ``redis_router``; the table shows each
row's median over the rounds for both, and after/before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .harness import fmt_value

HERE = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(rev: str, into: Path) -> Iterator[Path]:
    """Git revision ``rev`` checked out at ``into`` for the block, removed after it."""
    subprocess.run(
        ["git", "-C", str(HERE), "worktree", "add", "--detach", str(into), rev],
        check=True,
        capture_output=True,
    )
    try:
        yield into
    finally:
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "remove", "--force", str(into)],
            capture_output=True,
        )


def _run(tree: Path, steps: str, quick: bool, out: Path) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "benchmarks", "--only", steps, "--json", str(out)]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"benchmark in {tree} failed:\n{proc.stdout}\n{proc.stderr}")
    return {row["id"]: row for row in json.loads(out.read_text())["rows"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__)
    ap.add_argument("rev", help="the git revision to compare with (e.g. HEAD~3, a tag)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree (default 2)")
    ap.add_argument("--only", default="latency,throughput", help="benchmark steps to run")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp, worktree(args.rev, Path(tmp) / "before") as base:
        for r in range(args.rounds):
            order = [("before", base), ("after", HERE)]
            for label, tree in order if r % 2 == 0 else reversed(order):
                out = Path(tmp) / f"{label}-{r}.json"
                runs[label].append(_run(tree, args.only, args.quick, out))
                print(f"  round {r + 1}: {label} done", file=sys.stderr, flush=True)
    ids = [i for i in runs["after"][0] if all(i in run for run in runs["before"])]
    print(f"before = {args.rev}, after = this checkout; medians of {args.rounds} run(s) each")
    print(f"{'row':<42} {'before':>14} {'after':>14} {'after/before':>13}")
    for rid in ids:
        for key, label in (("value", ""), ("ratio", " (ratio)")):
            before = [run[rid][key] for run in runs["before"] if run[rid].get(key) is not None]
            after = [run[rid][key] for run in runs["after"] if run[rid].get(key) is not None]
            if not before or not after:
                continue
            b, a = statistics.median(before), statistics.median(after)
            unit = runs["after"][0][rid]["unit"]
            shown = f"{rid}{label}"
            print(f"{shown:<42} {_fmt(b, unit, key):>14} {_fmt(a, unit, key):>14} {a / b:>12.2f}x")
    return 0


def _fmt(value: float, unit: str, key: str) -> str:
    return f"{value:.2f}x" if key == "ratio" else fmt_value(value, unit)


if __name__ == "__main__":
    sys.exit(main())
