"""A pool sharded over K balancers, without I/O: the directory's operations, the shards'
names, what a process remembers of where sessions and replicas went, and the pool's status
as one.

Each shard is an ordinary balancer (its own hash tag, so its own Cluster slot) that routes
exactly inside itself over the replicas whose home it is; every state change is still one
script on one shard. What no shard can decide is which shard a new session (or GRPO group)
goes to: the directory, a few keys under the pool's own name (one more slot), decides that
in one atomic call per new session and records it, so a session that roams to another
process finds its shard again (docs/design.md, "One pool past one core").
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.crc import key_slot

from . import dp, health, validation
from .core import SEP, Call, Op
from .errors import ConfigMismatch, NoServersAvailable
from .scripts import load

MAX_SHARDS = 256
# A shard's in-flight total is published to the directory this often (by one process per
# period, whichever claims it): the model found 0.02-0.5 s equally good (docs/design.md).
PUBLISH_EVERY = 0.1
# Sessions (or groups) whose shard a process remembers without asking the directory.
REMEMBERED = 65_536
# A shard's balancer name: the pool's name, this, and a number (picked per Cluster primary).
SHARD_MARK = "/shard-"
MAX_NAME = 64 - len(SHARD_MARK) - 5


def pool_name(value: object) -> str:
    """A sharded pool's name: a balancer name short enough to carry its shards' suffix."""
    name = validation.name(value)
    if len(name) > MAX_NAME:
        raise ValueError(
            f"name of a sharded pool must be at most {MAX_NAME} characters (its shards are "
            f"named <name>{SHARD_MARK}<n>), got {len(name)}"
        )
    return name


def shard_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"shards must be an int, got {type(value).__name__}")
    if not 2 <= value <= MAX_SHARDS:
        raise ValueError(
            f"shards must be 2-{MAX_SHARDS} (a pool of one shard is an unsharded balancer: "
            f"RedisLoadBalancer), got {value}"
        )
    return value


def slot_of(name: str) -> int:
    """The Cluster slot of balancer ``name``'s keys (one hash tag: ``{name}``)."""
    return key_slot(f"rr:{{{name}}}:".encode())


def shard_names(
    name: str, k: int, primaries: Sequence[Sequence[tuple[int, int]]] = ()
) -> list[str]:
    """K shard names for pool ``name``. On a Cluster (``primaries``: each primary's slot
    ranges, in a fixed order) shard i's slot falls on primary i mod their number, so the
    shards split the Redis time evenly: consecutive numbers would put some primaries two
    shards and others none. Elsewhere, numbered 0..K-1."""
    return more_names(name, (), k, primaries)


def more_names(
    name: str, present: Sequence[str], k: int, primaries: Sequence[Sequence[tuple[int, int]]] = ()
) -> list[str]:
    """The layout's names grown to ``k``: the present ones, then new ones numbered after
    them (on a Cluster, shard i on primary i mod their number, as :func:`shard_names`)."""
    taken = [int(n.rsplit(SHARD_MARK, 1)[1]) for n in present if SHARD_MARK in n]
    n = max(taken, default=-1) + 1
    names = list(present)
    for i in range(len(present), k):
        while primaries and not any(
            lo <= slot_of(f"{name}{SHARD_MARK}{n}") <= hi
            for lo, hi in primaries[i % len(primaries)]
        ):
            n += 1
        names.append(f"{name}{SHARD_MARK}{n}")
        n += 1
    return names


def on_cluster(client: Any) -> bool:
    """Whether ``client`` is a Cluster's (redis-py's RedisCluster, either flavour)."""
    return hasattr(client, "cluster_slots") and hasattr(client, "nodes_manager")


def cluster_primaries(slots: Any) -> list[list[tuple[int, int]]]:
    """Each primary's slot ranges, primaries ordered by address, from redis-py's
    ``RedisCluster.cluster_slots()`` reply ({(lo, hi): {"primary": (host, port), ...}})."""
    by: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for (lo, hi), row in dict(slots).items():
        host, port = row["primary"][:2]
        by.setdefault((str(host), int(port)), []).append((int(lo), int(hi)))
    return [sorted(by[p]) for p in sorted(by)]


class Layout(NamedTuple):
    """A sharded pool as its directory holds it: the shards' balancer names and each
    replica's home shard."""

    names: list[str]
    homes: dict[str, int]


def capacities(servers: Mapping[str, Any], capacity: Mapping[str, int] | None) -> dict[str, int]:
    """Each replica's capacity (0: none declared; a data-parallel replica: its ranks' sum),
    checked as ``add_servers`` checks it, before anything is written."""
    checked = validation.servers_mapping(servers)
    units, declared, _ = dp.expand(checked, capacity)
    caps = health.capacities(units, declared)
    out = dict.fromkeys(checked, 0)
    for unit, cap in caps.items():
        out[dp.replica_of(unit)[0] if unit not in out else unit] += int(cap)
    return out


