"""``python -m benchmarks.script_ab REV [--fcall] [--calls N] [--batch 1,8] [--server-bin PATH]``
``python -m benchmarks.script_ab --paths [--calls N] [--batch 1,8] [--server-bin PATH]``

The acquire and release scripts of this checkout against those of git revision REV, call by
call on one private server: one balancer (this checkout's client) sends the same requests
through either version's scripts, alternating at every call, and the server's own record of
each call's duration (``SLOWLOG`` with a threshold of 0) is read per script. Two versions run
microseconds apart, so a machine whose speed drifts by tens of percent within a minute moves
both alike; ``benchmarks.ab`` (whole processes taking turns) cannot resolve a change of a few
percent there. For changes inside the scripts, not to their arguments: REV's scripts must take
the arguments this checkout's client sends. Where REV's scripts are this checkout's, the run is
an A/A one (REV's copy carries a trailing comment, so the two have their own hashes): its
ratios show what the method resolves.

Printed per script and batch size (requests per call): the server time per request for both
versions (``pair``: acquire and release added; ``wall``: the caller's time per request of a
pair, client and round trips included, with every command in the slow log; ``noop``: one
call of a script that returns at once, sent after each pair), and after /
before, as a trimmed mean (the slowest and fastest tenth of the calls left out: a call the
machine stalled says nothing of the script) and as the median (whole microseconds per call,
so coarse for single requests).

``--paths`` times this checkout's scripts sent by EVALSHA ("before") and by FCALL ("after",
Redis Functions) the same way, alternating at every call on one Redis 7+ or Valkey server. REV
mode sends both revisions' scripts by EVALSHA, or with ``--fcall`` both by FCALL, each as the
Functions library its own tree's loader makes (Redis 7+ or Valkey).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from redis_router import RedisLoadBalancer, scripts
from redis_router.local_server import LocalServer
from redis_router.scripts import Script

from .__main__ import _binary
from .compare import HERE, worktree

SCRIPTS = ("acquire", "release")
NOOP = scripts.from_source("noop", "-- Uses     lib/base\nreturn 1")
REPLICAS = 8
# Per script: its source and what its tree's loader makes of it for a Functions library
# (an older tree without a field gives its default: the whole source runs per call), as a
# default balancer of that tree sends it (composed without the optional parts, where the
# tree composes scripts per configuration).
_SOURCES = (
    "import json; from redis_router import scripts; "
    "off = frozenset(getattr(scripts, 'OPTIONAL', ())); "
    "load = lambda n: scripts.load(n, off) if off else scripts.load(n); "
    "print(json.dumps({n: [getattr(load(n), f, d) for f, d in "
    "(('source', ''), ('function', ''), ('read_only', False), ('allow_oom', False), "
    "('shared', ''), ('body', ''))] "
    f"for n in {SCRIPTS!r}}}))"
)


def sources(tree: Path) -> dict[str, Script]:
    """The scripts as that tree's loader assembles them (run in the tree, as its own code)."""
    out = subprocess.run(
        [sys.executable, "-c", _SOURCES],
        cwd=tree,
        env={"PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {
        name: Script(name, src, hashlib.sha1(src.encode()).hexdigest(), *rest)
        for name, (src, *rest) in json.loads(out).items()
    }


def _copy(script: Script) -> Script:
    """The same script under another hash and function name (a trailing comment), so that the
    server's record of each call says which copy ran."""
    note = "\n-- a copy, for an A/A run\n"
    src = script.source + note
    return Script(
        script.name,
        src,
        hashlib.sha1(src.encode()).hexdigest(),
        read_only=script.read_only,
        allow_oom=script.allow_oom,
        shared=script.shared,
        body=script.body + note if script.shared else "",
    )


def measure(
    url: str,
    versions: dict[str, dict[str, Script]],
    batch: int,
    calls: int,
    fcall: frozenset[str] = frozenset(),
) -> dict[tuple[str, str], list[float]]:
    """Server microseconds per request, by (script, version label); the versions labelled in
    ``fcall`` are sent by FCALL, the others by EVALSHA."""
    r = redis.Redis.from_url(url)
    r.flushall()
    for label, version in versions.items():
        for s in version.values():
            if label in fcall:
                r.function_load(s.library(), replace=True)
            else:
                r.script_load(s.source)
    of = {
        (s.function if label in fcall else s.sha): (name, label)
        for label, v in versions.items()
        for name, s in v.items()
    }
    if len(of) != len(SCRIPTS) * len(versions):
        raise SystemExit("the two revisions' scripts are identical: nothing to compare")
    spent: dict[tuple[str, str], list[float]] = {key: [] for key in of.values()}
    for label in versions:  # the caller's whole pair: client, round trips and server
        spent[("wall", label)] = []
    # The fixed cost of a call, per path (a copy for the second label: its own name).
    noop = {label: _copy(NOOP) if k else NOOP for k, label in enumerate(versions)}
    for label in versions if fcall else ():
        if label in fcall:
            r.function_load(noop[label].library(), replace=True)
        else:
            r.script_load(noop[label].source)
        spent[("noop", label)] = []
        of[noop[label].function if label in fcall else noop[label].sha] = ("noop", label)
    lb = RedisLoadBalancer({f"s{i}": f"http://h{i}" for i in range(REPLICAS)}, redis=url)
    core = lb._core  # the scripts it sends are swapped below: same client, same keys
    labels = list(versions)
    r.config_set("slowlog-max-len", 1_000_000)
    r.config_set("slowlog-log-slower-than", 0)

    def collect() -> None:
        for entry in r.slowlog_get(1_000_000):
            args = entry["command"].split()
            if args[0].upper() in (b"EVALSHA", b"FCALL") and args[1].decode() in of:
                name, label = of[args[1].decode()]
                spent[(name, label)].append(entry["duration"] / (1 if name == "noop" else batch))
        r.slowlog_reset()

    try:
        for k in range(calls):
            for label in labels if k % 2 == 0 else labels[::-1]:
                core._acquire, core._release = (
                    versions[label]["acquire"],
                    versions[label]["release"],
                )
                lb._scripts.functions = label in fcall
                rids = [uuid.uuid4().hex for _ in range(batch)]
                started = time.perf_counter()
                if batch == 1:
                    lb.release_server(lb.acquire_server(rids[0])[0], rids[0])
                else:
                    got = lb.acquire_many(rids)
                    ends = [(s, rid, None) for (s, _), rid in zip(got, rids, strict=True)]
                    lb._run(core.release_many(ends))
                spent[("wall", label)].append((time.perf_counter() - started) * 1e6 / batch)
                if label in fcall:
                    r.fcall(noop[label].function, 1, core.prefix)
                elif fcall:
                    r.evalsha(noop[label].sha, 1, core.prefix)
            if k % 200 == 199:
                collect()
        collect()
    finally:
        r.config_set("slowlog-log-slower-than", 10_000)
        lb.close()
    return spent


def trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """The mean of the values without the lowest and highest `cut` of them."""
    ordered = sorted(values)
    k = int(len(ordered) * cut)
    return statistics.mean(ordered[k : len(ordered) - k])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.script_ab", description=__doc__)
    ap.add_argument("rev", nargs="?", help="the git revision to compare with")
    ap.add_argument(
        "--paths", action="store_true", help="this checkout's scripts by EVALSHA vs by FCALL"
    )
    ap.add_argument(
        "--fcall", action="store_true", help="REV mode: both revisions by FCALL (Redis 7+)"
    )
    ap.add_argument("--calls", type=int, default=2000, help="calls per version and size")
    ap.add_argument("--batch", default="1,8", help="requests per call, comma separated")
    ap.add_argument("--server-bin", metavar="PATH", help="server binary (default: first found)")
    args = ap.parse_args(argv)
    if (args.rev is None) == (not args.paths):
        raise SystemExit("give a revision REV or --paths (not both)")
    try:
        sizes = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise SystemExit(f"--batch takes sizes such as 1,8; got {args.batch!r}") from None
    if not sizes or min(sizes) < 1 or args.calls < 1:
        raise SystemExit("--batch sizes and --calls must be at least 1")
    binary = _binary(args.server_bin)
    fcall: frozenset[str] = frozenset()
    if args.paths:
        off = frozenset(scripts.OPTIONAL)  # as a default balancer composes them
        mine = {n: scripts.load(n, off) for n in SCRIPTS}
        versions, fcall = {"before": mine, "after": mine}, frozenset({"after"})
        if binary.version_tuple < (7,):
            raise SystemExit(f"--paths needs Redis 7+ or Valkey (Functions); {binary.label}")
        compared = "before = EVALSHA, after = FCALL (this checkout's scripts)"
    else:
        with tempfile.TemporaryDirectory() as tmp, worktree(args.rev, Path(tmp) / "b") as before:
            versions = {"before": sources(before), "after": sources(HERE)}
        path = "FCALL" if args.fcall else "EVALSHA"
        compared = f"before = {args.rev}, after = this checkout ({path})"
        if args.fcall:
            if binary.version_tuple < (7,):
                raise SystemExit(f"--fcall needs Redis 7+ or Valkey (Functions); {binary.label}")
            fcall = frozenset({"before", "after"})
        same = [n for n in SCRIPTS if versions["before"][n].sha == versions["after"][n].sha]
        for n in same:  # an unchanged script is timed against a copy of itself
            versions["before"][n] = _copy(versions["before"][n])
        if same:
            compared += f" [the same {' and '.join(same)}: A/A, whose ratios are the noise]"
    with LocalServer(binary) as server:
        results = {b: measure(server.url, versions, b, args.calls, fcall) for b in sizes}
    print(f"{compared}; {binary.label}; {args.calls} calls each")
    print(f"{'script':<16} {'before':>16} {'after':>16} {'after/before':>14}")
    print(
        f"{'(us / request)':<16} {'trim.  median':>16} {'trim.  median':>16} {'trim. median':>14}"
    )
    for b, spent in results.items():
        for name in SCRIPTS:
            x, y = spent[(name, "before")], spent[(name, "after")]
            mx, my = trimmed_mean(x), trimmed_mean(y)
            dx, dy = statistics.median(x), statistics.median(y)
            print(
                f"{name + ' x' + str(b):<16} {mx:7.2f} {dx:7.2f}  {my:7.2f} {dy:7.2f}"
                f"  {my / mx:6.3f} {dy / dx:6.3f}"
            )
        # a pair: the acquire's and the release's figures added (each trimmed on its own)
        mx, my, dx, dy = (
            sum(f(spent[(n, label)]) for n in SCRIPTS)
            for f, label in (
                (trimmed_mean, "before"),
                (trimmed_mean, "after"),
                (statistics.median, "before"),
                (statistics.median, "after"),
            )
        )
        print(
            f"{'pair x' + str(b):<16} {mx:7.2f} {dx:7.2f}  {my:7.2f} {dy:7.2f}"
            f"  {my / mx:6.3f} {dy / dx:6.3f}"
        )
        for row in ("wall", "noop") if fcall else ("wall",):  # noop: per call, not request
            x, y = spent[(row, "before")], spent[(row, "after")]
            mx, my = trimmed_mean(x), trimmed_mean(y)
            dx, dy = statistics.median(x), statistics.median(y)
            print(
                f"{row + ' x' + str(b):<16} {mx:7.2f} {dx:7.2f}  {my:7.2f} {dy:7.2f}"
                f"  {my / mx:6.3f} {dy / dx:6.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
