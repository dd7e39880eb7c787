"""`redis-router demo`: many worker processes, one balancer, and the avalanche it prevents.

Worker processes (multiprocessing, spawn) run multi-turn agent sessions against simulated
replicas: each turn acquires the session's request id, "generates" for a random service time,
releases, then the agent "thinks" before its next turn. Concurrency stays below the replica
count, so the pool is often idle and a new session usually meets a tie between idle replicas.

The same workload runs twice: with the library's uniform random tie-break, and with verl's old
``candidates[0]`` (an RNG that always yields 0, i.e. rank 0 among the tied replicas). With the
old rule every idle tie goes to the first replica and sticky sessions keep their later turns
there: new sessions avalanche onto one replica while the rest of the pool idles.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..balancer import RedisLoadBalancer
from ..cli.common import CliError
from ..local_server import given_or_private_redis

MODES = {"random": "random tie-break (new)", "first": "first candidate (old)"}
# How long to wait for spawned workers to import the library and connect.
WORKER_START_TIMEOUT = 60.0
SAMPLE_EVERY = 0.1  # seconds between live-view samples of the balancer
LINE_EVERY = 1.0  # seconds between progress lines when stdout is not a terminal


class FirstCandidate(random.Random):
    """Tie-break entropy that is always 0: rank 0 among the least loaded, as verl's
    ``candidates[0]`` did before the fix (and Lua's math.random on Redis 6.2 would)."""

    def getrandbits(self, k: int) -> int:
        return 0


@dataclass(frozen=True)
class Workload:
    replicas: int
    workers: int
    sessions: int
    turns: int
    service: tuple[float, float]
    think: tuple[float, float]
    seed: int

    def replica_ids(self) -> list[str]:
        width = len(str(self.replicas - 1))
        return [f"r{i:0{width}d}" for i in range(self.replicas)]


@dataclass(frozen=True)
class WorkerTask:
    url: str
    name: str
    mode: str
    index: int
    sessions: tuple[str, ...]
    work: Workload


# One turn as a worker saw it: session, turn, replica, sticky?, start and end (monotonic s).
Turn = tuple[str, int, str, bool, float, float]


@dataclass
class RunResult:
    mode: str
    replicas: list[str]
    turns: list[Turn] = field(default_factory=list)
    t0: float = 0.0
    duration: float = 0.0

    def sessions(self) -> dict[str, int]:
        out = dict.fromkeys(self.replicas, 0)
        for _, turn, rid, _, _, _ in self.turns:
            if turn == 0:
                out[rid] += 1
        return out

    def requests(self) -> dict[str, int]:
        out = dict.fromkeys(self.replicas, 0)
        for t in self.turns:
            out[t[2]] += 1
        return out

    def peaks(self) -> dict[str, int]:
        """Exact peak in-flight per replica, by a sweep over the turns' intervals."""
        out = dict.fromkeys(self.replicas, 0)
        for rid, series in self.series().items():
            out[rid] = max((n for _, n in series), default=0)
        return out

    def series(self) -> dict[str, list[tuple[float, int]]]:
        """In-flight per replica over time: (seconds since start, count) at each change."""
        events: dict[str, list[tuple[float, int]]] = {rid: [] for rid in self.replicas}
        for _, _, rid, _, start, end in self.turns:
            events[rid] += [(start - self.t0, 1), (end - self.t0, -1)]
        out = {}
        for rid, evs in events.items():
            n, points = 0, [(0.0, 0)]
            for t, d in sorted(evs, key=lambda e: (e[0], e[1])):  # a release first on a tie
                n += d
                points.append((t, n))
            out[rid] = points
        return out

    def sticky_hit_rate(self) -> float:
        later = [t for t in self.turns if t[1] > 0]
        return sum(t[3] for t in later) / len(later) if later else 1.0

    def summary(self) -> dict[str, Any]:
        sessions, peaks = self.sessions(), self.peaks()
        return {
            "tie_break": self.mode,
            "sessions": sessions,
            "requests": self.requests(),
            "peak_inflight": peaks,
            "balance_sessions": _max_over_mean(sessions),
            "balance_peak_inflight": _max_over_mean(peaks),
            "idle_replicas": sum(n == 0 for n in sessions.values()),
            "sticky_hit_rate": self.sticky_hit_rate(),
            "seconds": round(self.duration, 2),
        }


def _max_over_mean(values: dict[str, int]) -> float:
    mean = sum(values.values()) / len(values) if values else 0
    return round(max(values.values()) / mean, 2) if mean else 0.0


# -- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run simulated multi-turn agent sessions from several worker processes through one "
        "balancer, with the random tie-break and with the old first-candidate one, and compare. "
        "Without --redis or $REDIS_URL it starts a private server and removes it afterwards; "
        "with one it works under a fresh name and deletes its keys at the end."
    )
    g = parser.add_argument_group("workload")
    g.add_argument("--replicas", type=_positive, default=8, help="simulated replicas (8)")
    g.add_argument("--workers", type=_positive, default=4, help="worker processes (4)")
    g.add_argument("--sessions", type=_positive, default=32, help="sessions in all (32)")
    g.add_argument("--turns", type=_positive, default=4, help="turns per session (4)")
    g.add_argument(
        "--service",
        type=_seconds,
        nargs=2,
        default=(0.05, 0.15),
        metavar=("MIN", "MAX"),
        help="seconds a replica takes per turn, uniform (0.05 0.15)",
    )
    g.add_argument(
        "--think",
        type=_seconds,
        nargs=2,
        default=(0.1, 0.4),
        metavar=("MIN", "MAX"),
        help="seconds an agent thinks before each turn, uniform (0.1 0.4)",
    )
    g.add_argument("--seed", type=int, default=None, help="seed for service and think times")
    parser.add_argument(
        "--tie-break",
        choices=("random", "first", "both"),
        default="both",
        help="random (the library), first (verl's old candidates[0]), or both (default)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw in-flight per replica over time")
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object, no live view"
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60 seconds, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    for flag, (lo, hi) in (("--service", args.service), ("--think", args.think)):
        if lo > hi:
            raise CliError(f"{flag} MIN MAX: MIN ({lo:g}) is above MAX ({hi:g})")
    if args.plot:
        _require_matplotlib()
    work = Workload(
        replicas=args.replicas,
        workers=min(args.workers, args.sessions),
        sessions=args.sessions,
        turns=args.turns,
        service=tuple(args.service),
        think=tuple(args.think),
        seed=args.seed if args.seed is not None else secrets.randbits(32),
    )
    modes = ["random", "first"] if args.tie_break == "both" else [args.tie_break]
    out = sys.stdout
    with given_or_private_redis(args.redis) as (url, where):
        if not args.json:
            print(
                f"redis-router demo: {work.replicas} replicas, {work.workers} worker processes, "
                f"{work.sessions} sessions x {work.turns} turns, seed {work.seed}; {where}",
                flush=True,
            )
        results = [run_once(url, mode, work, live=not args.json) for mode in modes]
    if args.json:
        print(
            json.dumps({"workload": _workload_json(work), "runs": [r.summary() for r in results]})
        )
    else:
        print(render_summary(results), file=out)
    if args.plot:
        plot(results, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _workload_json(work: Workload) -> dict[str, Any]:
    return {
        "replicas": work.replicas,
        "workers": work.workers,
        "sessions": work.sessions,
        "turns": work.turns,
        "service": list(work.service),
        "think": list(work.think),
        "seed": work.seed,
    }


# -- one run --------------------------------------------------------------------------------


def run_once(url: str, mode: str, work: Workload, *, live: bool = True) -> RunResult:
    """Run the workload under a fresh balancer name; its keys are deleted at the end."""
    name = f"demo-{secrets.token_hex(4)}-{mode}"
    replicas = work.replica_ids()
    servers = {rid: {"url": f"http://10.0.0.{i + 1}:8000"} for i, rid in enumerate(replicas)}
    lb = RedisLoadBalancer(servers, redis=url, name=name)
    result = RunResult(mode, replicas)
    ctx = multiprocessing.get_context("spawn")
    inbox = ctx.Queue()
    go = ctx.Event()
    ids = [f"{mode}-session-{i}" for i in range(work.sessions)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(WorkerTask(url, name, mode, w, tuple(ids[w :: work.workers]), work), inbox, go),
            daemon=True,
        )
        for w in range(work.workers)
    ]
    view = LiveView(MODES[mode], replicas, work, enabled=live)
    try:
        for p in procs:
            p.start()
        _collect(inbox, procs, "ready", time.monotonic() + WORKER_START_TIMEOUT)
        result.t0 = time.monotonic()
        go.set()
        done: dict[int, list[Turn]] = {}
        next_sample = 0.0
        while len(done) < len(procs):
            now = time.monotonic()
            if now >= next_sample:
                view.draw(now - result.t0, lb.get_status())
                next_sample = now + SAMPLE_EVERY
            try:
                kind, w, payload = inbox.get(timeout=max(0.0, next_sample - time.monotonic()))
            except queue.Empty:
                _check_alive(procs, done)
                continue
            if kind == "error":
                raise CliError(f"demo worker {w} failed: {payload}")
            if kind == "done":
                done[w] = payload
        result.duration = time.monotonic() - result.t0
        view.draw(result.duration, lb.get_status(), final=True)
        result.turns = [t for w in sorted(done) for t in done[w]]
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
        inbox.close()
        lb.destroy()
        lb.close()


