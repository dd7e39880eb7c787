"""`redis-router exporter`: Prometheus metrics of one balancer, read fresh on every scrape.

A custom collector runs one status script per scrape (no background loop, so the numbers are
never staler than the scrape and an idle exporter costs Redis nothing). Per replica, labelled
``balancer`` and ``replica``:

    redis_router_inflight                 gauge    requests in flight (leases counted)
    redis_router_draining                 gauge    1 while the replica takes no new sessions
    redis_router_live_leases              gauge    leases held on the replica
    redis_router_sticky_sessions          gauge    live sticky sessions pinned to the replica
    redis_router_acquires_total           counter  requests routed to the replica
    redis_router_sticky_hits_total        counter  of which, later turns of a sticky session
    redis_router_reclaimed_leases_total   counter  leases reclaimed (their process died, or
                                                   they outlived max_lease_age)
    redis_router_repins_total             counter  sticky sessions moved off the replica by
                                                   the affinity margin or ratio, or because
                                                   it no longer held their prompt
    redis_router_capacity                 gauge    requests it can hold (only replicas that
                                                   declare one)
    redis_router_ejected                  gauge    1 while ejected (failing), by ``reason``
    redis_router_ejected_seconds_left     gauge    until the ejection ends
    redis_router_failing                  gauge    1 while its last request or probe failed
                                                   (ejection on or off), by ``reason`` (the
                                                   last error, at most 200 characters)
    redis_router_failures_in_a_row        gauge    the failure streak (toward ejection, if on)
    redis_router_failures_total           counter  failed requests and probes reported
    redis_router_last_error_age_seconds   gauge    since its last failure (replicas with one)

and per balancer ``redis_router_up`` (1 if Redis answered this scrape) and
``redis_router_replicas`` (and, where the status reports worker processes,
``redis_router_holders`` by ``state`` live|unheard|dead (unheard: deadline passed during a
gap in heartbeats, on probation), ``redis_router_holders_unheard_seconds`` (since the longest
unheard was heard), ``redis_router_leases_awaiting_reclaim`` (of dead ones) and
``redis_router_leases_unheard`` (of unheard ones)),
and for acquires that wait for a place in a full pool ``redis_router_waiting`` (now),
``redis_router_oldest_wait_seconds``, ``redis_router_waits_total`` by ``outcome``
served|timed_out|abandoned, ``redis_router_wait_seconds_total`` (of the served) and
``redis_router_max_wait_seconds``.
For a sharded pool (docs/sharding.md), per ``shard``: ``redis_router_shard_replicas``,
``redis_router_shard_inflight``, ``redis_router_shard_sticky_sessions`` and
``redis_router_shard_published_inflight`` (what the directory places new sessions by).
For replicas whose engine reported its own load (``redis-router load``, docs/engine-load.md):
``redis_router_engine_running``, ``redis_router_engine_waiting``,
``redis_router_engine_kv_usage`` (0 to 1, only when known) and
``redis_router_engine_report_age_seconds`` (a growing age: no reporter reaches it).
For replicas whose metadata names a KV-events publisher (docs/kv_events.md):
``redis_router_kv_index_exact`` (1 while routing may trust the exact index),
``redis_router_kv_index_blocks`` and ``redis_router_kv_index_degraded`` by ``reason``.
A scrape only reads: it never writes to Redis. Counters restart at 0 when a replica is removed
and re-added, which Prometheus's rate() treats as a counter reset.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from typing import Any

from redis import exceptions as rx

from ..connection import connect, redact
from ..errors import RedisUnavailable
from .common import Balancer, CliError, balancer_at, natural_key, unreachable, url_of

DEFAULT_PORT = 9464

GAUGES = (
    ("inflight", "inflight", "Requests in flight on the replica (one per lease)."),
    ("draining", "draining", "1 while the replica is draining: no new sessions, sticky ones only."),
    ("live_leases", "live_leases", "Leases held on the replica."),
    ("sticky_sessions", "sticky_sessions", "Live sticky sessions pinned to the replica."),
)
COUNTERS = (
    ("acquires", "acquires", "Requests routed to the replica."),
    ("sticky_hits", "sticky_hits", "Requests routed to the replica by their sticky session."),
    ("reclaimed_leases", "reclaimed", "Leases on the replica reclaimed from dead holders."),
    (
        "repins",
        "repins",
        "Sticky sessions moved off the replica by the affinity tolerance, or because it no "
        "longer held their prompt (sticky_min_cached).",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve Prometheus metrics of the balancer on http://ADDR:PORT/metrics, read from Redis "
        "on each scrape. Needs prometheus_client: pip install prometheus_client."
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"TCP port (default {DEFAULT_PORT}); 0 picks a free one and prints it",
    )
    parser.add_argument("--addr", default="0.0.0.0", help="address to bind (default 0.0.0.0)")


class BalancerCollector:
    """Reads the balancer's status on each collect(); Redis errors become redis_router_up 0."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self._balancer = Balancer(connect(url), name, url)
        self.name = self._balancer.name

    def status(self) -> dict[str, Any] | None:
        """The balancer's status (a sharded pool's as one), None if it does not exist (yet)."""
        b = balancer_at(self._balancer.client, self.name, self.url)
        return b.status() if b.exists() else None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily(
            "redis_router_up", "1 if Redis answered this scrape.", labels=["balancer"]
        )
        try:
            status = self.status()
        except (rx.RedisError, RedisUnavailable) as exc:
            print(f"redis-router exporter: {unreachable(self.url, exc)}", file=sys.stderr)
            up.add_metric([self.name], 0)
            yield up
            return
        up.add_metric([self.name], 1)
        yield up
        raw = status["replicas"] if status else {}
        replicas = {sid: raw[sid] for sid in sorted(raw, key=natural_key)}
        count = GaugeMetricFamily(
            "redis_router_replicas", "Replicas in the pool.", labels=["balancer"]
        )
        count.add_metric([self.name], len(replicas))
        yield count
        yield from _holders(self.name, (status or {}).get("holders"))
        labels = ["balancer", "replica"]
        for metric, field, text in GAUGES:
            g = GaugeMetricFamily(f"redis_router_{metric}", text, labels=labels)
            for sid, r in replicas.items():
                g.add_metric([self.name, sid], float(r[field]))
            yield g
        for metric, field, text in COUNTERS:
            c = CounterMetricFamily(f"redis_router_{metric}", text, labels=labels)
            for sid, r in replicas.items():
                c.add_metric([self.name, sid], float(r[field]))
            yield c
        yield from _health(self.name, replicas)
        yield from _engine(self.name, replicas)
        yield from _waiting(self.name, (status or {}).get("waiting"))
        yield from _shards(self.name, (status or {}).get("shards"), (status or {}).get("placement"))
        yield from self._kv_index({sid: r["metadata"] for sid, r in replicas.items()})

    def _kv_index(self, metadata: dict[str, Any]) -> Iterator[Any]:
        """The exact KV-block index's state per replica with a publisher."""
        from prometheus_client.core import GaugeMetricFamily

        from ..kv_events.state import index_states

        states = {
            sid: s
            for sid, s in index_states(self._balancer.client, self.name, metadata).items()
            if s["state"] != "off"
        }
        if not states:
            return
        labels = ["balancer", "replica"]
        exact = GaugeMetricFamily(
            "redis_router_kv_index_exact", "1 while the replica's KV index is exact.", labels=labels
        )
        blocks = GaugeMetricFamily(
            "redis_router_kv_index_blocks", "KV blocks indexed for the replica.", labels=labels
        )
        degraded = GaugeMetricFamily(
            "redis_router_kv_index_degraded",
            "1 for a replica whose KV index is degraded, by reason.",
            labels=[*labels, "reason"],
        )
        for sid, s in states.items():
            exact.add_metric([self.name, sid], float(s["state"] == "exact"))
            blocks.add_metric([self.name, sid], float(s["blocks"]))
            if s["reason"]:
                degraded.add_metric([self.name, sid, s["reason"]], 1.0)
        yield from (exact, blocks, degraded)

    def close(self) -> None:
        self._balancer.client.close()


