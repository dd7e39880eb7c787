"""An engine's load read from its Prometheus endpoint (``/metrics``): vLLM or SGLang.

The engine is told by the metric names present, and the text is parsed by prometheus_client's
own parser (the ``metrics`` extra). One engine may expose a metric under several label sets
(vLLM labels each data-parallel engine ``engine="0"``, ``"1"``...; SGLang its ranks): the
request counts are summed over them and the KV-cache usage averaged (equal caches per rank).
A figure the text does not hold, or one no engine could mean (negative, fractional counts,
NaN, a usage above 1), makes the whole scrape unusable: no report is better than a wrong one.
"""

from __future__ import annotations

import base64
import http.client
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .connection import hide_userinfo, scrub
from .engine import MAX_REQUESTS, EngineLoad

# The most bytes read from one endpoint (vLLM's text with every histogram is ~100 KB).
MAX_BYTES = 8 * 1024 * 1024


class Engine(NamedTuple):
    """The gauges one engine kind registers for its load."""

    kind: str
    running: str
    waiting: str
    kv_usage: str


# vLLM 0.33 (vllm/v1/metrics/loggers.py, labels model_name and engine) and SGLang 0.5
# (sglang/srt/observability/metrics_collector.py, SGLang started with --enable-metrics).
VLLM = Engine(
    "vllm", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
)
SGLANG = Engine("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")
ENGINES = (VLLM, SGLANG)


class Unusable(ValueError):
    """A scrape that gives no report this round, and why (one line, no credentials)."""


# The label vLLM gives each data-parallel engine of one server ("0", "1", ...).
RANK_LABEL = "engine"


def _prometheus_parser() -> Callable[[str], Iterable[Any]]:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise ImportError(
            "reading engine metrics needs prometheus_client (the metrics extra): pip install "
            "prometheus_client"
        ) from None
    return text_string_to_metric_families


def parse(text: str, rank: int | None = None) -> tuple[str, EngineLoad]:
    """The engine kind ("vllm" or "sglang") and its load, from Prometheus text; raises
    :class:`Unusable` saying why when the text holds no trustworthy figures. ``rank``: the
    figures of that data-parallel rank alone (vLLM's ``engine`` label), for a replica routed
    per rank (redis_router.dp)."""
    families = _prometheus_parser()
    wanted = {name for engine in ENGINES for name in engine[1:]}
    samples: list[tuple[str, dict[str, str], float]] = []
    try:
        for family in families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    samples.append((sample.name, sample.labels, float(sample.value)))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise Unusable(f"not Prometheus text ({type(exc).__name__})") from None
    names = {name for name, _, _ in samples}
    engine = next((e for e in ENGINES if e.running in names or e.waiting in names), None)
    if engine is None:
        raise Unusable(
            f"no engine load metrics (neither {VLLM.running} nor {SGLANG.running}): is it a "
            "vLLM or SGLang metrics endpoint (SGLang needs --enable-metrics)?"
        )
    if rank is not None:
        if engine is not VLLM:
            raise Unusable(
                f"per-rank figures are read from vLLM's {RANK_LABEL!r} label; {engine.kind} "
                "reports its data-parallel ranks together"
            )
        samples = [s for s in samples if s[1].get(RANK_LABEL) == str(rank)]
        if not samples:
            raise Unusable(f'no figures labelled {RANK_LABEL}="{rank}" (data-parallel rank)')
    values: dict[str, list[float]] = {}
    for name, _, value in samples:
        values.setdefault(name, []).append(value)
    running = _count(values, engine.running)
    waiting = _count(values, engine.waiting)
    usages = values.get(engine.kv_usage)
    kv = None
    if usages:
        if not all(math.isfinite(u) and 0.0 <= u <= 1.0 for u in usages):
            raise Unusable(f"{engine.kv_usage} out of [0, 1]: {_shown(usages)}")
        kv = sum(usages) / len(usages)
    return engine.kind, EngineLoad(running, waiting, min(1.0, kv) if kv is not None else None)


def _count(values: dict[str, list[float]], name: str) -> int:
    found = values.get(name)
    if not found:
        raise Unusable(f"no {name} in the metrics")
    if not all(math.isfinite(v) and v >= 0 and v == int(v) for v in found):
        raise Unusable(f"{name} is not a count of requests: {_shown(found)}")
    total = int(sum(found))
    if total > MAX_REQUESTS:
        raise Unusable(f"{name} is {total}, more than {MAX_REQUESTS}")
    return total


def _shown(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values[:4]) + (" ..." if len(values) > 4 else "")


def metrics_url(meta: object, path: str) -> str | None:
    """Where to scrape a replica, from its metadata: ``metrics_url``, else ``url`` + path
    (None: not scraped)."""
    if not isinstance(meta, dict):
        return None
    url = meta.get("metrics_url")
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return url
    base = meta.get("url")
    if isinstance(base, str) and base.startswith(("http://", "https://")):
        return base.rstrip("/") + path
    return None


def _request(url: str) -> urllib.request.Request:
    """A GET of ``url``; user info in it becomes a Basic Authorization header (urllib would
    take it for part of the host name)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return urllib.request.Request(url)
    host = parts.netloc.rpartition("@")[2]
    plain = urllib.parse.urlunsplit(parts._replace(netloc=host))
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.request.Request(plain, headers={"Authorization": f"Basic {token}"})


def fetch(url: str, timeout: float) -> str:
    """The endpoint's text, read within ``timeout`` seconds in all; raises Unusable."""
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(_request(url), timeout=timeout) as answer:
            body = bytearray()
            while len(body) <= MAX_BYTES:
                if time.monotonic() > deadline:
                    raise Unusable(f"timed out after {timeout:g} s")
                chunk = answer.read(65536)
                if not chunk:
                    break
                body += chunk
            if len(body) > MAX_BYTES:
                raise Unusable(f"answer longer than {MAX_BYTES} bytes")
    except urllib.error.HTTPError as exc:
        raise Unusable(f"HTTP {exc.code}") from None
    except TimeoutError:
        raise Unusable(f"timed out after {timeout:g} s") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        if isinstance(exc, Unusable):
            raise
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise Unusable(f"timed out after {timeout:g} s") from None
        text = str(reason) or type(reason).__name__
        raise Unusable(hide_userinfo(scrub(" ".join(text.split())[:120], url))) from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise Unusable("not UTF-8 text") from None