@dataclass
class Directory:
    """The directory's operations (each yields its one call): the layout, replicas' homes,
    sessions' shards, shards' published totals. Run by a balancer on the pool's own name,
    whose keys are the directory's."""

    name: str
    sticky_ms: int  # a generation of sessions' records: they live one to two after a lookup

    @classmethod
    def of(cls, name: str, sticky_ttl: float) -> Directory:
        return cls(name, int(sticky_ttl * 1000))

    @property
    def fresh_for(self) -> float:
        """Seconds a process uses a session's shard without asking again: a quarter of a
        generation, so the record it keeps alive by asking never lapses meanwhile."""
        return self.sticky_ms / 4000

    def _call(self, script: str, args: Iterable[Any]) -> Call:
        return Call(load(script), tuple(args))

    def layout(self, mode: str = "read", names: Sequence[str] = ()) -> Op[Layout]:
        """The pool's layout; ``mode`` "create" writes ``names`` if there is none, "grow"
        extends it to ``names`` (a refusal comes back as a script error: see :meth:`refused`)."""
        raw = yield self._call("shard_layout", (mode, json.dumps(list(names))))
        count, names_json = int(raw[0]), _text(raw[1])
        found = [str(n) for n in json.loads(names_json)]
        if len(found) != count:
            raise ConfigMismatch(f"sharded pool {self.name!r}: its layout is damaged")
        homes = {_text(raw[i]): int(_text(raw[i + 1]).split()[0]) for i in range(2, len(raw), 2)}
        return Layout(found, homes)

    def refused(self, exc: Exception) -> Exception:
        """What a layout call's script error means."""
        text = str(exc)
        if text.startswith("UNSHARDED"):
            return ConfigMismatch(
                f"an unsharded balancer named {self.name!r} holds replicas: a sharded "
                "pool needs a name of its own (or destroy() that balancer first)"
            )
        if text.startswith("LAYOUT"):
            return ConfigMismatch(
                f"sharded pool {self.name!r}: another process grew it at the same time; "
                "read it again and retry"
            )
        return exc

    def stats(self) -> Op[dict[str, int]]:
        """The directory's per-shard fields (``n:<s>``, ``in:<s>``, ...)."""
        raw = yield self._call("shard_stats", ())
        return {_text(raw[i]): int(_text(raw[i + 1])) for i in range(0, len(raw), 2)}

    def assign(self, caps: Mapping[str, int]) -> Op[dict[str, int]]:
        """Give each replica a home shard (kept if it has one): balanced by count, then
        capacity, in one script so concurrent adds never pick the same emptiest shard."""
        if not caps:
            return {}
        args = [x for sid, cap in caps.items() for x in (sid, cap)]
        got = yield self._call("shard_assign", args)
        return {sid: int(s) for sid, s in zip(caps, got, strict=True)}

    def unassign(self, server_ids: Sequence[str]) -> Op[int]:
        if not server_ids:
            return 0
        return int((yield self._call("shard_unassign", server_ids)))

    def place(self, keys: Sequence[str], avoid: Iterable[int] = (), rand: int = 0) -> Op[list[int]]:
        """Each key's shard (a session id or a group id): the recorded one, else the shard
        with the fewest requests per replica (``rand``: a random integer that breaks ties);
        ``avoid``: shards not to choose (a recorded one there is placed anew)."""
        got = yield self._call("shard_place", (rand, SEP.join(map(str, avoid)), *keys))
        return [int(s) for s in got]

    def totals(self, published: Mapping[int, int]) -> Op[list[int]]:
        """Publish shards' totals; returns the shards now due, claimed by this process. Also
        rotates the sessions' records once a generation (D2)."""
        args = [x for s, n in published.items() for x in (s, n)]
        period = int(PUBLISH_EVERY * 1000)
        head = (period, self.sticky_ms)
        return [int(s) for s in (yield self._call("shard_totals", (*head, *args)))]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Remembered:
    """Where this process's sessions went: key → shard, the newest ``REMEMBERED`` of them.
    An entry older than ``fresh_for`` (a quarter of a record's generation) is looked up
    again, which also keeps the record alive while the session lives only in this process."""

    def __init__(self, fresh_for: float, most: int = REMEMBERED) -> None:
        self._fresh_for, self._most = fresh_for, most
        self._shard: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def get(self, key: str) -> int | None:
        got = self._shard.get(key)
        if got is None or time.monotonic() - got[1] > self._fresh_for:
            return None
        self._shard.move_to_end(key)
        return got[0]

    def put(self, key: str, shard: int) -> None:
        self._shard[key] = (shard, time.monotonic())
        self._shard.move_to_end(key)
        while len(self._shard) > self._most:
            self._shard.popitem(last=False)

    def clear(self) -> None:
        self._shard.clear()


