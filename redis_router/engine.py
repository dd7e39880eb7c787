"""What an engine reports of its own load: running and waiting requests, KV-cache usage.

``redis-router load`` scrapes the replicas' Prometheus endpoints and stores one
:class:`EngineLoad` per replica with ``engine_report.lua`` (keys ``P engine`` and
``P engine_at``, stamped with Redis's clock); ``report_engine_load`` stores figures obtained
any other way. Routing reads them beside the leases this library counts, and ignores a report
too old to trust: nothing here expires one (docs/engine-load.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The most requests an engine may claim to run or queue: more is taken for a broken figure.
MAX_REQUESTS = 10_000_000
# KV-cache usage is stored in thousandths; -1 stands for unknown.
PERMILLE = 1000
UNKNOWN = -1


def request_count(value: Any, what: str) -> int:
    """A count of requests, checked: an int in [0, MAX_REQUESTS]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int (requests), got {type(value).__name__}")
    if not 0 <= value <= MAX_REQUESTS:
        raise ValueError(f"{what} must be in [0, {MAX_REQUESTS}], got {value}")
    return value


def usage(value: Any, what: str) -> float | None:
    """A KV-cache usage, checked: None (unknown) or a finite number in [0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} must be a float in [0, 1] (the fraction of the KV cache in use) or None, "
            f"got {type(value).__name__}"
        )
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{what} must be a finite fraction in [0, 1] or None, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class EngineLoad:
    """One engine's own figures: requests it runs now, requests queued, and the fraction of its
    KV cache in use (None: unknown). Checked on construction."""

    running: int
    waiting: int
    kv_usage: float | None = None

    def __post_init__(self) -> None:
        request_count(self.running, "running")
        request_count(self.waiting, "waiting")
        object.__setattr__(self, "kv_usage", usage(self.kv_usage, "kv_usage"))

    def permille(self) -> int:
        """The KV-cache usage as stored: thousandths, rounded; -1 when unknown."""
        return UNKNOWN if self.kv_usage is None else round(self.kv_usage * PERMILLE)


def report_args(loads: Any, server_id: Any) -> list[str]:
    """``report_engine_load``'s argument as engine_report.lua's ARGV quads, every entry
    checked before anything is sent (``server_id`` checks an id)."""
    if not isinstance(loads, Mapping):
        raise TypeError(
            f"loads must be a mapping of server id to EngineLoad, got {type(loads).__name__}"
        )
    flat: list[str] = []
    for sid, load in loads.items():
        checked = server_id(sid)
        if not isinstance(load, EngineLoad):
            raise TypeError(
                f"loads[{sid!r}] must be an EngineLoad(running, waiting, kv_usage), got "
                f"{type(load).__name__}"
            )
        # A frozen dataclass can still be forged (object.__setattr__): check the figures again.
        running = request_count(load.running, f"loads[{sid!r}].running")
        waiting = request_count(load.waiting, f"loads[{sid!r}].waiting")
        usage(load.kv_usage, f"loads[{sid!r}].kv_usage")
        flat += (checked, str(running), str(waiting), str(load.permille()))
    return flat


def from_stored(raw: Any, now_ms: int) -> dict[str, Any] | None:
    """A status row's engine field ("<at_ms> <running> <waiting> <kv_permille> <leases_at>",
    "" = none) as status shows it: the figures and the report's age in seconds."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if not text:
        return None
    at, running, waiting, kv, leases = (int(x) for x in text.split())
    return {
        "running": running,
        "waiting": waiting,
        "kv_usage": None if kv < 0 else kv / PERMILLE,
        "leases_at": leases,
        "age_s": max(0, now_ms - at) / 1000,
    }
