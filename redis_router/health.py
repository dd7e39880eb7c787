"""Replica health and admission: ejection settings, capacities, and how status shows them.

Passive health (``lib/health.lua``): ``eject_after`` failed requests in a row (reported by
``Lease.fail()`` or ``release_server(..., failed=True)``, or by ``redis-router health``'s
probes) eject a replica for every process, for ``eject_for`` seconds times the ejections in a
row, at most ``eject_max``, while at most ``max_ejected`` of the pool is ejected. A capacity
(requests a replica can hold) is never exceeded by any acquire; an acquire that finds every
eligible replica full waits its turn (FIFO across processes) or fails with NoCapacity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

EJECT_FOR = 30.0  # s: the first ejection's length (Envoy's base_ejection_time)
EJECT_MAX = 300.0  # s: the longest ejection (Envoy's max_ejection_time)
MAX_EJECTED = 0.5  # share of the pool that may be ejected at once (Envoy: 10 %, SGLang: none)
MAX_EJECT_AFTER = 1_000_000
MAX_EJECT_SECONDS = 86_400.0
MAX_CAPACITY = 1_000_000_000
MAX_WAIT = 3600.0
# Longest single BLPOP of a waiting acquire (s): within the client's socket timeout (5 s); a
# wake lost in a failover is made up for by the next try.
BLOCK_MAX = 2.0


def _number(value: Any, what: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    if not (lo <= value <= hi) or math.isnan(value):
        raise ValueError(f"{what} must be in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


STICKY_MODES = ("move", "wait")


def ejection_setting(
    after: int | None,
    eject_for: float,
    eject_max: float,
    max_ejected: float,
    ejected_sticky: str = "move",
) -> str:
    """The pinned field ``ejection`` ("after base_ms max_ms share mode"; "" = off), checked."""
    if ejected_sticky not in STICKY_MODES:
        raise ValueError(
            f"ejected_sticky must be one of {STICKY_MODES} (where the sticky sessions of an "
            f"ejected replica go: elsewhere, or wait for it), got {ejected_sticky!r}"
        )
    base = _number(eject_for, "eject_for", 0.001, MAX_EJECT_SECONDS)
    top = _number(eject_max, "eject_max", 0.001, MAX_EJECT_SECONDS)
    share = _number(max_ejected, "max_ejected", 0.0, 1.0)
    if top < base:
        raise ValueError(f"eject_max ({top:g}s) must be at least eject_for ({base:g}s)")
    if after is None:
        return ""
    if isinstance(after, bool) or not isinstance(after, int):
        raise TypeError(f"eject_after must be an int or None, got {type(after).__name__}")
    if not 1 <= after <= MAX_EJECT_AFTER:
        raise ValueError(f"eject_after must be in [1, {MAX_EJECT_AFTER}], got {after}")
    return f"{after} {round(base * 1000)} {round(top * 1000)} {share!r} {ejected_sticky}"


def describe(setting: str) -> str:
    """A pinned ``ejection`` field as the options that make it."""
    if not setting:
        return "ejection off (eject_after=None)"
    after, base, top, share, *mode = setting.split()
    return (
        f"eject_after={after}, eject_for={int(base) / 1000:g}s, "
        f"eject_max={int(top) / 1000:g}s, max_ejected={share}, "
        f"ejected_sticky={mode[0] if mode else 'move'}"
    )


def wait_seconds(value: Any, what: str = "wait") -> float:
    """A waiting time for a full pool (0: fail at once)."""
    return _number(value, what, 0.0, MAX_WAIT)


def capacity(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int (requests the replica can hold), got {value!r}")
    if not 1 <= value <= MAX_CAPACITY:
        raise ValueError(f"{what} must be in [1, {MAX_CAPACITY}], got {value}")
    return value


def capacities(servers: Mapping[str, Any], given: Mapping[str, int] | None) -> dict[str, int]:
    """Each replica's declared capacity: ``given`` first, else its metadata's "capacity"."""
    if given is not None and not isinstance(given, Mapping):
        raise TypeError(f"capacity must be a mapping of server id to int, got {given!r}")
    out: dict[str, int] = {}
    for sid, meta in servers.items():
        if given is not None and sid in given:
            out[sid] = capacity(given[sid], f"capacity[{sid!r}]")
        elif isinstance(meta, Mapping) and meta.get("capacity") is not None:
            out[sid] = capacity(meta["capacity"], f"servers[{sid!r}]['capacity']")
    if given is not None:
        unknown = sorted(set(given) - set(servers))
        if unknown:
            raise ValueError(f"capacity names replicas not being added: {unknown}")
    return out


def replica_status(row: Mapping[str, Any], now: int, inflight: int) -> dict[str, Any]:
    """A status replica's health and admission fields (status.lua, by name)."""
    cap, until = row.get("capacity"), row.get("ejected_until")
    cap = int(cap) if cap is not None else None
    until_ms = int(until) if until is not None else None
    streak = int(row["streak"])
    return {
        "capacity": cap,
        "full": cap is not None and inflight >= cap,
        "ejected_until": until_ms / 1000 if until_ms is not None else None,
        "ejected_for": max(0.0, (until_ms - now) / 1000) if until_ms is not None else None,
        "ejected_why": row.get("ejected_why") or None,
        # Its last outcome was a failure (a request or a probe), ejection on or off.
        "failing": streak > 0,
        "failures_in_a_row": streak,
        "failures": int(row["failures"]),
        "ejections_in_a_row": int(row["ejections"]),
    }