def _health(name: str, replicas: dict[str, Any]) -> Iterator[Any]:
    """Capacity and ejection per replica."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["balancer", "replica"]
    cap = GaugeMetricFamily(
        "redis_router_capacity", "Requests the replica can hold (declared).", labels=labels
    )
    ejected = GaugeMetricFamily(
        "redis_router_ejected",
        "1 while the replica is ejected for failing, by reason.",
        labels=[*labels, "reason"],
    )
    left = GaugeMetricFamily(
        "redis_router_ejected_seconds_left", "Seconds until the ejection ends.", labels=labels
    )
    failing = GaugeMetricFamily(
        "redis_router_failing",
        "1 while the replica's last request or probe failed, by its last error.",
        labels=[*labels, "reason"],
    )
    streak = GaugeMetricFamily(
        "redis_router_failures_in_a_row", "Failures in a row (toward ejection).", labels=labels
    )
    failures = CounterMetricFamily(
        "redis_router_failures", "Failed requests and probes reported.", labels=labels
    )
    age = GaugeMetricFamily(
        "redis_router_last_error_age_seconds",
        "Seconds since the replica's last failed request or probe.",
        labels=labels,
    )
    for sid, r in replicas.items():
        if r["capacity"] is not None:
            cap.add_metric([name, sid], float(r["capacity"]))
        if r["ejected_until"] is not None:
            ejected.add_metric([name, sid, r["ejected_why"] or ""], 1.0)
            left.add_metric([name, sid], float(r["ejected_for"]))
        failing.add_metric(
            [name, sid, (r["last_error"] or "") if r["failing"] else ""], float(r["failing"])
        )
        streak.add_metric([name, sid], float(r["failures_in_a_row"]))
        failures.add_metric([name, sid], float(r["failures"]))
        if r["last_error_age"] is not None:
            age.add_metric([name, sid], float(r["last_error_age"]))
    yield from (cap, ejected, left, failing, streak, failures, age)


def _engine(name: str, replicas: dict[str, Any]) -> Iterator[Any]:
    """What the engines reported of their own load, and how old each report is."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["balancer", "replica"]
    running = GaugeMetricFamily(
        "redis_router_engine_running", "Requests the engine reported running.", labels=labels
    )
    waiting = GaugeMetricFamily(
        "redis_router_engine_waiting", "Requests the engine reported queued.", labels=labels
    )
    kv = GaugeMetricFamily(
        "redis_router_engine_kv_usage",
        "Fraction of its KV cache the engine reported in use (0 to 1).",
        labels=labels,
    )
    age = GaugeMetricFamily(
        "redis_router_engine_report_age_seconds",
        "Seconds since the engine's load was last reported.",
        labels=labels,
    )
    for sid, r in replicas.items():
        e = r.get("engine")
        if e is None:
            continue
        running.add_metric([name, sid], float(e["running"]))
        waiting.add_metric([name, sid], float(e["waiting"]))
        if e["kv_usage"] is not None:
            kv.add_metric([name, sid], float(e["kv_usage"]))
        age.add_metric([name, sid], float(e["age_s"]))
    yield from (running, waiting, kv, age)


