"""A balancer's option groups as value objects: :class:`Affinity`, :class:`Groups` and
:class:`Ejection` (engine scoring's is :class:`~redis_router.scoring.EngineScoring`).

Each is checked when it is made, so a bad value is refused before a balancer exists, with the
option's name as a YAML router config or a CLI flag spells it (``affinity_margin``,
``eject_after``...). Those flat names keep working wherever options are given by name (a
balancer's keywords, ``router_kwargs``, the plugin YAMLs, the CLI): :func:`grouped` folds
them into the objects, and refuses one field given both ways.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import health, validation

# Bounds of the affinity options: a margin in in-flight requests, a ratio of in-flight counts.
MAX_AFFINITY_MARGIN = 1_000_000
MAX_AFFINITY_RATIO = 1_000_000.0
MAX_GROUP_CAP = 1_000_000
MAX_GROUP_BY = 16


@dataclasses.dataclass(frozen=True)
class Affinity:
    """How far a sticky session stays on its replica, and where a new session goes
    (docs/rl.md). Off under ``full_determinism``.

    ``margin`` (``affinity_margin``): a sticky turn stays while its replica has at most this
    many requests in flight more than the least loaded (None: always stays). ``ratio``
    (``affinity_ratio``): ... or at most this many times as many. ``spread_sessions``: new
    sessions' ties go to the replica with the fewest pinned sessions (end finished sessions
    with ``end_session``)."""

    margin: int | None = None
    ratio: float | None = None
    spread_sessions: bool = False

    def __post_init__(self) -> None:
        if self.margin is not None:
            _int(self.margin, "affinity_margin", 0, MAX_AFFINITY_MARGIN)
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
                raise TypeError(
                    f"affinity_ratio must be a number or None, got {type(self.ratio).__name__}"
                )
            if not 1.0 <= self.ratio <= MAX_AFFINITY_RATIO:  # also refuses NaN
                raise ValueError(
                    f"affinity_ratio must be in [1, {MAX_AFFINITY_RATIO:g}], got {self.ratio}"
                )
            object.__setattr__(self, "ratio", float(self.ratio))
        validation.flag(self.spread_sessions, "spread_sessions")


@dataclasses.dataclass(frozen=True)
class Groups:
    """Requests of one group (GRPO: the samples of one prompt) placed together (docs/rl.md).
    Off under ``full_determinism``.

    ``cap`` (``group_cap``): members of a group in a row on one replica (None: no cap).
    ``by`` (``group_by``): a separator deriving the group from the request id (the part
    before its last occurrence), for callers that cannot send ``group_id``."""

    cap: int | None = None
    by: str | None = None

    def __post_init__(self) -> None:
        if self.cap is not None:
            _int(self.cap, "group_cap", 1, MAX_GROUP_CAP)
        by = self.by
        if by is None:
            return
        if not isinstance(by, str):
            raise TypeError(
                f"group_by must be a str (a separator) or None, got {type(by).__name__}"
            )
        if not 1 <= len(by) <= MAX_GROUP_BY or not by.isprintable() or by.isspace():
            raise ValueError(
                f"group_by must be 1 to {MAX_GROUP_BY} printable characters, not only white "
                f"space (a separator such as '-'), got {by!r}"
            )


@dataclasses.dataclass(frozen=True)
class Ejection:
    """Passive health: a replica whose requests fail ``after`` times in a row is set aside
    (docs/operators.md). Off while ``after`` is None.

    ``after`` (``eject_after``); ``seconds`` (``eject_for``): the first ejection's length,
    doubled at each one in a row up to ``max_seconds`` (``eject_max``); ``max_share``
    (``max_ejected``): the largest share of the pool ejected at once; ``sticky``
    (``ejected_sticky``): where an ejected replica's sticky sessions go, "move" or "wait"."""

    after: int | None = None
    seconds: float = health.EJECT_FOR
    max_seconds: float = health.EJECT_MAX
    max_share: float = health.MAX_EJECTED
    sticky: str = "move"

    def __post_init__(self) -> None:
        self.setting  # noqa: B018 (checks every field)

    @property
    def setting(self) -> str:
        """The pinned field ``ejection`` ("after base_ms max_ms share mode"; "" = off)."""
        return health.ejection_setting(
            self.after, self.seconds, self.max_seconds, self.max_share, self.sticky
        )


def _int(value: Any, name: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


# Each group's class, and its fields by the flat names options are given by elsewhere.
GROUPS: dict[str, tuple[type[Any], dict[str, str]]] = {
    "affinity": (
        Affinity,
        {
            "affinity_margin": "margin",
            "affinity_ratio": "ratio",
            "spread_sessions": "spread_sessions",
        },
    ),
    "groups": (Groups, {"group_cap": "cap", "group_by": "by"}),
    "ejection": (
        Ejection,
        {
            "eject_after": "after",
            "eject_for": "seconds",
            "eject_max": "max_seconds",
            "max_ejected": "max_share",
            "ejected_sticky": "sticky",
        },
    ),
}
# A flat option name -> (its group, its field there).
FLAT = {
    flat: (group, field) for group, (_, fields) in GROUPS.items() for flat, field in fields.items()
}


def group(name: str, value: Any) -> Any:
    """The option group ``name`` given as ``value``: its object, a mapping of its fields (a
    YAML config's form), or None (every field at its default)."""
    cls, fields = GROUPS[name]
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = set(fields.values())
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise TypeError(
                f"unknown field(s) {unknown} for {name}; {cls.__name__} takes {sorted(known)}"
            )
        return cls(**value)
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    raise TypeError(
        f"{name} must be {article} {cls.__name__}, a mapping of its fields or None, got "
        f"{type(value).__name__}"
    )


def grouped(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with each group made an object (``group``), its flat-named fields folded
    in; TypeError for a field given both ways (flat, and in its group)."""
    out = {k: v for k, v in options.items() if k not in FLAT}
    for name, (_, fields) in GROUPS.items():
        flat = {fields[k]: options[k] for k in fields if k in options}
        given = out.get(name)
        if given is not None and flat:
            raise TypeError(
                f"option(s) {sorted(k for k in fields if k in options)} given both by name "
                f"and in {name}=; give each once"
            )
        out[name] = group(name, flat) if given is None else group(name, given)
    return out
