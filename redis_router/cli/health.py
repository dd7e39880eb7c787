"""`redis-router health`: active health checks, fed to the balancer's passive health.

Each round probes every replica whose metadata names a health URL (``"health_url"``, else
``"url"`` + ``--path``) with an HTTP GET; a 2xx answer within ``--timeout`` is healthy. The
outcomes go to ``report.lua`` in one call: a failed probe counts toward ejecting the replica
exactly as a failed request does (``eject_after`` in a row, pinned by the workers; a success
ends the streak), so ejections are shared by every worker. Any number of checkers may run, on
any machine, and none is required: each only reports what it sees. SGLang's gateway runs one
checker per router; here they all feed one shared decision.
"""

from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import health
from ..errors import RedisUnavailable
from .common import Balancer, config_key, open_balancer

MAX_PARALLEL = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "A replica is probed when its metadata has health_url (or url, to which --path is "
        "appended). Probe failures eject a replica only when the workers pinned ejection "
        "(eject_after=N); otherwise they are only counted (status shows them)."
    )
    parser.add_argument(
        "--interval", type=float, default=5.0, metavar="SECONDS", help="between rounds (5)"
    )
    parser.add_argument(
        "--timeout", type=float, default=2.0, metavar="SECONDS", help="per probe (2)"
    )
    parser.add_argument(
        "--path", default="/health", help="appended to a replica's url without health_url"
    )
    parser.add_argument("--once", action="store_true", help="one round, then exit")


def health_url(meta: Any, path: str) -> str | None:
    """Where to probe a replica, from its metadata (None: not probed)."""
    if not isinstance(meta, Mapping):
        return None
    url = meta.get("health_url")
    if isinstance(url, str) and url:
        return url
    base = meta.get("url")
    if isinstance(base, str) and base.startswith(("http://", "https://")):
        return base.rstrip("/") + path
    return None


def probe(url: str, timeout: float) -> tuple[bool, str]:
    """(healthy, why): a 2xx answer within ``timeout`` seconds is healthy."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            status = int(answer.status)
        return 200 <= status < 300, f"HTTP {status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, type(reason).__name__ if not str(reason) else str(reason)[:80]
    except ValueError as exc:  # a URL urllib cannot use (http.client.InvalidURL)
        return False, f"invalid URL ({type(exc).__name__})"


def check_round(balancer: Balancer, path: str, timeout: float) -> dict[str, str]:
    """Probe every health URL of the pool once and report the outcome for each replica (each
    rank) probed there; returns each probed replica's state after the report."""
    targets: dict[str, str] = {}
    for sid, meta in balancer.metadata().items():
        url = health_url(meta, path)
        if url:
            targets[sid] = url
    if not targets:
        return {}
    # One probe per URL: the ranks of a data-parallel replica (redis_router.dp) share theirs,
    # and its outcome is each rank's, so they are ejected and come back together.
    urls = sorted(set(targets.values()))
    with ThreadPoolExecutor(min(MAX_PARALLEL, len(urls))) as pool:
        probed = dict(zip(urls, pool.map(lambda u: probe(u, timeout), urls), strict=True))
    outcomes = [(sid, *probed[url]) for sid, url in targets.items()]
    core = balancer.core()
    states = balancer.run(core.report(outcomes), core)
    # A failing replica's state says why (the probe's error, as stored: health.reason).
    why = {sid: health.reason(text) for sid, ok, text in outcomes if not ok}
    return {
        sid: f"{state}: {why[sid]}" if state == "failing" and sid in why else state
        for sid, state in states.items()
    }


def readable(state: str) -> str:
    """report.lua's "ejected until <ms>" with a local clock time."""
    head, _, until = state.partition(" until ")
    if not until:
        return state
    return f"{head} until {time.strftime('%H:%M:%S', time.localtime(int(until) / 1000))}"


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0 or not args.timeout > 0:
        raise ValueError("--interval and --timeout must be > 0 seconds")
    with open_balancer(args) as balancer:
        try:
            pinned = balancer.client.hget(config_key(balancer.name), "ejection")
            if not pinned:
                print(
                    f"balancer {balancer.name!r}: ejection is off (no worker pinned eject_after): "
                    "failed probes are counted, nothing is ejected",
                    flush=True,
                )
            last: dict[str, str] = {}
            while True:
                started = time.monotonic()
                try:
                    states = check_round(balancer, args.path, args.timeout)
                except RedisUnavailable as exc:
                    print(f"{time.strftime('%H:%M:%S')} {exc}", flush=True)
                    states = last
                for sid, state in sorted(states.items()):
                    if last.get(sid) != state.split(" until")[0] or args.once:
                        print(f"{time.strftime('%H:%M:%S')} {sid}: {readable(state)}", flush=True)
                last = {sid: state.split(" until")[0] for sid, state in states.items()}
                if args.once:
                    return 0
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a clean stop
            return 0
