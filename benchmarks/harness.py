"""Timing, results and the table: what every comparison module shares."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Sizes:
    """How much work each comparison does; ``quick`` is the smoke-test size."""

    rounds: int  # interleaved repetitions per latency comparison
    block: int  # operations per timed block
    batch_k: int  # requests per acquire_many
    batch_rounds: int
    sessions: int  # sticky sessions for the memory comparison
    seconds: float  # duration of one throughput run
    throughput_runs: int
    kv_seconds: float  # measured window of one KV-events lag run
    kv_warmup: float  # publishing before that window

    @classmethod
    def default(cls) -> Sizes:
        return cls(15, 400, 1000, 7, 1_000_000, 3.0, 3, 10.0, 2.0)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(3, 40, 100, 2, 20_000, 0.6, 1, 1.0, 0.5)


@dataclass
class Row:
    """One line of the table: ``value`` against ``baseline_value`` (or alone, ``ratio`` None).

    ``target`` is the bound on ``ratio`` (or on ``value`` when there is no baseline):
    ("<=", 1.3) or (">=", 10). Rows without a target are context for the others.
    """

    id: str
    what: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float | None = None
    ratio: float | None = None
    target: tuple[str, float] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool | None:
        if self.extra.get("verified_same_as_sequential") is False:
            return False
        if self.target is None:
            return None
        subject = self.ratio if self.ratio is not None else self.value
        op, bound = self.target
        return subject <= bound if op == "<=" else subject >= bound

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["target"] = f"{self.target[0]} {self.target[1]:g}" if self.target else None
        out["passed"] = self.passed
        return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    a: Callable[[int], object], b: Callable[[int], object], rounds: int, block: int
) -> tuple[float, float, float]:
    """Time blocks of a and b alternately (order flipped every round, so neither always runs
    first). Returns (median s/op of a, median s/op of b, median of the per-round ratios a/b):
    a ratio taken within one round cancels the machine's drift between rounds."""
    ta: list[float] = []
    tb: list[float] = []
    for r in range(rounds):
        if r % 2:
            tb.append(timed(lambda: b(block)) / block)
            ta.append(timed(lambda: a(block)) / block)
        else:
            ta.append(timed(lambda: a(block)) / block)
            tb.append(timed(lambda: b(block)) / block)
    return median(ta), median(tb), median([x / y for x, y in zip(ta, tb, strict=True)])


def fmt_value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e6:.1f} us" if value < 1e-3 else f"{value * 1e3:.2f} ms"
    if unit == "B":
        return f"{value:.1f} B"
    if unit == "pairs/s":
        return f"{value:,.0f}/s"
    if unit == "%":
        return f"{value:.1f} %"
    return f"{value:g} {unit}"


def table(rows: list[Row]) -> str:
    """The human-readable table: one line per row, ratio and verdict last."""
    head = ("row", "measured", "baseline", "ratio", "target", "")
    lines = []
    for r in rows:
        base = f"{r.baseline}: {fmt_value(r.baseline_value, r.unit)}" if r.baseline else ""
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        target = ""
        if r.target:  # a bound on the ratio, else on the value itself, in the value's unit
            op, bound = r.target
            target = (
                f"{op} {bound:g}" if r.ratio is not None else f"{op} {fmt_value(bound, r.unit)}"
            )
        verdict = {True: "PASS", False: "FAIL", None: ""}[r.passed]
        lines.append((r.what, fmt_value(r.value, r.unit), base, ratio, target, verdict))
        if r.note:
            lines.append(("  " + r.note, "", "", "", "", ""))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    widths[0] = min(widths[0], 58)
    out = []
    for i, line in enumerate([head, *lines]):
        if line[1:] == ("", "", "", "", ""):
            out.append(line[0])
            continue
        out.append("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            out.append("-" * len(out[-1]))
    return "\n".join(out)


def finite_positive(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0
