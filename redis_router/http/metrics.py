"""The serve process's own Prometheus metrics, in a registry of its own (so a host process's
default registry is neither read nor polluted). The balancer's shared state (in-flight per
replica, ejections, waits) is `redis-router exporter`'s; these say what this instance did.

    redis_router_http_requests_total{endpoint,code}          counter    answered requests
    redis_router_http_errors_total{endpoint,type}             counter    error answers, by type
    redis_router_http_upstream_seconds{endpoint}              histogram  until the replica's
                                                                         response headers
    redis_router_http_retries_total{endpoint}                 counter    attempts on another
                                                                         replica
    redis_router_http_inflight                                gauge      requests being served

With $PROMETHEUS_MULTIPROC_DIR set (``serve --processes N`` sets it), prometheus_client keeps
every process's samples in files there and /metrics sums them: a scrape sees the instance.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Upstream latency buckets (s): from a cached short answer to a long generation.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The counters one serve instance keeps."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "redis_router_http_requests", "Requests answered.", ["endpoint", "code"], registry=r
        )
        self.errors = Counter(
            "redis_router_http_errors", "Error answers, by type.", ["endpoint", "type"], registry=r
        )
        self.upstream = Histogram(
            "redis_router_http_upstream_seconds",
            "Seconds until the replica's response headers.",
            ["endpoint"],
            buckets=BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "redis_router_http_retries",
            "Attempts made on another replica after a failure before any byte was sent.",
            ["endpoint"],
            registry=r,
        )
        self.inflight = Gauge(
            "redis_router_http_inflight",
            "Requests being served now.",
            registry=r,
            multiprocess_mode="livesum",  # the live processes' sum (ignored in one process)
        )
        # What /metrics renders: this registry, or every process's samples.
        self.shown = r
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.shown = CollectorRegistry()
            MultiProcessCollector(self.shown)  # type: ignore[no-untyped-call]

        # The labelled children in use (a lookup per request otherwise): endpoints and codes
        # are bounded sets.
        self._answered: dict[tuple[str, int], Any] = {}
        self._upstream: dict[str, Any] = {}

    def answered(self, endpoint: str, code: int) -> None:
        child = self._answered.get((endpoint, code))
        if child is None:
            child = self._answered[endpoint, code] = self.requests.labels(endpoint, str(code))
        child.inc()

    def upstream_seconds(self, endpoint: str, seconds: float) -> None:
        child = self._upstream.get(endpoint)
        if child is None:
            child = self._upstream[endpoint] = self.upstream.labels(endpoint)
        child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.shown)