def _shards(name: str, shards: Any, placing: Any) -> Iterator[Any]:
    """A sharded pool's shards: what each holds, and what the directory last heard of it."""
    from prometheus_client.core import GaugeMetricFamily

    if not shards:
        return
    labels = ["balancer", "shard"]
    rows = (
        ("shard_replicas", "servers", "Replicas whose home is the shard."),
        ("shard_inflight", "total_inflight", "Requests in flight on the shard's replicas."),
        ("shard_sticky_sessions", "sticky_sessions", "Live sticky sessions on the shard."),
    )
    for metric, field, text in rows:
        g = GaugeMetricFamily(f"redis_router_{metric}", text, labels=labels)
        for s in shards:
            g.add_metric([name, s["name"]], float(s[field]))
        yield g
    g = GaugeMetricFamily(
        "redis_router_shard_published_inflight",
        "The shard's in-flight total as last published to the directory, which places new "
        "sessions by it.",
        labels=labels,
    )
    for p in placing:
        g.add_metric([name, p["shard"]], float(p["published_inflight"]))
    yield g


def _waiting(name: str, waiting: dict[str, Any] | None) -> Iterator[Any]:
    """Acquires waiting for a place, and how long the served ones waited."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if waiting is None:
        return
    now = GaugeMetricFamily(
        "redis_router_waiting", "Acquires waiting for a place now.", labels=["balancer"]
    )
    now.add_metric([name], float(waiting["now"]))
    oldest = GaugeMetricFamily(
        "redis_router_oldest_wait_seconds",
        "How long the first waiting acquire has waited.",
        labels=["balancer"],
    )
    oldest.add_metric([name], float(waiting["oldest_wait"]))
    waits = CounterMetricFamily(
        "redis_router_waits", "Waiting acquires by outcome.", labels=["balancer", "outcome"]
    )
    for outcome in ("served", "timed_out", "abandoned"):
        waits.add_metric([name, outcome], float(waiting[outcome]))
    total = CounterMetricFamily(
        "redis_router_wait_seconds", "Seconds the served acquires waited.", labels=["balancer"]
    )
    total.add_metric([name], waiting["mean_wait"] * waiting["served"])
    longest = GaugeMetricFamily(
        "redis_router_max_wait_seconds",
        "The longest wait of a served acquire.",
        labels=["balancer"],
    )
    longest.add_metric([name], float(waiting["max_wait"]))
    yield from (now, oldest, waits, total, longest)


def _holders(name: str, holders: dict[str, int] | None) -> Iterator[Any]:
    """Worker processes (balancer instances) by liveness, and the leases dead ones left."""
    from prometheus_client.core import GaugeMetricFamily

    if holders is None:
        return
    g = GaugeMetricFamily(
        "redis_router_holders", "Worker processes holding leases.", labels=["balancer", "state"]
    )
    # Unheard: deadline passed during a gap in heartbeats (a pause of Redis, or they exited),
    # on probation; counted apart from the live ones.
    for state in ("live", "unheard", "dead"):
        g.add_metric([name, state], holders.get(state, 0))
    yield g
    since = GaugeMetricFamily(
        "redis_router_holders_unheard_seconds",
        "Seconds since the longest unheard worker process was last heard (0: none unheard).",
        labels=["balancer"],
    )
    since.add_metric([name], holders.get("unheard_ms", 0) / 1000)
    yield since
    for metric, field, text in (
        (
            "awaiting_reclaim",
            "awaiting_reclaim",
            "Leases of dead worker processes not yet reclaimed.",
        ),
        ("unheard", "unheard_leases", "Leases of unheard worker processes (on probation)."),
    ):
        leases = GaugeMetricFamily(f"redis_router_leases_{metric}", text, labels=["balancer"])
        leases.add_metric([name], holders.get(field, 0))
        yield leases


def run(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise CliError(
            "the exporter needs prometheus_client (the metrics extra): "
            "pip install prometheus_client"
        ) from None
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be between 0 and 65535, got {args.port}")
    url = url_of(args)
    collector = BalancerCollector(url, args.name)
    try:
        exists = collector.status() is not None
    except (rx.RedisError, RedisUnavailable) as exc:
        collector.close()
        raise unreachable(url, exc) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        server, thread = start_http_server(args.port, addr=args.addr, registry=registry)
    except OSError as exc:
        collector.close()
        raise CliError(f"cannot listen on {args.addr}:{args.port}: {exc.strerror or exc}") from None
    try:  # from the first line out, Ctrl-C or SIGTERM is a clean stop
        host = server.server_address[0]
        host = host.decode() if isinstance(host, bytes) else str(host)
        print(
            f"serving metrics of balancer {collector.name!r} at {redact(url)} on "
            f"http://{host}:{server.server_port}/metrics",
            flush=True,
        )
        if not exists:
            print(
                f"note: balancer {collector.name!r} does not exist yet; its replicas appear once a "
                "worker or `redis-router servers add` creates it",
                file=sys.stderr,
                flush=True,
            )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        collector.close()
