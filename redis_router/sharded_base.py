"""A sharded pool's operations, without I/O, for both flavours: each public method is one
generator that yields steps (a directory call, a shard balancer's method, the Cluster's slot
ranges) and gets their results back; :class:`~redis_router.sharded.ShardedLoadBalancer` and
:class:`~redis_router.aio_sharded.AsyncShardedLoadBalancer` run them, blocking or awaiting,
and do nothing else (as the balancers run :mod:`redis_router.core`'s operations)."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, TypeVar

from redis import exceptions as rx

from . import dp, validation
from .core import Op, fields_per_request
from .errors import ConfigMismatch, NoServersAvailable, ReplicaEjected
from .shards import (
    Directory,
    Layout,
    Remembered,
    by_home,
    capacities,
    home_of,
    merged_bump,
    merged_status,
    more_names,
    no_shard,
    placement,
    pool_name,
    shard_count,
    shard_names,
    split_servers,
)

T = TypeVar("T")


class OnDirectory(NamedTuple):
    """Run a directory operation (its script calls) through the pool's directory balancer."""

    op: Op[Any]


class OnShard(NamedTuple):
    """Call a shard balancer's method; its result (awaited, where it is a coroutine) is sent
    back, its error thrown back in."""

    shard: int
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = {}


class Placing(NamedTuple):
    """Ask the directory for these keys' shards (:meth:`~redis_router.shards.Directory.place`,
    run by :meth:`ShardedBase._place`): one call, or, in the asyncio flavour, one call with
    the other tasks' placements of the same loop turn."""

    keys: list[str]
    avoid: tuple[int, ...]


class Primaries(NamedTuple):
    """The Cluster's primaries' slot ranges (:func:`~redis_router.shards.cluster_primaries`),
    [] when the client is not a Cluster's."""


ShardStep = OnDirectory | OnShard | Placing | Primaries
ShardedOp = Generator[ShardStep, Any, T]


