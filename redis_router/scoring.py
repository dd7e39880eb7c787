"""Engine-aware scoring: least loaded on what the engines report, not on leases alone.

A lease count is exact for the requests routed here and blind to the rest: requests sent
around the router, a queue building inside a slow engine, KV memory held by idle sessions.
With scoring on, least loaded compares, per replica, its lease count plus what its engine's
latest report (``redis-router load``) shows beyond it (lib/scoring.lua): the running and
waiting requests the engine holds above the leases counted when the report was written, and
``kv_weight`` times its KV-cache usage. Leases taken since the report keep the score fresh
between scrapes; a report older than ``ttl`` counts for nothing, so a dead reporter leaves
routing on counts alone. A replica at or above ``kv_ceiling`` takes no new session while
another is below it, and with an affinity margin its sticky sessions move off it.
least_tokens adds the same extra to its tokens in flight, valued in tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIN_TTL, MAX_TTL = 0.1, 3600.0
MAX_KV_WEIGHT = 1_000_000.0


@dataclass(frozen=True)
class EngineScoring:
    """How engine reports weigh in: ``ttl`` (s) a report counts for, ``kv_weight`` the load
    (in requests) a full KV cache adds, ``kv_ceiling`` the KV usage (0-1] at or above which a
    replica takes no new session while another is below it (None: no ceiling)."""

    ttl: float = 10.0
    kv_weight: float = 4.0
    kv_ceiling: float | None = None

    def __post_init__(self) -> None:
        for field, value, lo, hi in (
            ("ttl", self.ttl, MIN_TTL, MAX_TTL),
            ("kv_weight", self.kv_weight, 0.0, MAX_KV_WEIGHT),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"engine_scoring.{field} must be a number, got {value!r}")
            if not (math.isfinite(value) and lo <= value <= hi):
                raise ValueError(f"engine_scoring.{field} must be in [{lo:g}, {hi:g}], got {value}")
        ceiling = self.kv_ceiling
        if ceiling is not None:
            if isinstance(ceiling, bool) or not isinstance(ceiling, (int, float)):
                raise TypeError(
                    f"engine_scoring.kv_ceiling must be a number or None, got {ceiling!r}"
                )
            if not (math.isfinite(ceiling) and 0.0 < ceiling <= 1.0):
                raise ValueError(f"engine_scoring.kv_ceiling must be in (0, 1], got {ceiling}")

    @property
    def setting(self) -> str:
        """The value pinned in P.."config" field ``engine``: every process must agree."""
        ceiling = "-" if self.kv_ceiling is None else str(round(self.kv_ceiling * 1000))
        return f"{round(self.ttl * 1000)} {float(self.kv_weight)!r} {ceiling}"

    @classmethod
    def parse(cls, setting: str) -> EngineScoring | None:
        """The scoring a pinned ``setting`` stands for (None: off)."""
        if not setting:
            return None
        ttl_ms, weight, ceiling = setting.split()
        return cls(
            int(ttl_ms) / 1000, float(weight), None if ceiling == "-" else int(ceiling) / 1000
        )


def engine_scoring(value: Any) -> EngineScoring | None:
    """The ``engine_scoring`` option: None/False (off), True (the defaults), a mapping of
    EngineScoring's fields (as YAML gives it), or an EngineScoring."""
    if value is None or value is False:
        return None
    if value is True:
        return EngineScoring()
    if isinstance(value, EngineScoring):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {"ttl", "kv_weight", "kv_ceiling"}
        if unknown:
            raise ValueError(
                f"engine_scoring has unknown fields {sorted(map(str, unknown))}: "
                "allowed are ttl, kv_weight, kv_ceiling"
            )
        return EngineScoring(**{str(k): v for k, v in value.items()})
    raise TypeError(
        "engine_scoring must be None, a bool, a mapping of ttl/kv_weight/kv_ceiling or an "
        f"EngineScoring, got {type(value).__name__}"
    )