def _collect(inbox: Any, procs: list[Any], kind: str, deadline: float) -> None:
    """Wait until every worker has sent `kind`."""
    seen: set[int] = set()
    while len(seen) < len(procs):
        try:
            got, w, payload = inbox.get(timeout=0.2)
        except queue.Empty:
            _check_alive(procs, {w: [] for w in seen})
            if time.monotonic() > deadline:
                raise CliError("demo workers did not start in time") from None
            continue
        if got == "error":
            raise CliError(f"demo worker {w} failed: {payload}")
        seen.add(w)


def _check_alive(procs: list[Any], finished: dict[int, Any]) -> None:
    for w, p in enumerate(procs):
        if w not in finished and not p.is_alive():
            raise CliError(f"demo worker {w} exited with code {p.exitcode} before finishing")


def _worker(task: WorkerTask, outbox: Any, go: Any) -> None:
    """One agent process: its sessions one after another, each turn a lease on a replica."""
    try:
        work = task.work
        times = random.Random(f"{work.seed}-{task.index}")  # same workload in both modes
        rng = FirstCandidate() if task.mode == "first" else random.Random(os.urandom(16))
        lb = RedisLoadBalancer(redis=task.url, name=task.name, rng=rng)
        outbox.put(("ready", task.index, None))
        go.wait()
        turns: list[Turn] = []
        for sid in task.sessions:
            for turn in range(work.turns):
                time.sleep(times.uniform(*work.think))
                lease = lb.acquire(sid)
                start = time.monotonic()
                time.sleep(times.uniform(*work.service))
                end = time.monotonic()
                lease.release()
                turns.append((sid, turn, lease.server_id, lease.sticky, start, end))
        lb.close()
        outbox.put(("done", task.index, turns))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        outbox.put(("error", task.index, f"{type(exc).__name__}: {exc}"))