def home_of(homes: Mapping[str, int], server_id: str) -> int:
    """A replica's home shard; a data-parallel rank's is its replica's. An id without one
    goes to shard 0, whose answer for an unknown replica is the pool's."""
    shard = homes.get(server_id, homes.get(dp.replica_of(server_id)[0]))
    return shard if shard is not None else 0


def by_home(homes: Mapping[str, int], server_ids: Iterable[str]) -> dict[int, list[str]]:
    """``server_ids`` grouped by home shard (:func:`home_of`)."""
    out: dict[int, list[str]] = {}
    for sid in server_ids:
        out.setdefault(home_of(homes, sid), []).append(sid)
    return out


def no_shard(name: str) -> NoServersAvailable:
    return NoServersAvailable(
        f"sharded pool {name!r}: no shard has a replica: register replicas with add_servers() "
        "or `redis-router servers add`"
    )


def split_servers(
    servers: Mapping[str, Any], capacity: Mapping[str, int] | None, homes: Mapping[str, int]
) -> dict[int, tuple[dict[str, Any], dict[str, int] | None]]:
    """``servers`` (and their declared capacities) grouped by home shard."""
    out: dict[int, tuple[dict[str, Any], dict[str, int] | None]] = {}
    for sid, meta in servers.items():
        part = out.setdefault(homes[sid], ({}, {} if capacity is not None else None))
        part[0][sid] = meta
        if capacity is not None and part[1] is not None:
            part[1].update({u: c for u, c in capacity.items() if dp.replica_of(u)[0] == sid})
    return out


def placement(shards: Sequence[Any], stats: Mapping[str, int]) -> list[dict[str, Any]]:
    """The directory's view of each shard (``shards``: anything with a ``name``)."""
    return [
        {
            "shard": b.name,
            "replicas": stats.get(f"n:{s}", 0),
            "capacity": stats.get(f"cap:{s}", 0),
            "published_inflight": stats.get(f"in:{s}", 0),
            "placed_since": stats.get(f"new:{s}", 0),
        }
        for s, b in enumerate(shards)
    ]


# Status fields summed over the shards, and those that are lists to join.
_SUMMED = ("total_inflight", "active_servers", "registered_handles", "sticky_sessions")
_JOINED = ("draining_servers", "ejected_servers", "full_servers")


# A process is one holder on each shard it acquired on: the pool's process counts are the
# largest shard's (a lower bound), its lease counts the sum, its ages the oldest.
_HOLDERS_MOST = ("live", "dead", "unheard", "on_probation", "probation_ms", "unheard_ms")


def merged_holders(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in shards[0]:
        values = [s[field] for s in shards]
        if field == "probation_running":
            out[field] = any(values)
        elif field in _HOLDERS_MOST:
            out[field] = max(values)
        else:
            out[field] = sum(values)
    return out


def merged_waiting(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    served = sum(w["served"] for w in shards)
    waited = sum(w["mean_wait"] * w["served"] for w in shards)
    return {
        "now": sum(w["now"] for w in shards),
        "oldest_wait": max(w["oldest_wait"] for w in shards),
        "served": served,
        "mean_wait": waited / served if served else 0.0,
        "max_wait": max(w["max_wait"] for w in shards),
        "timed_out": sum(w["timed_out"] for w in shards),
        "abandoned": sum(w["abandoned"] for w in shards),
    }


def merged_status(name: str, shards: Sequence[Mapping[str, Any]], placing: Any) -> dict[str, Any]:
    """The pool's status as one (the shards' replicas together, their totals summed), with
    each shard's own under ``shards`` and the directory's view under ``placement``."""
    out: dict[str, Any] = dict(shards[0])
    out["name"] = name
    out["holders"] = merged_holders([s["holders"] for s in shards])
    out["waiting"] = merged_waiting([s["waiting"] for s in shards])
    replicas: dict[str, Any] = {}
    for s in shards:
        replicas.update(s["replicas"])
    out["replicas"] = replicas
    out["servers"] = {sid: r["inflight"] for sid, r in replicas.items()}
    for field in _SUMMED:
        out[field] = sum(int(s[field]) for s in shards)
    for field in _JOINED:
        out[field] = sorted(x for s in shards for x in s[field])
    out["dp_replicas"] = dp.grouped(replicas)
    out["shards"] = [
        {
            "name": s["name"],
            "servers": len(s["servers"]),
            "total_inflight": s["total_inflight"],
            "sticky_sessions": s["sticky_sessions"],
            "holders": s["holders"],
            "waiting": s["waiting"],
        }
        for s in shards
    ]
    out["placement"] = placing
    return out


def merged_bump(results: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """bump_weight_version() of every shard as one: the newest version, the drops summed."""
    out: dict[str, int] = {}
    for r in results:
        for k, v in r.items():
            out[k] = max(out.get(k, v), v) if k == "weight_version" else out.get(k, 0) + v
    return out
