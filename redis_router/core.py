"""The balancer's logic without I/O, shared by the sync and asyncio balancers.

Each operation is a generator: it validates its arguments (before anything is sent, I8),
yields :class:`Call` objects, receives each reply and returns the decoded result. The sync
balancer drives it with blocking calls, the asyncio one with awaits; nothing else differs.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from . import dp, engine, health, options, validation
from .errors import (
    BalancerClosed,
    ConfigMismatch,
    NoCapacity,
    NoServersAvailable,
    RedisUnavailable,
    ReplicaEjected,
)
from .policy import RoutingPolicy, make_policy
from .scoring import EngineScoring
from .scoring import engine_scoring as engine_scoring_option
from .scripts import Script, left_out, load

T = TypeVar("T")
S = TypeVar("S")
Op = Generator["Call", Any, T]

# Entries of dead holders (a holder or one of its leases each) one heartbeat or reap call
# examines. Acquires reap nothing; each reaping call stays about as short as an acquire, and
# the keeper and reap() send more while one comes back full, so Redis serves other clients in
# between however many leases a crash left.
REAP_CHUNK = 8
# An acquire refused for capacity first reclaims dead holders' leases, in at most this many
# reap calls (REAP_CHUNK entries each), and retries; the refusal stands only after that.
RECLAIM_CALLS = 16
# Leases a closing balancer ends per call (it calls again while some are left).
RETIRE_CHUNK = 256
# Lease entries heal.lua examines per call (a few replicas, once per lease_ttl per process).
HEAL_BUDGET = 512
# ... and waits out a probation after a pause of Redis (a holder unheard during it may be
# dead), plus this margin, before it reaps again.
PROBATION_SLACK = 0.05
# Heartbeats per lease_ttl: a holder survives three lost or late heartbeats in a row.
HEARTBEATS_PER_TTL = 4
# A lease younger than this (ms, Redis clock) is never ended by reconcile(): its grant may
# still be on its way to the process (coalesced, or in a slow reply).
RECONCILE_GRACE_MS = 60_000
# Extra slack (s) before a token held locally is forgotten because Redis no longer has it.
RECONCILE_MARGIN = 30.0
# How long a release's key is remembered (ms), so that a copy resent after a timeout (redis-py
# retries within ~15 s) reports the first copy's result and ends nothing else.
RESEND_WINDOW_MS = 30_000
# Before a token in a release, marks it as a hint: the lease this holder took for that request
# on that replica, ended if it is still there, else nothing (it was reclaimed or ended: the
# request's other leases there are other processes' turns).
HINT = "?"
# Before a request id: a release by replica only, hinting the process's own lease of that
# request (release.lua, Which).
BY_REPLICA = "\x1f"
# Between the server ids of an acquire's exclusion (lib/acquiring.lua; ids hold no control
# character).
SEP = "\x1f"
# Sticky sessions live in time buckets of sticky_ttl / STICKY_BUCKETS: a session expires between
# sticky_ttl and sticky_ttl * (1 + 1 / STICKY_BUCKETS) after its last turn.
STICKY_BUCKETS = 4
# A waiting acquire's ticket outlives its wait by this much (s), so its last try is never
# dropped from the queue; a waiter that gives up leaves at once (leave.lua).
WAIT_SLACK = 5.0
# A sticky session waiting for its ejected replica tries again this long (s) after the
# ejection's end, when an acquire has ended it.
EJECTION_SLACK = 0.01
# Tie-break entropy per request (bits); modulo bias over a few thousand ties is ~2**-36.
RAND_BITS = 48


_MISSING = object()
_NO_FIELDS: Mapping[str, Any] = {}
_IMMUTABLE = (str, int, float, bool, type(None))


class Call(NamedTuple):
    """One script invocation: KEYS[1] is always the balancer's key prefix.
    (Named tuples: built on every call, they cost a third of a frozen dataclass.)"""

    script: Script
    args: tuple[Any, ...]


class Heartbeat(NamedTuple):
    """What one heartbeat found."""

    registered_anew: bool  # the holder had been declared dead: its leases were reclaimed
    reclaimed: int  # leases of dead holders reclaimed by this call
    overdue: list[str]  # tokens of this holder's leases ended for outliving max_lease_age


class Grant(NamedTuple):
    """One routed request: where it goes and the lease that holds it there."""

    server_id: str
    handle: Any
    request_id: str
    token: str
    sticky: bool


OPTION_DEFAULTS: dict[str, Any] = {
    "redis": None,
    "name": "default",
    "full_determinism": False,
    "sticky_ttl": 3600.0,
    "lease_ttl": 20.0,
    "max_lease_age": 86400.0,
    "rng": None,
    "policy": None,
    "affinity": None,  # options.Affinity (None: its defaults), as the two groups below
    "groups": None,
    "ejection": None,
    "wait_timeout": 0.0,
    "engine_scoring": None,
}
# The option behind a pinned field, where their names differ.
_OPTION_OF = {
    "sticky_ttl_ms": "sticky_ttl",
    "engine": "engine_scoring",
    "spread": "spread_sessions",
}
# The acquire field naming a request's group (GRPO: the samples of one prompt).
GROUP_FIELD = "group_id"
# Fields of P.."config" every process must share, in the order the scripts send them.
PINNED_SETTINGS = (
    "sticky_ttl_ms",
    "affinity_margin",
    "affinity_ratio",
    "group_cap",
    "group_by",
    "ejection",
    "engine",
    "sticky_min_cached",
    "spread",
)


def build_core(
    default_policy: type[RoutingPolicy],
    router_kwargs: Mapping[str, Any] | None,
    policy_options: Mapping[str, Any],
    client_options: Sequence[str] = (),
    **given: Any,
) -> tuple[BalancerCore, Any]:
    """The balancers' construction in one place. ``given`` holds the constructor's named
    options; ``policy_options`` its other keywords: the core's options it does not name
    (``max_lease_age``, ``rng``, the option groups' flat names such as ``eject_after``)
    are taken out, the rest go to the routing policy. ``router_kwargs`` (e.g. the rest of a
    YAML router config) is folded in the same way, a key coming from one place only;
    ``client_options`` are named with the rest where an unknown option is refused. Returns
    the core and the ``redis`` option (a URL, a client or None) left for the caller."""
    opts = dict(given)
    extra = dict(policy_options)
    for key in [k for k in extra if _is_core_option(k)]:
        opts[key] = extra.pop(key)
    if router_kwargs is not None:
        if not isinstance(router_kwargs, Mapping):
            raise TypeError(f"router_kwargs must be a mapping, got {type(router_kwargs).__name__}")
        for key, value in router_kwargs.items():
            key = str(key)
            if key in extra or (key in opts and not _is_default(key, opts[key])):
                raise TypeError(f"option {key!r} given both as an argument and in router_kwargs")
            if _is_core_option(key):
                opts[key] = value
            else:
                extra[key] = value
    opts = {**OPTION_DEFAULTS, **options.grouped(opts)}
    known = sorted({*OPTION_DEFAULTS, *options.FLAT, *client_options, "router_kwargs"})
    opts["policy"] = make_policy(opts["policy"], default_policy, extra, known)
    redis = opts.pop("redis")
    return BalancerCore(**opts), redis


def _is_core_option(key: str) -> bool:
    return key in OPTION_DEFAULTS or key in options.FLAT


def _is_default(key: str, value: Any) -> bool:
    """Whether a named option holds its default (so router_kwargs may set it)."""
    default = OPTION_DEFAULTS.get(key, _nothing)
    return value is default or value == default


def fields_per_request(n: int, fields: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """acquire_many's keyword fields (one sequence per field, a value per request id) as one
    mapping per request; None values mean the field was not given."""
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    for key, values in given.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{key} must be a sequence with one value per request id")
        if len(values) != n:
            raise ValueError(f"{key} holds {len(values)} values for {n} request ids; give one each")
    return [{k: v[j] for k, v in given.items()} for j in range(n)]


class _Entropy:
    """os.urandom read 4 KiB at a time: a token costs a slice of a buffer, not a system call
    (~4 us here), on the path of every acquire and release. A forked child drops what it
    inherited, so no two processes ever hand out the same bytes. ``width`` characters of
    ``encode``d text carry ``unit`` random bytes."""

    SIZE = 4096

    def __init__(self, encode: Callable[[bytes], str], unit: int, width: int) -> None:
        self._encode, self._unit, self._width = encode, unit, width
        self._lock = threading.Lock()
        self._buf, self._at = "", 0

    def text(self, n: int) -> str:
        """n ids' worth of characters never handed out before."""
        need = self._width * n
        with self._lock:
            if self._at + need > len(self._buf):
                raw = os.urandom(max(self.SIZE // self._unit, n) * self._unit)
                self._buf, self._at = self._encode(raw), 0
            at = self._at
            self._at = at + need
            return self._buf[at : at + need]

    def ids(self, n: int) -> list[str]:
        """n ids never handed out before."""
        text, w = self.text(n), self._width
        return [text[i : i + w] for i in range(0, w * n, w)]

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._buf, self._at = "", 0


def _base64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


# Tokens: 16 hex digits (64 bits). Operation ids: 12 base64url characters (72 bits): Redis keeps
# each remembered release as its last three characters (a field it shares) and the other nine
# (lib/leases.lua), so an id's length is most of what a remembered release costs.
_tokens = _Entropy(bytes.hex, 8, 16)
_operations = _Entropy(_base64url, 9, 12)
os.register_at_fork(after_in_child=_tokens.forget)
os.register_at_fork(after_in_child=_operations.forget)


def new_token() -> str:
    """A lease token: unique across processes (never from the tie-break RNG, which tests seed)."""
    return _tokens.text(1)


def new_holder() -> str:
    """A holder id: one per balancer instance and process (a forked child gets its own)."""
    return "h" + os.urandom(8).hex()


def new_operation() -> str:
    """The operation id of one release, so that a resent copy of it is recognised."""
    return _operations.text(1)


def new_operations(n: int) -> list[str]:
    """Operation ids for n releases."""
    return _operations.ids(n)


def new_tokens(n: int) -> list[str]:
    """n lease tokens."""
    return _tokens.ids(n)


def _nothing() -> None:
    pass


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _meta_json(value: Any) -> str:
    """JSON for Redis; a value that is not JSON (a Ray actor handle) is stored as null."""
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return "null"


class BalancerCore:
    """Settings, argument packing and reply decoding for one balancer in one process."""

    def __init__(
        self,
        *,
        name: str,
        full_determinism: bool,
        sticky_ttl: float,
        lease_ttl: float,
        max_lease_age: float,
        rng: random.Random | None,
        policy: RoutingPolicy,
        affinity: options.Affinity,
        groups: options.Groups,
        ejection: options.Ejection,
        wait_timeout: float = 0.0,
        engine_scoring: EngineScoring | Mapping[str, Any] | bool | None = None,
    ) -> None:
        self.name = validation.name(name)
        self.prefix = f"rr:{{{self.name}}}:"
        if not isinstance(full_determinism, bool):
            raise TypeError(
                f"full_determinism must be a bool, got {type(full_determinism).__name__}"
            )
        self.full_determinism = full_determinism
        self.sticky_ttl = validation.seconds(sticky_ttl, "sticky_ttl", validation.MAX_TTL)
        self.lease_ttl = validation.seconds(
            lease_ttl, "lease_ttl", validation.MAX_LEASE_TTL, validation.MIN_LEASE_TTL
        )
        self.max_lease_age = validation.seconds(max_lease_age, "max_lease_age", validation.MAX_TTL)
        if self.max_lease_age < self.lease_ttl:
            raise ValueError(
                f"max_lease_age ({self.max_lease_age:g}s) must be at least lease_ttl "
                f"({self.lease_ttl:g}s)"
            )
        if rng is not None and not callable(getattr(rng, "getrandbits", None)):
            raise TypeError(f"rng must be a random.Random (or None), got {type(rng).__name__}")
        self._getrandbits = (rng or random.Random(os.urandom(16))).getrandbits
        # Affinity tolerance, off under full_determinism (a session's replica must stay a
        # function of its id); the values sent are the ones pinned ("" = off).
        self.affinity_margin, self.affinity_ratio = affinity.margin, affinity.ratio
        # Group affinity: group_cap members of a group in a row on one replica (None: no cap);
        # group_by derives a group from the request id. Both off under full_determinism too.
        self.group_cap, self.group_by = groups.cap, groups.by
        on = not full_determinism
        self.routing = (
            str(self.affinity_margin) if on and self.affinity_margin is not None else "",
            repr(self.affinity_ratio) if on and self.affinity_ratio is not None else "",
            str(self.group_cap) if on and self.group_cap is not None else "",
            self.group_by if on and self.group_by is not None else "",
        )
        # New sessions' ties go to the replica with the fewest pinned sessions (lib/picking.lua),
        # pinned ("1" = on, "" = off); off under full_determinism as well.
        self.spread_sessions = affinity.spread_sessions
        self.spread = "1" if on and self.spread_sessions else ""
        # Passive health, pinned for every process ("" = off): lib/health.lua.
        self.ejection = ejection.setting
        self.ejected_sticky = ejection.sticky
        self.eject_after, self.eject_for = ejection.after, float(ejection.seconds)
        self.eject_max, self.max_ejected = float(ejection.max_seconds), float(ejection.max_share)
        # Least loaded on the engines' reports as well as the leases (redis_router.scoring),
        # pinned for every process ("" = off).
        self.engine_scoring = engine_scoring_option(engine_scoring)
        self.engine = self.engine_scoring.setting if self.engine_scoring else ""
        # Eviction-aware stickiness: the policy's option (a policy reading a KV index), pinned
        # for every process ("" = off; off under full_determinism, as the affinity options).
        share = policy.sticky_min_cached
        self.min_cached = repr(float(share)) if on and share is not None else ""
        # How long an acquire waits for a full pool by default (0: NoCapacity at once).
        self.wait_timeout = health.wait_seconds(wait_timeout, "wait_timeout")
        self.lease_ms = round(self.lease_ttl * 1000)
        self.max_age_ms = round(self.max_lease_age * 1000)
        # The background keeper's period (s): a live holder's deadline never comes closer than
        # lease_ttl * (1 - 1 / HEARTBEATS_PER_TTL).
        self.heartbeat_every = self.lease_ttl / HEARTBEATS_PER_TTL
        self.sticky_ms = max(1, round(self.sticky_ttl * 1000))
        self.width_ms = -(-self.sticky_ms // STICKY_BUCKETS)
        # Bucket cur - k expires at (cur - k + 1) * width + ttl, so at any instant of bucket cur
        # only k <= ceil(ttl / width) can be alive: searching further back finds nothing.
        self.span = -(-self.sticky_ms // self.width_ms)
        # The settings the acquire and heartbeat scripts read, by name (ARGV[1]; decoded once
        # per Functions library, lib/base.lua config()).
        self.config = self.settings_map()
        self.new_holder()
        self.handles: dict[str, Any] = {}
        self._decoded: dict[str, Any] = {}
        self.policy = policy
        # The keywords an acquire takes besides its own (wait, token...): the fields the
        # policy reads, and group_id, which every acquire reads (see check_acquire).
        self.accepted_fields = frozenset((*policy.acquire_fields, GROUP_FIELD))
        # Set by the balancer's close(): it routes nothing more (see check_acquire).
        self.closed = False
        # The acquire script composed for these settings: no code for an option they leave off.
        self._acquire = policy.script_without(left_out(self.settings()))
        self._release = load("release")
        # Called before every acquire, whichever router's script it runs: the balancer starts
        # its keeper here, so no path can take a lease that nothing keeps alive.
        self.on_acquire: Callable[[], None] = _nothing

    def check_acquire(self, fields: Mapping[str, Any], exclude: object = None) -> tuple[str, ...]:
        """Refuse an acquire, before anything is sent, once the balancer is closed
        (BalancerClosed: its leases were ended and no keeper would keep a new one alive), or
        when a keyword is not a field the policy reads (TypeError naming it: a mistyped
        ``wait`` would otherwise be taken for a field and ignored). Returns the exclusion,
        checked (validation.exclusion)."""
        if self.closed:
            raise self.closed_error()
        if fields and not self.accepted_fields.issuperset(fields):
            unknown = sorted(k for k in fields if k not in self.accepted_fields)
            raise TypeError(
                f"unknown keyword(s) {unknown} for an acquire of balancer {self.name!r}: "
                f"it takes wait= (acquire: token=; lease: renew_every=) and the request fields "
                f"it reads (policy {self.policy.name!r}): {sorted(self.accepted_fields)}"
            )
        return validation.exclusion(exclude)

    def closed_error(self) -> BalancerClosed:
        return BalancerClosed(
            f"balancer {self.name!r} was closed (its leases were ended and nothing keeps new "
            "ones alive); create a new one"
        )

    def new_holder(self) -> None:
        """Take a fresh holder id (at construction, and in a forked child: a child must not
        keep its parent's leases alive, nor have its own reclaimed when the parent exits)."""
        self.holder = new_holder()
        # Tokens of the leases this holder holds (token -> when granted, monotonic s): what
        # reconcile() compares with Redis. Released tokens leave it before the release is sent.
        self.held: dict[str, float] = {}
        # (replica, request id) -> the token of this holder's latest lease of that request
        # there: a release by request id names it, so the script ends it without a lookup
        # (a hint: when that lease is gone, reclaimed or ended, the release ends nothing, as
        # the request's other leases there are other processes').
        self.latest: dict[tuple[str, str], str] = {}
        # ... and the tokens of its earlier leases of that request there, still held when a
        # later one was granted (oldest first): each is named in its turn once the latest is
        # released, so a process that held a request there always sends a hint.
        self.earlier: dict[tuple[str, str], list[str]] = {}
        # Tokens a release has named that Redis has not answered for yet: they have left
        # `held`, but the release may not have run, so reconcile() must not take them for
        # leases the process no longer holds (it would end one and the release find nothing).
        self.releasing: set[str] = set()
        # Set by destroy(): the next heartbeat registering the holder anew is expected.
        self.destroyed = False
        # An acquire's first arguments: settings, holder, waiting ticket and exclusion (none).
        self._acquire_head = (self.config, self.holder, "", "")

    # -- replies ---------------------------------------------------------------------------

    def script_error(self, exc: Exception) -> Exception:
        """Map an error raised inside a script to the library's exception."""
        text = str(exc)
        if text.startswith("CONFIGMISMATCH"):
            _, field, *value = text.split()
            return self.config_mismatch(field, value[0] if value else "")
        if text.startswith("EJECTED"):
            _, left, sid = text.split(" ", 2)  # a server id may hold spaces: it comes last
            seconds = max(0.0, int(left) / 1000)
            return ReplicaEjected(
                f"balancer {self.name!r}: the session's replica {sid!r} is ejected (failing) "
                f"for {seconds:.1f}s more, and ejected_sticky='wait' keeps sessions on their "
                "replica; wait longer (wait=seconds), or use ejected_sticky='move'",
                sid,
                seconds,
            )
        if text.startswith("NOCAPACITY"):
            return NoCapacity(
                f"balancer {self.name!r}: every replica that could take the request is full "
                "(its declared capacity reached) or ejected, or earlier requests are waiting "
                "for one; wait for a place (wait=seconds, or the balancer's wait_timeout), "
                "retry later, or add replicas"
            )
        if text.startswith("NOSERVERS every replica accepting new sessions is excluded"):
            return NoServersAvailable(
                f"balancer {self.name!r}: every replica accepting new sessions was excluded "
                "from this acquire (exclude=...): none is left to route the request to"
            )
        if text.startswith("NOSERVERS"):
            return NoServersAvailable(
                f"balancer {self.name!r}: no replica is accepting new sessions: the pool is empty "
                "(never registered, or lost when a Redis without persistence restarted) or "
                "every replica is draining; the process that owns the replica list must "
                "register them (again) with add_servers() or `redis-router servers add`"
            )
        return exc

    def handle(self, server_id: str, meta: Any) -> Any:
        """The value this process registered for server_id, else its JSON metadata from Redis."""
        local = self.handles.get(server_id, _MISSING)
        if local is not _MISSING:
            return local
        if meta is None:
            return None
        meta = _str(meta)
        value = self._decoded.get(meta, _MISSING)
        if value is _MISSING:
            value = json.loads(meta)
            if isinstance(value, _IMMUTABLE) and len(self._decoded) < 4096:
                self._decoded[meta] = value  # only immutable values are shared between calls
        return value

    # -- operations ------------------------------------------------------------------------

    def settings(self) -> dict[str, str]:
        """The values this process pins in P.."config" ("" = off), by field."""
        values = (
            str(self.sticky_ms),
            *self.routing,
            self.ejection,
            self.engine,
            self.min_cached,
            self.spread,
        )
        return dict(zip(PINNED_SETTINGS, values, strict=True))

    def settings_map(self, lease_ms: int | None = None) -> str:
        """The settings the acquire and heartbeat scripts read, by name, as one JSON object
        (``lease_ms``: another lease ttl than this process's, for a tool's heartbeats)."""
        settings = {
            "lease_ms": self.lease_ms if lease_ms is None else lease_ms,
            "width_ms": self.width_ms,
            "span": self.span,
            "deterministic": self.full_determinism,
            "pinned": self.settings(),
        }
        return json.dumps(settings, separators=(",", ":"), sort_keys=True)

    def heartbeat_args(
        self, holder: str | None = None, *, lease_ms: int | None = None, budget: int = REAP_CHUNK
    ) -> tuple[str | int, ...]:
        """heartbeat.lua's arguments: this holder's, or another's with its own lease ttl (a
        tool listening beside the balancer) and reaping budget."""
        config = self.config if lease_ms is None else self.settings_map(lease_ms)
        return (config, holder or self.holder, self.max_age_ms, RESEND_WINDOW_MS, budget)

    def config_mismatch(self, field: str, pinned: str) -> ConfigMismatch:
        mine = self.settings().get(field, "")
        if field == "ejection":
            what, theirs = health.describe(mine), health.describe(pinned)
        elif field == "engine":
            what = f"engine_scoring={EngineScoring.parse(mine)}"
            theirs = f"{EngineScoring.parse(pinned)}"
        elif field == "spread":
            what, theirs = f"spread_sessions={mine == '1'}", f"spread_sessions={pinned == '1'}"
            if self.full_determinism:
                what += " (full_determinism turns it off)"
        elif field == "sticky_ttl_ms":
            what = f"sticky_ttl={self.sticky_ttl:g}s"
            theirs = f"{int(pinned) / 1000:g}s" if pinned.isdigit() else repr(pinned)
        else:
            what = f"{field}={mine or 'off'}"
            if self.full_determinism and field != "sticky_ttl_ms":
                what += " (full_determinism turns it off)"
            theirs = pinned or "off"
        return ConfigMismatch(
            f"balancer {self.name!r}: {what}, but the balancer's processes already use "
            f"{theirs} (pinned in Redis key {self.prefix}config by the first process that "
            f"acquired). Use the same {_OPTION_OF.get(field, field)} in every process, or "
            "destroy() the balancer to start over."
        )

    def setup(self, servers: Mapping[str, Any]) -> Op[None]:
        """Check the pinned settings (read only: the first acquire pins them, and every new
        holder's first acquire checks them again), then register ``servers`` if any."""
        pinned = yield Call(load("configure"), PINNED_SETTINGS)
        for field, value in zip(PINNED_SETTINGS, pinned, strict=True):
            if value is not None and _str(value) != self.settings()[field]:
                raise self.config_mismatch(field, _str(value))
        if servers:
            yield from self.add_servers(servers)

    @property
    def release_script(self) -> Script:
        """The script every release runs."""
        return self._release

    def acquire(
        self,
        request_ids: list[str],
        tokens: list[str] | None = None,
        fields: Sequence[Mapping[str, Any]] | None = None,
        *,
        args: Sequence[tuple[str, ...]] | None = None,
        ticket: str | None = None,
        exclude: Sequence[str] = (),
    ) -> Op[list[Grant]]:
        """Route requests through the policy's script; ``fields`` (one mapping per request)
        become its per-request arguments, checked before anything is sent (``args``: those
        arguments, already made by :meth:`request_args`). ``ticket``: the waiting ticket
        this call serves (see :meth:`enqueue`). ``exclude``: server ids (checked, see
        validation.exclusion) that no request of the call may go to, sticky or new."""
        self.on_acquire()
        script, rand, policy = self._acquire, self._getrandbits, self.policy
        head = self._acquire_head
        if ticket is not None or exclude:
            head = (head[0], head[1], ticket or "", SEP.join(exclude))
        n = len(request_ids)
        if fields is not None and len(fields) != n:
            raise ValueError(f"got {len(fields)} field sets for {n} request ids; give one each")
        if args is None and (
            policy.arity
            or self.group_by is not None
            or (fields is not None and any(GROUP_FIELD in f for f in fields))
        ):
            given = fields if fields is not None else [_NO_FIELDS] * n
            args = [self.request_args(rid, f) for rid, f in zip(request_ids, given, strict=True)]
        if n == 1 and (args is None or len(args) == 1) and (tokens is None or len(tokens) == 1):
            token = tokens[0] if tokens else new_token()  # the common case, without loops
            extra = args[0] if args is not None else ("",)
            argv = (*head, request_ids[0], token, str(rand(RAND_BITS)), *extra)
            sid, meta, how = yield Call(script, argv)
            sid = _str(sid)
            self.held[token] = time.monotonic()
            self._granted((sid, request_ids[0]), token)
            return [Grant(sid, self.handle(sid, meta), request_ids[0], token, how == 1)]
        tokens = tokens or new_tokens(n)
        flat: list[Any] = list(head)
        if args is None:
            for rid, token in zip(request_ids, tokens, strict=True):
                flat += (rid, token, str(rand(RAND_BITS)), "")
        else:
            for rid, token, extra in zip(request_ids, tokens, args, strict=True):
                flat += (rid, token, str(rand(RAND_BITS)), *extra)
        raw = yield Call(script, tuple(flat))
        handle, now = self.handle, time.monotonic()
        self.held.update((token, now) for token in tokens)
        grants = [
            Grant(sid, handle(sid, meta), rid, token, how == 1)
            for sid, meta, how, rid, token in zip(
                map(_str, raw[0::3]), raw[1::3], raw[2::3], request_ids, tokens, strict=True
            )
        ]
        for g in grants:
            self._granted((g.server_id, g.request_id), g.token)
        return grants

    def _granted(self, key: tuple[str, str], token: str) -> None:
        """``token`` is this holder's latest lease of request key[1] on replica key[0]; the one
        it covers waits its turn in ``earlier``."""
        covered = self.latest.get(key)
        self.latest[key] = token
        if covered is not None and covered != token:
            self.earlier.setdefault(key, []).append(covered)

    def _uncover(self, key: tuple[str, str]) -> None:
        """The latest lease of ``key`` was named by a release: the one before it, still held,
        is the latest now."""
        stack = self.earlier.get(key)
        while stack:
            token = stack.pop()
            if token in self.held:
                self.latest[key] = token
                break
        if stack is not None and not stack:
            self.earlier.pop(key, None)

    def group_of(self, request_id: str, fields: Mapping[str, Any]) -> str:
        """A request's group ("" = none): its ``group_id`` field, else its request id up to the
        last ``group_by`` separator ("prompt17-s3" -> "prompt17" with "-"). Off under
        full_determinism, where a replica is a function of the request id alone."""
        given = fields.get(GROUP_FIELD)
        if given is not None:
            group = validation.request_id(given, GROUP_FIELD)
        elif self.group_by is not None:
            head, sep, _ = request_id.rpartition(self.group_by)
            group = head if sep else ""
        else:
            return ""
        return "" if self.full_determinism else group

    def request_args(self, request_id: str, fields: Mapping[str, Any]) -> tuple[str, ...]:
        """A request's script arguments after (request id, token, random integer): its group,
        then its policy's own; checked before anything is sent."""
        group = self.group_of(request_id, fields)
        if self.policy.arity:
            return (group, *self.policy.request_args(fields))
        return (group,)

    @property
    def acquire_fields(self) -> tuple[str, ...]:
        """The request fields acquires read: the policy's, and group_id while groups are on."""
        fields = self.policy.acquire_fields
        if self.group_cap is not None or self.group_by is not None:
            fields = (*fields, GROUP_FIELD)
        return fields

    def release(
        self,
        server_id: str,
        request_id: str | None,
        token: str | None = None,
        failed: bool = False,
    ) -> Op[bool]:
        if failed or self.ejection:
            return (yield from self.release_many([(server_id, request_id, token)], [failed]))[0]
        # The common case: one release, no health marks (release_many does the same per item).
        request_id, named = self._named(server_id, request_id, token)
        try:
            return self._ended(
                (yield Call(self._release, (server_id, request_id, named, new_operation())))[0]
            )
        finally:
            self._answered((named,))

    def _named(self, server_id: str, request_id: str | None, token: str | None) -> tuple[str, str]:
        """The request id and token a release sends: its own token, else this holder's latest
        lease of the request there as a hint ("?token"), else none; without a request id, its
        oldest lease on that replica as a hint (so a process never ends another's lease while
        its own stays counted). A hint whose lease is gone ends nothing: only a process that
        never held the request there (no hint) gets the request's, or replica's, oldest. The
        lease leaves the local ledger now, even if the call fails (reconcile() ends it then),
        and is in `releasing` until answered."""
        if not request_id and not token:
            # The ledger is in acquire order; a copy, as other threads may change it.
            held, latest = self.held, self.latest
            for key, mine in latest.copy().items():
                if key[0] == server_id and mine in held:
                    if latest.get(key) == mine:
                        latest.pop(key, None)
                        if self.earlier:
                            self._uncover(key)
                    held.pop(mine, None)
                    self.releasing.add(mine)
                    return BY_REPLICA + key[1], HINT + mine
            return "", ""
        return request_id or "", self._token_named(server_id, request_id, token)

    def _token_named(self, server_id: str, request_id: str | None, token: str | None) -> str:
        if request_id:
            latest = self.latest
            key = (server_id, request_id)
            mine = latest.pop(key, None)
            if mine is not None:
                if mine != token and token is not None:
                    latest[key] = mine
                elif self.earlier:
                    self._uncover(key)
                if token is None:
                    self.held.pop(mine, None)
                    self.releasing.add(mine)
                    return HINT + mine
        if not token:
            return ""
        if self.held.pop(token, None) is not None and not request_id:
            self._forget(token)  # named by its token alone: its request is not known here
        self.releasing.add(token)
        return token

    def _answered(self, named: Iterable[str]) -> None:
        """The release that named these tokens was answered (or failed, or was abandoned)."""
        releasing = self.releasing
        for name in named:
            if name:
                releasing.discard(name[1:] if name[0] == HINT else name)

    def _ended(self, outcome: Any) -> bool:
        """A release's outcome: True if a lease ended (its token, or 1 for a resent copy)."""
        if isinstance(outcome, (str, bytes)):  # a release by request or replica: its token
            token = _str(outcome)
            if self.held.pop(token, None) is not None:
                # A release that named none of this holder's leases (it held none there when
                # it was made) ended one granted to it meanwhile.
                self._forget(token)
        return bool(outcome != 0)

    def _forget(self, token: str) -> None:
        """``token`` left ``held`` other than by a release naming it: where it was the latest
        lease of its request there, the one before it, still held, is the latest now (else a
        later release would name the ended lease and leave that one counted)."""
        latest = self.latest
        for key, mine in latest.copy().items():
            if mine == token and latest.get(key) == token:
                latest.pop(key, None)
                self._uncover(key)

    def release_many(
        self,
        releases: Sequence[tuple[str, str | None, str | None]],
        failed: Sequence[bool] | None = None,
    ) -> Op[list[bool]]:
        """End leases in order, in one call: (server id, request id, token) each, as release.
        Each gets an operation id, made here, before the first send: a copy resent after a
        timeout is recognised by it, reports the first copy's result and ends nothing more.
        ``failed`` (one flag per release): the request failed, which counts toward ejecting
        its replica (passive health); any other release clears the replica's streak."""
        if len(releases) == 1 and failed is None and not self.ejection:
            return [(yield from self.release(*releases[0]))]  # the common case, without loops
        flat: list[str] = []
        ops = new_operations(len(releases))
        if failed is not None or self.ejection:
            # "!": the request failed; "+": it succeeded and ends a failure streak (only
            # with ejection on: off, no streak exists and a release costs no health call).
            ok = "+" if self.ejection else ""
            bad = failed or [False] * len(ops)
            ops = [("!" if b else ok) + op for op, b in zip(ops, bad, strict=True)]
        resolved = [self._named(sid, request_id, token) for sid, request_id, token in releases]
        names = [named for _, named in resolved]
        for (server_id, _, _), (request_id, named), op in zip(releases, resolved, ops, strict=True):
            flat += (server_id, request_id, named, op)
        try:
            return [self._ended(outcome) for outcome in (yield Call(self._release, tuple(flat)))]
        finally:
            self._answered(names)

    def renew(self, token: str, remaining: int | None = None) -> Op[bool]:
        """Restart the lease's age (max_lease_age); liveness needs no renewal. ``remaining``:
        the lease's weight from now on, what is left of its work in its policy's units
        (least_tokens: :meth:`~redis_router.plugins.least_tokens.LeastTokens.weigh`); an
        absolute value, so a resent renew changes nothing more. None keeps the weight."""
        if remaining is None:
            args: tuple[str, ...] = (token,)
        else:
            args = (token, str(validation.weight(remaining, "remaining")))
        if token in self.held:
            self.held[token] = time.monotonic()
        return bool((yield Call(load("renew"), args)) == 1)

    def reconcile(self) -> Op[int]:
        """End the leases Redis counts for this holder but the process no longer holds: a
        release lost in a failover (asynchronous replication), or one that failed in an outage
        after the caller gave up, or an acquire whose reply never came. Only leases older than
        RECONCILE_GRACE_MS are compared, so a grant still on its way back is never taken for
        one. Returns how many leases ended."""
        owned = [_str(t) for t in (yield Call(load("owned"), (self.holder, RECONCILE_GRACE_MS)))]
        # Other threads acquire and release meanwhile (a sync balancer's keeper runs in its
        # own thread): read the ledgers through copies (one C call each, atomic) and remove
        # entries with pop, never iterating a dict another thread may be changing.
        held, latest = self.held, self.latest
        now_held, releasing = held.copy(), self.releasing.copy()
        stale = [t for t in owned if t not in now_held and t not in releasing]
        # Forget tokens Redis no longer has (released by request id in a resent call, ended
        # by another process): only those held locally for longer than Redis was asked about.
        cutoff = time.monotonic() - RECONCILE_GRACE_MS / 1000 - RECONCILE_MARGIN
        in_redis = set(owned)
        for token, at in now_held.items():
            if at < cutoff and token not in in_redis:
                held.pop(token, None)
        for key, token in latest.copy().items():
            if token not in held and latest.get(key) == token:
                latest.pop(key, None)
                self._uncover(key)
        for key, stack in self.earlier.copy().items():
            if not any(t in held for t in stack) and self.earlier.get(key) is stack:
                self.earlier.pop(key, None)
        if not stale:
            return 0
        return int((yield Call(load("forget"), (self.holder, RECONCILE_GRACE_MS, *stale))))

    def heartbeat(self) -> Op[Heartbeat]:
        """Keep every lease of this holder alive for lease_ttl more, end those older than
        max_lease_age, and reclaim the leases of dead holders, a chunk per call."""
        anew, reclaimed, examined, overdue = yield Call(load("heartbeat"), self.heartbeat_args())
        if int(examined) >= REAP_CHUNK:
            reclaimed = int(reclaimed) + (yield from self.reap())
        # Only a heartbeat that found the holder gone consumes the mark of this process's own
        # destroy: one that ran before the destroy may be answered after it.
        expected = anew == 1 and self.destroyed
        if expected:
            self.destroyed = False
        return Heartbeat(anew == 1 and not expected, int(reclaimed), [_str(t) for t in overdue])

    def heal(self) -> Op[tuple[int, int]]:
        """Repair a few replicas' counts, request index entries and this holder's lease set
        that an evicting maxmemory-policy broke (lease records gone, their entries and counts
        left): (entries dropped, counts set right)."""
        dropped, fixed = yield Call(load("heal"), (HEAL_BUDGET, self.holder))
        return int(dropped), int(fixed)

    def enqueue(self, ticket: str, wait: float) -> Op[int]:
        """Queue a waiting acquire (FIFO across processes) for at most ``wait`` seconds;
        returns how many wait before it. Its process then blocks on :meth:`wake_key`."""
        return int((yield Call(load("enqueue"), (ticket, self.holder, round(wait * 1000)))))

    def leave(self, ticket: str) -> Op[bool]:
        """A waiting acquire gives up: its ticket leaves the queue (a wake passes on)."""
        return bool((yield Call(load("leave"), (ticket,))) == 1)

    def wake_key(self, ticket: str) -> str:
        """The list a waiting acquire blocks on (BLPOP); a script pushes to it to wake it."""
        return f"{self.prefix}wake:{ticket}"

    def report(self, outcomes: Sequence[tuple[str, bool, str]]) -> Op[dict[str, str]]:
        """Feed health probe outcomes (server id, healthy, why) to passive health: the same
        streaks and ejections as failed requests. Returns each pool member's state."""
        flat: list[str] = []
        for sid, ok, why in outcomes:
            flat += (validation.server_id(sid), "1" if ok else "0", health.reason(why))
        if not flat:
            return {}
        raw = yield Call(load("report"), tuple(flat))
        return {_str(raw[i]): _str(raw[i + 1]) for i in range(0, len(raw), 2)}

    def report_engine(self, loads: Mapping[str, engine.EngineLoad]) -> Op[int]:
        """Store what the engines report of their own load ({server id: EngineLoad}), stamped
        with Redis's clock; ids not in the pool are skipped. Returns how many were stored."""
        flat = engine.report_args(loads, validation.server_id)
        if not flat:
            return 0
        return int((yield Call(load("engine_report"), tuple(flat))))

    def retire(self) -> Op[int]:
        """End this holder's leases now and let it leave (a closed balancer can no longer keep
        them alive), RETIRE_CHUNK per call; a call that never comes back leaves the holder
        dead, its remaining leases to any reaper. Its releases' ids expire with their window
        even if no heartbeat ever timed their generation. Returns how many leases ended."""
        ended = 0
        while True:
            _, n, more = yield Call(load("retire"), (self.holder, RETIRE_CHUNK, RESEND_WINDOW_MS))
            ended += int(n)
            if not int(more):
                self.held.clear()
                self.latest.clear()
                self.earlier.clear()
                return ended

    def add_servers(
        self, servers: Mapping[str, Any], capacity: Mapping[str, int] | None = None
    ) -> Op[int]:
        """Register replicas; a replica's capacity comes from ``capacity`` or its metadata's
        ``"capacity"`` key (none: no limit, and a capacity declared before is lifted). A
        replica whose metadata has ``"dp_size"`` is registered as its ranks (redis_router.dp),
        and then the members an earlier registration of the same ids left (ranks beyond the
        new size, or the replica itself before it had ranks) are removed."""
        checked = validation.servers_mapping(servers)
        units, capacity, sizes = dp.expand(checked, capacity)
        caps = health.capacities(units, capacity)
        if not units:
            return 0
        args = [
            x
            for sid, value in units.items()
            for x in (sid, _meta_json(value), str(caps.get(sid, "")))
        ]
        added = yield Call(load("add_servers"), tuple(args))
        self.handles.update(units)
        pool = yield from self.counts()
        replaced = dp.stale(sizes, [s for s in checked if s not in sizes], pool)
        if replaced:
            yield Call(load("remove_servers"), tuple(replaced))
            for sid in replaced:
                self.handles.pop(sid, None)
        return int(added)

    def members(self, server_ids: Any) -> Op[list[str]]:
        """The pool members admin ids name: a data-parallel replica's id names its ranks."""
        ids = validation.server_ids(server_ids)
        if not ids or all(dp.replica_of(sid)[1] is not None for sid in ids):
            return ids
        return dp.members(ids, (yield from self.counts()))

    def remove_servers(self, server_ids: Any) -> Op[int]:
        ids = yield from self.members(server_ids)
        if not ids:
            return 0
        removed = yield Call(load("remove_servers"), tuple(ids))
        for sid in ids:
            self.handles.pop(sid, None)
        return int(removed)

    def set_draining(self, server_ids: Any, draining: bool) -> Op[int]:
        ids = yield from self.members(server_ids)
        if not ids:
            return 0
        return int((yield Call(load("drain" if draining else "undrain"), tuple(ids))))

    def reap(self) -> Op[int]:
        """Reclaim the leases of the holders already dead (not those on probation)."""
        return (yield from self.reap_all())[0]

    def reap_all(self, most: int | None = None, tool: bool = False) -> Op[tuple[int, float, float]]:
        """Reclaim the leases of dead holders, a chunk per call, up to ``most`` calls (None:
        until done). Returns (leases reclaimed, seconds until the probation after a gap in
        heartbeats ends while a holder unheard during it still has leases: 0.0 when none, and
        how often in seconds a caller waiting it out must call again: see probation_wait).
        ``tool``: the caller holds no leases (`redis-router reap`): the gap is judged by the
        lease ttls in use, not this core's, and the probation counts while any holder is
        unheard, with leases or not (so waiting it out declares every one of them dead)."""
        total, calls = 0, 0
        args = (REAP_CHUNK, RESEND_WINDOW_MS, "", "1") if tool else None
        while True:
            n, examined, limbo, listen = yield Call(
                load("reap"), args or (REAP_CHUNK, RESEND_WINDOW_MS, self.lease_ms)
            )
            total, calls = total + int(n), calls + 1
            if int(examined) < REAP_CHUNK or (most is not None and calls >= most):
                return total, int(limbo) / 1000, int(listen) / 1000

    def request_owner(self, request_id: str) -> Op[str | None]:
        """The replica serving ``request_id`` now (a live lease), or None: whom to send an
        abort. Its sticky entry is probed, not the leases scanned."""
        rid = validation.request_id(request_id)
        owner = yield Call(load("owner"), (rid, self.width_ms, self.span))
        return None if owner is None else _str(owner)

    def end_sessions(self, request_ids: list[str]) -> Op[int]:
        """Forget sessions that will not come back: their sticky entries, and their places in
        the replicas' pinned-session counts. Returns how many had a live entry."""
        rids = validation.request_ids(request_ids)
        if not rids:
            return 0
        n = yield Call(load("end_session"), (self.width_ms, self.sticky_ms, self.span, *rids))
        return int(n)

    def bump_weight_version(self, sticky: bool = False) -> Op[dict[str, int]]:
        """New weights make every replica's KV cache stale: drop every record of what the
        replicas hold (the prefix index, the policy's locality keys, with ``sticky`` the sticky
        sessions too) in one script, for every worker at once; leases and counts stay."""
        if not isinstance(sticky, bool):
            raise TypeError(f"sticky must be a bool, got {type(sticky).__name__}")
        version, deleted, forgotten = yield Call(
            load("bump"),
            (self.width_ms, self.span, "1" if sticky else "0", *self.policy.locality_keys),
        )
        return {
            "weight_version": int(version),
            "locality_keys_dropped": int(deleted),
            "sticky_entries_forgotten": int(forgotten),
        }

    def clear_sticky(self) -> Op[dict[str, Any]]:
        """Forget every sticky session. Returns verl's rebalance report: how many entries were
        forgotten and each replica's in-flight count."""
        n, loads = yield Call(load("clear_sticky"), (self.width_ms, self.span))
        return {
            "cleared_entries": int(n),
            "server_loads": {
                _str(loads[i]): int(float(loads[i + 1])) for i in range(0, len(loads), 2)
            },
        }

    def destroy(self) -> Op[int]:
        # Its leases go with the keys; the keeper's next heartbeat registers the holder anew,
        # which is no news after this process's own destroy. Marked before the call: the
        # keeper's heartbeat can find the keys gone before this call's reply is read.
        self.destroyed = True
        try:
            n = yield Call(load("destroy"), (self.width_ms, self.span))
        except GeneratorExit:  # the call failed (its driver closes the operation)
            self.destroyed = False
            raise
        self.handles.clear()
        self.held.clear()
        self.latest.clear()
        self.earlier.clear()
        return int(n)

    def inflight(self, server_id: Any) -> Op[int]:
        """In flight on one pool member, or on all the ranks of a data-parallel replica named
        by its id (0 when the id names nothing)."""
        sid = validation.server_id(server_id)
        got = yield from self.counts((sid,))
        if sid in got or dp.replica_of(sid)[1] is not None:
            return got.get(sid, 0)
        every = yield from self.counts()
        return sum(n for u, n in every.items() if dp.replica_of(u)[0] == sid)

    def counts(self, server_ids: tuple[str, ...] = ()) -> Op[dict[str, int]]:
        raw = yield Call(load("counts"), server_ids)
        return {_str(raw[i]): int(float(raw[i + 1])) for i in range(0, len(raw), 2)}

    def status(self) -> Op[dict[str, Any]]:
        found = json.loads((yield Call(load("status"), (self.width_ms, self.span))))
        now = int(found["now"])
        replicas: dict[str, dict[str, Any]] = {}
        for row in found["replicas"] or ():  # (an empty list is encoded as {})
            inflight, meta = int(row["inflight"]), row.get("metadata")
            replicas[row["id"]] = {
                "inflight": inflight,
                "draining": row["draining"],
                "live_leases": int(row["leases"]),
                "sticky_sessions": int(row["sticky"]),
                "acquires": int(row["acquires"]),
                "sticky_hits": int(row["sticky_hits"]),
                "reclaimed": int(row["reclaimed"]),
                "repins": int(row["repins"]),
                "metadata": validation.metadata(json.loads(meta) if meta is not None else None),
                **health.replica_status(row, now, inflight),
                **health.last_error(row, now),
            }
            report = engine.from_stored(row.get("engine", ""), now)
            if report is not None:
                replicas[row["id"]]["engine"] = report
        return {
            "name": self.name,
            "servers": {sid: r["inflight"] for sid, r in replicas.items()},
            "total_inflight": sum(r["inflight"] for r in replicas.values()),
            "active_servers": sum(not r["draining"] for r in replicas.values()),
            "draining_servers": sorted(sid for sid, r in replicas.items() if r["draining"]),
            "registered_handles": len(self.handles),
            "sticky_sessions": int(found["sessions"]),
            "full_determinism": self.full_determinism,
            "policy": {"name": self.policy.name, **self.policy.options()},
            "sticky_ttl": self.sticky_ttl,
            "lease_ttl": self.lease_ttl,
            "max_lease_age": self.max_lease_age,
            "affinity_margin": self.affinity_margin,
            "affinity_ratio": self.affinity_ratio,
            "group_cap": self.group_cap,
            "group_by": self.group_by,
            "spread_sessions": bool(self.spread),
            "engine_scoring": (
                dataclasses.asdict(self.engine_scoring) if self.engine_scoring else None
            ),
            "sticky_min_cached": float(self.min_cached) if self.min_cached else None,
            "holders": health.holders_status(found["holders"]),
            "ejection": health.ejection_status(
                self.eject_after,
                self.eject_for,
                self.eject_max,
                self.max_ejected,
                self.ejected_sticky,
            ),
            "ejected_servers": sorted(s for s, r in replicas.items() if r["ejected_until"]),
            "full_servers": sorted(s for s, r in replicas.items() if r["full"]),
            "waiting": health.waiting_status(found["waiting"]),
            "replicas": replicas,
            "dp_replicas": dp.grouped(replicas),
        }


def probation_wait(limbo: float, listen: float) -> float:
    """How long a caller waiting out a probation sleeps before calling again: never longer
    than the probation has left, nor than Redis may go unheard without it counting as a gap
    (which would extend the probation)."""
    return max(0.001, min(limbo + PROBATION_SLACK, listen or limbo))


# -- after a refused acquire: reclaim, wait for an ejection's end, wait in the queue ---------
# The decision is made once, here; each balancer drives it with its own I/O (a thread, or
# the event loop): a step is a script Call, or one of these.


class Attempt(NamedTuple):
    """Run the acquire (for ``ticket``: the waiting ticket it serves) and send back its grants;
    its NoCapacity (ReplicaEjected included) is thrown back in."""

    request_ids: list[str]
    tokens: list[str]
    fields: Sequence[Mapping[str, Any]] | None
    ticket: str | None = None
    exclude: tuple[str, ...] = ()  # server ids the request must not go to


class Pause(NamedTuple):
    """Sleep ``seconds``."""

    seconds: float


class Block(NamedTuple):
    """Wait at most ``timeout`` s for a push to ``key`` (BLPOP, bounded by health.BLOCK_MAX;
    a failure only ends the wait early)."""

    key: str
    timeout: float


Step = Call | Attempt | Pause | Block
# An operation that also sleeps and acquires: its driver throws back each step's error.
Admission = Generator[Step, Any, list[Grant]]


class Steps(Generic[S, T]):
    """An I/O-free operation's steps, for its driver: ``for step in steps``, then set
    ``reply`` (or ``error``, thrown back in) for each; ``result`` once done. Closes the
    operation on exit. :func:`run_steps` and :func:`run_steps_async` drive one this way
    (an Admission here; a transport's forwarding in redis_router.http.transport; a sharded
    pool's operations in redis_router.sharded_base)."""

    def __init__(self, op: Generator[S, Any, T]) -> None:
        self._op = op
        self.reply: Any = None
        self.error: BaseException | None = None
        self._result: tuple[T] | None = None

    def __iter__(self) -> Steps[S, T]:
        return self

    def __next__(self) -> S:
        reply, error, self.reply, self.error = self.reply, self.error, None, None
        try:
            return self._op.send(reply) if error is None else self._op.throw(error)
        except StopIteration as stop:
            self._result = (stop.value,)
            raise StopIteration from None

    @property
    def result(self) -> T:
        """What the operation returned (RuntimeError before it has)."""
        if self._result is None:
            raise RuntimeError("the operation has not returned yet")
        return self._result[0]

    def __enter__(self) -> Steps[S, T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self._op.close()


def run_steps(op: Generator[S, Any, T], step: Callable[[S], Any]) -> T:
    """Drive an I/O-free operation, blocking: each step's result is sent back in, its error
    thrown back in; the operation's result returned (the one loop of every blocking
    driver)."""
    with Steps(op) as steps:
        for s in steps:
            try:
                steps.reply = step(s)
            except BaseException as exc:
                steps.error = exc
        return steps.result


async def run_steps_async(op: Generator[S, Any, T], step: Callable[[S], Awaitable[Any]]) -> T:
    """:func:`run_steps`, each step awaited (the one loop of every asyncio driver)."""
    with Steps(op) as steps:
        for s in steps:
            try:
                steps.reply = await step(s)
            except BaseException as exc:
                steps.error = exc
        return steps.result


def admit(
    core: BalancerCore,
    refused: NoCapacity,
    request_ids: list[str],
    fields: Sequence[Mapping[str, Any]] | None,
    wait: float | None,
    started: float,
    tokens: list[str] | None = None,
    exclude: tuple[str, ...] = (),
) -> Admission:
    """What follows an acquire refused with ``refused`` (NoCapacity or ReplicaEjected), made
    at ``started`` (monotonic s), for the sync and asyncio balancers alike. A sticky session
    whose replica is ejected waits for its return; a full pool first has the places of dead
    processes reclaimed (once, whatever ``wait``: a dead holder's place is free), then waits
    in the queue for at most ``wait`` s (None: the balancer's ``wait_timeout``)."""
    budget = core.wait_timeout if wait is None else wait
    deadline = started + budget
    tokens = tokens or new_tokens(len(request_ids))
    reclaimed = False
    exc = refused
    while True:
        if isinstance(exc, ReplicaEjected):  # a sticky session waits for its replica's return
            left = deadline - time.monotonic()
            if left <= 0:
                raise exc
            yield Pause(min(left, exc.seconds_left + EJECTION_SLACK))
        else:
            first, reclaimed = not reclaimed, True
            if not (first and (yield from _reclaim_for_place(core))):
                if budget <= 0:
                    raise exc
                return (
                    yield from _wait_for_place(
                        core, request_ids, tokens, fields, budget, deadline, exclude
                    )
                )
        try:
            grants: list[Grant] = yield Attempt(request_ids, tokens, fields, None, exclude)
            return grants
        except NoCapacity as again:
            exc = again


def _reclaim_for_place(core: BalancerCore) -> Generator[Step, Any, bool]:
    """A refused acquire's first step: places held by dead processes are reclaimed now
    (bounded work), and after a pause of Redis the probation of the processes unheard
    during it is waited out (at most lease_ttl; calling meanwhile keeps Redis hearing this
    process), so a restarted worker is not refused because of the leases its dead
    predecessor left. True if any lease was reclaimed or a probation waited out (the acquire
    is worth retrying)."""
    reclaimed, limbo, listen = yield from core.reap_all(RECLAIM_CALLS)
    waited = limbo > 0  # another process (or its own keeper) may reap meanwhile
    until = time.monotonic() + core.lease_ttl
    while reclaimed == 0 and limbo > 0 and time.monotonic() < until:
        yield Pause(probation_wait(limbo, listen))
        reclaimed, limbo, listen = yield from core.reap_all(RECLAIM_CALLS)
    return reclaimed > 0 or waited


def _wait_for_place(
    core: BalancerCore,
    request_ids: list[str],
    tokens: list[str],
    fields: Sequence[Mapping[str, Any]] | None,
    budget: float,
    deadline: float,
    exclude: tuple[str, ...] = (),
) -> Admission:
    """Wait in the balancer's queue (FIFO across processes) until a replica takes the
    requests: woken by a script's push to this waiter's key. Left (its ticket removed)
    whatever ends the wait but a grant, a cancel included."""
    ticket = new_token()
    try:
        yield from core.enqueue(ticket, max(0.0, deadline - time.monotonic()) + WAIT_SLACK)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoCapacity(
                    f"balancer {core.name!r}: no replica could take the request within "
                    f"{budget:g}s (every eligible one full or ejected); add replicas or "
                    "wait longer"
                )
            yield Block(core.wake_key(ticket), left)
            try:
                grants: list[Grant] = yield Attempt(request_ids, tokens, fields, ticket, exclude)
                return grants
            except ReplicaEjected:
                raise  # its replica was ejected meanwhile: it leaves the queue
            except NoCapacity:
                continue
    except GeneratorExit:
        raise  # closed by its driver: nothing can be sent any more
    except BaseException:
        with contextlib.suppress(RedisUnavailable):  # else the ticket expires by itself
            yield from core.leave(ticket)
        raise