# -- live view ------------------------------------------------------------------------------


class LiveView:
    """Per-replica in-flight as bars, redrawn in place on a terminal; elsewhere a compact line
    every LINE_EVERY seconds, so logs stay readable."""

    def __init__(self, title: str, replicas: list[str], work: Workload, *, enabled: bool) -> None:
        self.title, self.replicas, self.work = title, replicas, work
        self.enabled = enabled
        self.tty = sys.stdout.isatty()
        self.unit = max(1, 24 // work.workers)  # bar characters per request in flight
        self.peak = dict.fromkeys(replicas, 0)
        self.drawn = 0
        self.last_line = -LINE_EVERY

    def draw(self, elapsed: float, status: dict[str, Any], *, final: bool = False) -> None:
        if not self.enabled:
            return
        rows = status["replicas"]
        counts = {rid: rows.get(rid, {}).get("inflight", 0) for rid in self.replicas}
        for rid, n in counts.items():
            self.peak[rid] = max(self.peak[rid], n)
        requests = sum(r["acquires"] for r in rows.values())
        started = requests - sum(r["sticky_hits"] for r in rows.values())
        head = (
            f"{self.title:<24} {elapsed:5.1f}s  sessions {started:>4}/{self.work.sessions}  "
            f"requests {requests:>5}/{self.work.sessions * self.work.turns}"
        )
        if self.tty:
            width = max(len(r) for r in self.replicas)
            lines = [head] + [
                f"  {rid:<{width}} {self._bar(counts[rid])} {counts[rid]:>2}  "
                f"(peak {self.peak[rid]})"
                for rid in self.replicas
            ]
            up = f"\033[{self.drawn}F" if self.drawn else ""
            print(up + "\n".join(line + "\033[K" for line in lines), flush=True)
            self.drawn = len(lines)
        elif final or elapsed - self.last_line >= LINE_EVERY:
            inflight = " ".join(str(counts[rid]) for rid in self.replicas)
            print(f"{head}  in-flight [{inflight}]", flush=True)
            self.last_line = elapsed

    def _bar(self, n: int) -> str:
        full = self.work.workers * self.unit
        filled = min(n * self.unit, full)
        return "█" * filled + "·" * (full - filled)


# -- summary and plot -----------------------------------------------------------------------


def render_summary(results: Sequence[RunResult]) -> str:
    """Per replica sessions, requests, peak in-flight for each run, side by side, then the
    balance figures (max/mean: 1.0 is perfectly even) and the sticky hit rate."""
    sums = [r.summary() for r in results]
    label, block = 26, 29  # a block: sessions (9) requests (10) peak (6), then a gap (4)
    lines = [
        "",
        " " * label + "".join(f"{MODES[s['tie_break']]:>25}    " for s in sums).rstrip(),
        f"{'replica':<{label}}"
        + "".join(f"{'sessions':>9}{'requests':>10}{'peak':>6}    " for _ in sums).rstrip(),
    ]
    for rid in results[0].replicas:
        lines.append(
            f"{rid:<{label}}"
            + "".join(
                f"{s['sessions'][rid]:>9}{s['requests'][rid]:>10}{s['peak_inflight'][rid]:>6}    "
                for s in sums
            ).rstrip()
        )

    def row(name: str, cells: list[str]) -> str:
        return f"{name:<{label}}" + "".join(f"{c:>{block - 4}}    " for c in cells).rstrip()

    lines += [
        "balance (max/mean, 1.00 = even)",
        row("  sessions", [f"{s['balance_sessions']:.2f}" for s in sums]),
        row("  peak in-flight", [f"{s['balance_peak_inflight']:.2f}" for s in sums]),
        row("replicas with no session", [str(s["idle_replicas"]) for s in sums]),
        row("sticky hit rate", [f"{100 * s['sticky_hit_rate']:.1f}%" for s in sums]),
        row("time", [f"{s['seconds']:.1f}s" for s in sums]),
    ]
    for s in sums:
        top = max(s["sessions"], key=lambda rid: s["sessions"][rid])
        share = s["sessions"][top] / max(1, sum(s["sessions"].values()))
        lines.append(
            f"{MODES[s['tie_break']]}: busiest replica {top} took {share:.0%} of the sessions; "
            f"{s['idle_replicas']} of {len(s['sessions'])} replicas got none"
        )
    return "\n".join(lines)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install matplotlib") from None


def plot(results: Sequence[RunResult], path: str) -> None:
    """One row per run: in-flight per replica over time as a heat map (one lane per replica),
    and the sessions each replica received; same scales in every row, so runs compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    end = max((t[5] - r.t0 for r in results for t in r.turns), default=1.0)
    bins = np.linspace(0.0, end, min(800, max(2, int(end / 0.02))) + 1)
    grids = [_inflight_grid(r, bins) for r in results]
    top = max(1, *(int(g.max()) for g in grids))
    most = max(1, *(max(r.sessions().values()) for r in results))
    fig, axes = plt.subplots(
        len(results),
        2,
        figsize=(11, 0.9 + 2.6 * len(results)),
        squeeze=False,
        gridspec_kw={"width_ratios": (5, 1)},
        layout="constrained",
    )
    cmap = plt.get_cmap("viridis", top + 1)
    for (heat, bars), res, grid in zip(axes, results, grids, strict=True):
        s = res.summary()
        image = heat.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=-0.5,
            vmax=top + 0.5,
            extent=(0.0, end, len(res.replicas) - 0.5, -0.5),
        )
        heat.set_yticks(range(len(res.replicas)), res.replicas)
        heat.set_ylabel("replica")
        heat.set_title(
            f"{MODES[res.mode]}: sessions max/mean {s['balance_sessions']:.2f}, "
            f"peak in-flight max/mean {s['balance_peak_inflight']:.2f}",
            fontsize=10,
            loc="left",
        )
        sessions = res.sessions()
        bars.barh(range(len(res.replicas)), [sessions[r] for r in res.replicas], color="C1")
        bars.set_ylim(len(res.replicas) - 0.5, -0.5)
        bars.set_yticks([])
        bars.set_xlim(0, most * 1.05)
        bars.set_title("sessions", fontsize=10)
    axes[-1, 0].set_xlabel("seconds")
    axes[-1, 1].set_xlabel("first turns placed")
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), ticks=range(top + 1), shrink=0.8)
    bar.set_label("requests in flight")
    fig.suptitle("redis-router demo: in-flight requests per replica over time")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _inflight_grid(res: RunResult, bins: Any) -> Any:
    """Peak in-flight of each replica within each time bin (rows: replicas)."""
    import numpy as np

    grid = np.zeros((len(res.replicas), len(bins) - 1))
    series = res.series()
    for row, rid in enumerate(res.replicas):
        times, counts = (np.array(v) for v in zip(*series[rid], strict=True))
        at_start = np.searchsorted(times, bins[:-1], side="right") - 1
        grid[row] = counts[np.clip(at_start, 0, None)]
        inside = np.clip(np.searchsorted(bins, times, side="right") - 1, 0, len(bins) - 2)
        np.maximum.at(grid[row], inside, counts)
    return grid
