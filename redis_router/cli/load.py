"""`redis-router load`: the engines' own load (running, waiting, KV cache), reported to Redis.

Each round scrapes, in parallel, every replica whose metadata names a metrics URL
(``"metrics_url"``, else ``"url"`` + ``--path``), reads vLLM's or SGLang's gauges from it
(redis_router.engine_metrics) and stores what it read in one ``engine_report.lua`` call,
stamped with Redis's clock. A replica whose endpoint fails, times out or answers figures no
engine could mean gets no report that round: its last one ages, and routing ignores a report
too old to trust. Any number of reporters may run, on any machine, and none is required: each
only reports what it sees (docs/engine-load.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait

from .. import dp
from ..engine import EngineLoad
from ..engine_metrics import Unusable, fetch, metrics_url, parse
from ..errors import RedisUnavailable
from .common import Balancer, CliError, open_balancer

# A replica's metrics URL, and its data-parallel rank when it is one rank of a server.
Target = tuple[str, int | None]
MAX_PARALLEL = 32
# A scrape gets this much longer than --timeout before its round gives up on it.
SLACK = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "A replica is scraped when its metadata has metrics_url (or url, to which --path is "
        "appended); vLLM and SGLang (started with --enable-metrics) are told apart by their "
        "metric names. A replica that fails a round gets no report: its last one ages. Needs "
        "prometheus_client: pip install prometheus_client."
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="between rounds (1)",
    )
    parser.add_argument(
        "--timeout", type=float, default=0.5, metavar="SECONDS", help="per scrape (0.5)"
    )
    parser.add_argument(
        "--path",
        default="/metrics",
        help="appended to a replica's url without metrics_url",
    )
    parser.add_argument("--once", action="store_true", help="one round, then exit")


# One round's outcome per scraped replica: (engine kind, load), or why it has no report.
Outcome = tuple[str, EngineLoad] | str


def targets(balancer: Balancer, path: str) -> dict[str, Target]:
    """The replicas to scrape: their metrics URLs, and the data-parallel rank of a replica
    routed per rank (its ranks share one endpoint, whose figures are labelled by rank)."""
    found: dict[str, Target] = {}
    for sid, value in balancer.metadata().items():
        url = metrics_url(value, path)
        if url:
            rank = value.get(dp.DP_RANK) if isinstance(value, dict) else None
            found[sid] = (url, rank if isinstance(rank, int) else None)
    return found


def scrape_all(wanted: Mapping[str, Target], timeout: float) -> dict[str, Outcome]:
    """Scrape every endpoint once, in parallel (the ranks of one server share it); one that
    is not done within the timeout (and a little slack) counts as timed out, whatever its
    thread does later."""
    out: dict[str, Outcome] = {}
    if not wanted:
        return out
    endpoints = sorted({url for url, _ in wanted.values()})
    pool = ThreadPoolExecutor(min(MAX_PARALLEL, len(endpoints)))
    try:
        futures: dict[str, Future[str]] = {u: pool.submit(fetch, u, timeout) for u in endpoints}
        wait(futures.values(), timeout=timeout + SLACK)
        for sid, (url, rank) in wanted.items():
            future = futures[url]
            if not future.done():
                out[sid] = f"timed out after {timeout:g} s"
                continue
            try:
                out[sid] = parse(future.result(), rank)
            except Unusable as exc:
                out[sid] = str(exc)
            except Exception as exc:  # a bug must not stop the other replicas' reports
                out[sid] = f"scrape failed: {type(exc).__name__}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def load_round(balancer: Balancer, path: str, timeout: float) -> tuple[dict[str, Outcome], int]:
    """Scrape every replica with a metrics URL and store what was read in one call: the
    round's outcomes and how many reports were stored."""
    outcomes = scrape_all(targets(balancer, path), timeout)
    loads = {sid: got[1] for sid, got in outcomes.items() if isinstance(got, tuple)}
    if not loads:
        return outcomes, 0
    core = balancer.core()
    return outcomes, balancer.run(core.report_engine(loads), core)


def describe(outcome: Outcome) -> str:
    if isinstance(outcome, str):
        return f"no report ({outcome})"
    kind, load = outcome
    kv = "unknown" if load.kv_usage is None else f"{load.kv_usage:.1%}"
    return f"{kind}: running {load.running}, waiting {load.waiting}, KV cache {kv}"


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0 or not args.timeout > 0:
        raise ValueError("--interval and --timeout must be > 0 seconds")
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise CliError(
            "redis-router load needs prometheus_client to read the engines' metrics: pip "
            "install prometheus_client"
        ) from None
    with open_balancer(args) as balancer:
        try:
            last: dict[str, str] = {}  # per replica: "ok" or why it had no report
            while True:
                started = time.monotonic()
                try:
                    outcomes, _ = load_round(balancer, args.path, args.timeout)
                except RedisUnavailable as exc:
                    print(f"{time.strftime('%H:%M:%S')} {exc}", flush=True)
                    outcomes = {}
                for sid in sorted(outcomes):
                    got = outcomes[sid]
                    state = "ok" if isinstance(got, tuple) else got
                    # A line when a replica starts or stops reporting, or fails another way.
                    if args.once or last.get(sid) != state:
                        print(
                            f"{time.strftime('%H:%M:%S')} {sid}: {describe(got)}",
                            flush=True,
                        )
                    last[sid] = state
                if outcomes:  # replicas removed since are forgotten
                    last = {sid: last[sid] for sid in outcomes}
                if not outcomes and args.once:
                    print("no replica names a metrics URL (metadata metrics_url or url)")
                if args.once:
                    return 0
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a clean stop
            return 0