class ShardedBase:
    """What both flavours of the sharded pool share: the arguments, what this process
    remembers (the layout, replicas' homes, sessions' shards), and every operation."""

    # The balancer class of this flavour: the directory's, and each shard's.
    _balancer: ClassVar[type]
    _k: int
    _shards: list[Any]  # the shards' balancers, in the layout's order
    _homes: dict[str, int]  # replica id -> home shard, as this process last read them
    url: str

    def __init__(
        self,
        servers: Mapping[str, Any] | None = None,
        *,
        shards: int | None = None,
        redis: Any = None,
        name: str = "default",
        router_kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """``shards``: how many (2-256; the first process fixes it; also read from
        ``router_kwargs``, as a YAML router config gives it; None joins an existing pool
        with the shards it has). ``name``: the pool's (its directory's keys; shard i is the
        balancer ``<name>/shard-<n>``). Every other option is the flavour's balancer's, given
        to each shard; ``servers`` are registered on their homes."""
        redis, router_kwargs = self._setup(shards, name, redis, router_kwargs)
        if router_kwargs:
            options["router_kwargs"] = router_kwargs
        # The directory's calls run through a balancer on the pool's own name: its keys are
        # the directory's, and it never acquires (so it never sends a heartbeat).
        self._dir = self._balancer(redis=redis, name=self.name, **options)
        self.url = self._dir.url
        # The shards share the directory's client: options that make a client are not theirs.
        self._options = {k: v for k, v in options.items() if k != "max_connections"}
        self._core = self._dir._core
        self._directory = Directory.of(self.name, self._core.sticky_ttl)
        self._sessions = Remembered(self._directory.fresh_for)
        self._homes = {}
        self._shards = []
        self._begin(dict(servers) if servers else {})

    def _begin(self, servers: dict[str, Any]) -> None:
        """Join the pool and register ``servers`` (now, or on the first call)."""
        raise NotImplementedError

    def _setup(
        self, shards: object, name: object, redis: Any, router_kwargs: Mapping[str, Any] | None
    ) -> tuple[Any, dict[str, Any]]:
        """Check the pool's own arguments, which a YAML router config gives in
        ``router_kwargs``; returns the Redis to use and ``router_kwargs`` without them."""
        rest = dict(router_kwargs or {})
        for arg, value, unset in (("shards", shards, None), ("name", name, "default")):
            if arg in rest and value != unset:
                raise TypeError(f"option {arg!r} given both as an argument and in router_kwargs")
        shards = rest.pop("shards", shards)
        self._k = 0 if shards is None else shard_count(shards)  # 0: join the pool as it is
        self.name = pool_name(rest.pop("name", name))
        if "redis" in rest:
            if redis is not None:
                raise TypeError("option 'redis' given both as an argument and in router_kwargs")
            redis = rest.pop("redis")
        return redis, rest

    def _shard(self, name: str) -> Any:
        """A balancer of this flavour for the shard ``name``, on the directory's client."""
        return self._balancer(redis=self._dir._client, name=name, **self._options)

    def _publish_from_now(self) -> None:
        """Start publishing the shards' totals (the first placement does)."""
        raise NotImplementedError

    @property
    def shard_names(self) -> list[str]:
        """The shards' balancer names, in order (empty before the layout is read)."""
        return [b.name for b in self._shards]

    @property
    def policy(self) -> Any:
        return self._core.policy

    def require_acquire_fields(self) -> list[str]:
        return list(self._core.acquire_fields)

    def require_release_fields(self) -> list[str]:
        return list(self._core.policy.release_fields)

    # -- the layout ------------------------------------------------------------------------

    def _join(self) -> ShardedOp[None]:
        """Read the layout, writing it first if the pool is new."""
        layout = yield OnDirectory(self._directory.layout())
        if not layout.names:
            if not self._k:
                raise ConfigMismatch(
                    f"no sharded pool named {self.name!r} at {self.url}: the first process "
                    "creates it with shards=K (2-256)"
                )
            names = shard_names(self.name, self._k, (yield Primaries()))
            try:
                layout = yield OnDirectory(self._directory.layout("create", names))
            except rx.ResponseError as exc:
                raise self._directory.refused(exc) from None
        self._extend(layout)

    def _extend(self, layout: Layout) -> None:
        """Make balancers for the layout's shards this process lacks (all, at first; the new
        ones after the pool grew), and take its replicas' homes. A pool grown past the count
        this process asked for is joined as it is; a smaller one must be grown first."""
        if len(layout.names) < self._k:
            raise ConfigMismatch(
                f"sharded pool {self.name!r} has {len(layout.names)} shards, this process "
                f"asked for {self._k}: grow it first (grow({self._k}), docs/sharding.md)"
            )
        for name in layout.names[len(self._shards) :]:
            self._shards.append(self._shard(name))
        self._k = len(self._shards)
        self._homes = dict(layout.homes)

    def _refresh(self) -> ShardedOp[None]:
        """Read the layout again: replicas added by other processes, shards added by grow()."""
        self._extend((yield OnDirectory(self._directory.layout())))

    def _grow(self, shards: object) -> ShardedOp[list[str]]:
        k = shard_count(shards)
        yield from self._refresh()
        if k < self._k:
            raise ValueError(f"shards: a pool only grows; it has {self._k}, got {k}")
        if k > self._k:
            names = more_names(self.name, self.shard_names, k, (yield Primaries()))
            try:
                self._extend((yield OnDirectory(self._directory.layout("grow", names))))
            except rx.ResponseError as exc:
                raise self._directory.refused(exc) from None
        return self.shard_names

    # -- routing ---------------------------------------------------------------------------

    def _check(
        self,
        request_id: str,
        fields: Mapping[str, Any],
        exclude: object = None,
        token: str | None = None,
    ) -> None:
        """Check an acquire's arguments before the directory is written to."""
        validation.request_id(request_id)
        if token is not None:
            validation.token(token)
        self._core.check_acquire(fields, exclude)

    def _key(self, request_id: str, fields: Mapping[str, Any]) -> str:
        """What places a request: its GRPO group (all samples on one shard), else its id."""
        return self._core.group_of(request_id, fields) or request_id

    def _shard_of(self, keys: list[str], avoid: tuple[int, ...] = ()) -> ShardedOp[list[int]]:
        """Each key's shard: remembered, else the directory's (one call for all the keys)."""
        known = [self._remembered(k, avoid) for k in keys]
        missing = list(dict.fromkeys(k for k, s in zip(keys, known, strict=True) if s is None))
        placed: dict[str, int] = {}
        if missing:
            got = yield Placing(missing, avoid)
            if max(got) >= len(self._shards):  # the pool grew since this process looked
                yield from self._refresh()
            for key, shard in zip(missing, got, strict=True):
                if shard < 0:
                    raise no_shard(self.name)
                self._sessions.put(key, shard)
                placed[key] = shard
        self._publish_from_now()
        return [placed[k] if s is None else s for k, s in zip(keys, known, strict=True)]

    def _place(self, keys: list[str], avoid: tuple[int, ...] = ()) -> Op[list[int]]:
        """The directory's placement of ``keys``, its ties broken by the pool's rng (seeded
        where the options give one)."""
        return self._directory.place(keys, avoid, self._core._getrandbits(30))

    def _remembered(self, key: str, avoid: tuple[int, ...]) -> int | None:
        shard = self._sessions.get(key)
        return None if shard is None or shard in avoid else shard

    def _routed(
        self, method: str, request_id: str, fields: Mapping[str, Any], **kw: Any
    ) -> ShardedOp[Any]:
        """``method`` (an acquire) on the request's shard. A session its shard cannot take
        (every replica there draining, full or excluded) is placed on another, each shard
        once; only the first waits (``wait``), the others answer at once."""
        self._check(request_id, fields, kw.get("exclude"), kw.get("token"))
        key = self._key(request_id, fields)
        avoid: tuple[int, ...] = ()
        while True:
            shard = (yield from self._shard_of([key], avoid))[0]
            wait = self._wait_on(avoid, kw["wait"])
            try:
                got = yield OnShard(shard, method, (request_id,), {**kw, "wait": wait, **fields})
                return self._granted(shard, got)
            except NoServersAvailable as refused:
                avoid = self._elsewhere(avoid, shard, refused)

    @staticmethod
    def _wait_on(avoid: tuple[int, ...], wait: float | None) -> float | None:
        """How long a session may wait on the shard tried now: only the first shard waits;
        after a refusal the others answer at once."""
        return wait if not avoid else 0.0

    def _lease_kw(
        self, avoid: tuple[int, ...], renew_every: float | None, wait: float | None, exclude: Any
    ) -> dict[str, Any]:
        """A shard lease's options, with its wait as _wait_on gives it."""
        return {"renew_every": renew_every, "wait": self._wait_on(avoid, wait), "exclude": exclude}

    def _elsewhere(
        self, avoid: tuple[int, ...], shard: int, refused: NoServersAvailable
    ) -> tuple[int, ...]:
        """After ``shard`` refused a session: the shards to avoid when it is placed again.
        Raises ``refused`` when every shard has refused, or when its replica is ejected (the
        session is kept on its replica: it does not move)."""
        if isinstance(refused, ReplicaEjected):
            raise refused
        avoid = (*avoid, shard)
        if len(avoid) >= self._k:
            raise refused
        return avoid

    def _acquire_many(
        self, request_ids: list[str], wait: float | None, fields: Mapping[str, Any]
    ) -> ShardedOp[list[tuple[str, Any]]]:
        """One directory call for the batch's new sessions, then one call per shard it
        touches; if a shard refuses its part, the parts granted are released and the error
        raised: the batch is granted whole or not at all."""
        rids = validation.request_ids(request_ids)
        self._core.check_acquire(fields)
        per = fields_per_request(len(rids), fields) or [{}] * len(rids)
        shards = yield from self._shard_of(
            [self._key(r, f) for r, f in zip(rids, per, strict=True)]
        )
        by_shard: dict[int, list[int]] = {}
        for i, shard in enumerate(shards):
            by_shard.setdefault(shard, []).append(i)
        out: list[Any] = [None] * len(rids)
        granted: list[tuple[int, str, str]] = []
        try:
            for shard, idx in by_shard.items():
                part = {f: [per[i][f] for i in idx] for f in fields}
                got = yield OnShard(
                    shard, "acquire_many", ([rids[i] for i in idx],), {"wait": wait, **part}
                )
                for i, grant in zip(idx, got, strict=True):
                    out[i] = self._granted(shard, grant)
                    granted.append((shard, grant[0], rids[i]))
        except GeneratorExit:
            raise
        except BaseException:
            for shard, sid, rid in granted:  # not waited for: ends with the shard's releases
                yield OnShard(shard, "release_server", (sid, rid))
            raise
        return out

    def _granted(self, shard: int, grant: Any) -> Any:
        """Note the home of the replica a grant names (a lease, or (id, handle)): another
        process may have added it since this one read the homes."""
        sid = grant[0] if isinstance(grant, tuple) else grant.server_id
        self._homes[sid] = shard
        return grant

    # -- replicas --------------------------------------------------------------------------

    def _home(self, server_id: str) -> int:
        """The replica's home shard as this process knows it (:func:`~.shards.home_of`)."""
        return home_of(self._homes, validation.server_id(server_id))

    def _knows(self, server_id: str) -> bool:
        """Whether this process knows the replica's home (a data-parallel rank's is its
        replica's)."""
        return server_id in self._homes or dp.replica_of(server_id)[0] in self._homes

    def _homes_of(self, server_ids: Sequence[str]) -> ShardedOp[dict[int, list[str]]]:
        """``server_ids`` by home shard; an id this process has not seen reads the layout."""
        ids = validation.server_ids(server_ids)
        if not all(self._knows(s) for s in ids):
            yield from self._refresh()
        return by_home(self._homes, ids)

    def _release_home(self, server_id: str) -> ShardedOp[int]:
        """The shard a release by replica goes to: the replica's home, read from the layout
        when this process has not seen it (as for every other call naming a replica)."""
        return next(iter((yield from self._homes_of([server_id]))))

    def _add(
        self, servers: Mapping[str, Any], capacity: Mapping[str, int] | None
    ) -> ShardedOp[int]:
        caps = capacities(servers, capacity)  # checked before anything is sent
        homes = yield OnDirectory(self._directory.assign(caps))
        self._homes.update(homes)
        added = 0
        for shard, (part, caps_of) in split_servers(servers, capacity, homes).items():
            added += yield OnShard(shard, "add_servers", (part,), {"capacity": caps_of})
        return added

    def _remove(self, server_ids: list[str]) -> ShardedOp[int]:
        """Take replicas out of their shards, then out of the directory."""
        removed = yield from self._per_home("remove_servers", server_ids)
        ids = validation.server_ids(server_ids)
        yield OnDirectory(self._directory.unassign([s for s in ids if s in self._homes]))
        return removed

    def _per_home(self, method: str, server_ids: Sequence[str]) -> ShardedOp[int]:
        """``method(ids)`` on each home shard of ``server_ids``; the results summed."""
        n = 0
        for shard, ids in (yield from self._homes_of(server_ids)).items():
            n += yield OnShard(shard, method, (ids,))
        return n

    def _inflight(self, server_id: str) -> ShardedOp[int]:
        shard = next(iter((yield from self._homes_of([server_id]))))
        return (yield OnShard(shard, "get_inflight_count", (server_id,)))  # type: ignore[no-any-return]

    def _report(self, loads: Mapping[str, Any]) -> ShardedOp[int]:
        n = 0
        for shard, ids in (yield from self._homes_of(list(loads))).items():
            n += yield OnShard(shard, "report_engine_load", ({sid: loads[sid] for sid in ids},))
        return n

    # -- every shard -----------------------------------------------------------------------

    def _each(self, method: str, *args: Any, **kwargs: Any) -> ShardedOp[list[Any]]:
        """``method`` on every shard, in order."""
        out = []
        for shard in range(len(self._shards)):
            out.append((yield OnShard(shard, method, args, kwargs)))
        return out

    def _all_servers(self) -> ShardedOp[list[str]]:
        return sorted(sid for got in (yield from self._each("get_all_servers")) for sid in got)

    def _total(self) -> ShardedOp[int]:
        return sum((yield from self._each("get_total_inflight")))

    def _status(self) -> ShardedOp[dict[str, Any]]:
        """The pool as one (replicas, totals), each shard's own under ``shards``, the
        directory's per-shard view under ``placement``."""
        found = yield from self._each("get_status")
        stats = yield OnDirectory(self._directory.stats())
        return merged_status(self.name, found, placement(self._shards, stats))

    def _owner(self, request_id: str) -> ShardedOp[str | None]:
        """The session's shard (as this process knows it) first, then the others."""
        known = self._sessions.get(request_id)
        order = list(range(len(self._shards)))
        if known is not None:
            order = [known, *(s for s in order if s != known)]
        for shard in order:
            owner = yield OnShard(shard, "request_owner", (request_id,))
            if owner is not None:
                return str(owner)
        return None

    def _sum_each(self, method: str, *args: Any, **kwargs: Any) -> ShardedOp[int]:
        return sum((yield from self._each(method, *args, **kwargs)))

    def _bump(self, sticky: bool) -> ShardedOp[dict[str, int]]:
        return merged_bump((yield from self._each("bump_weight_version", sticky=sticky)))

    def _clear(self) -> ShardedOp[dict[str, Any]]:
        results = yield from self._each("clear_sticky_cache")
        loads: dict[str, int] = {}
        for r in results:
            loads.update(r["server_loads"])
        return {
            "cleared_entries": sum(r["cleared_entries"] for r in results),
            "server_loads": loads,
        }

    def _destroy(self, directory: Op[int]) -> ShardedOp[int]:
        """Every shard's keys, then the directory's (``directory``: its balancer's destroy)."""
        n = yield from self._sum_each("destroy")
        n += int((yield OnDirectory(directory)))
        self._sessions.clear()
        self._homes = {}
        return n

    def _publish(self) -> ShardedOp[None]:
        """One period's publishing: claim the shards due, read and publish their totals."""
        due = yield OnDirectory(self._directory.totals({}))
        if not due:
            return
        if max(due) >= len(self._shards):
            yield from self._refresh()
        totals = {}
        for shard in due:
            totals[shard] = yield OnShard(shard, "get_total_inflight")
        yield OnDirectory(self._directory.totals(totals))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, shards={self._k}, redis={self.url!r})"