MAX_REASON = 200  # characters of a failure's reason kept (lib/health.lua keeps 200 bytes)
_USER_INFO = re.compile(r"[^\s/@'\"]+@")


def reason(text: str) -> str:
    """A failure's reason as stored (a probe's error text): one line, at most MAX_REASON
    characters, with any user info of a URL in it (``user:password@``) hidden."""
    return _USER_INFO.sub("***@", " ".join(str(text).split()))[:MAX_REASON]


def last_error(row: Mapping[str, Any], now: int) -> dict[str, Any]:
    """A status replica's last failure (status.lua): its reason, and when (s, epoch) and how
    long ago; None when none was reported since the replica joined."""
    at = row.get("last_error_at")
    if at is None:
        return {"last_error": None, "last_error_at": None, "last_error_age": None}
    return {
        "last_error": row.get("last_error", ""),
        "last_error_at": int(at) / 1000,
        "last_error_age": max(0.0, (now - int(at)) / 1000),
    }


HOLDER_FIELDS = (
    "live",
    "dead",
    "awaiting_reclaim",
    "unheard",
    "probation_ms",
    "unheard_leases",
    "unheard_ms",
)


def holders_status(found: Mapping[str, Any]) -> dict[str, Any]:
    """Worker processes by liveness (status.lua): live (heard within their lease_ttl), dead,
    and unheard (their deadline passed during a gap in heartbeats: on probation, reclaimed
    when it ends unless heard again), with how long since the longest unheard was heard and
    whether the probation runs already (else the next heartbeat, acquire or reap starts it).
    ``on_probation`` is ``unheard`` under the name earlier versions used."""
    out: dict[str, Any] = {field: int(found[field]) for field in HOLDER_FIELDS}
    out["on_probation"] = out["unheard"]
    out["probation_running"] = bool(found["probation_running"])
    return out


def waiting_status(found: Mapping[str, Any]) -> dict[str, Any]:
    served = int(found["served"])
    return {
        "now": int(found["now"]),
        "oldest_wait": int(found["oldest_ms"]) / 1000,
        "served": served,
        "mean_wait": int(found["waited_ms"]) / served / 1000 if served else 0.0,
        "max_wait": int(found["max_ms"]) / 1000,
        "timed_out": int(found["timed_out"]),
        "abandoned": int(found["abandoned"]),
    }


def ejection_status(
    after: int | None, eject_for: float, eject_max: float, max_ejected: float, sticky: str
) -> dict[str, Any] | None:
    if after is None:
        return None
    return {
        "after": after,
        "eject_for": eject_for,
        "eject_max": eject_max,
        "max_ejected": max_ejected,
        "ejected_sticky": sticky,
    }
