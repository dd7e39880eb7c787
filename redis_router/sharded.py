"""The synchronous sharded pool: :class:`ShardedLoadBalancer`, K balancers as one."""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from redis import exceptions as rx

from . import keeper, validation
from .balancer import Lease, RedisLoadBalancer
from .core import Op, T
from .errors import NoServersAvailable, ReplicaEjected
from .outbox import Released
from .shards import (
    PUBLISH_EVERY,
    Layout,
    ShardedBase,
    cluster_primaries,
    more_names,
    shard_count,
)


class ShardedLoadBalancer(ShardedBase):
    """One pool of replicas over ``shards`` balancers, so over as many Redis Cluster slots
    (spread over the primaries): a pool past one Redis core. Every process that constructs
    it with the same Redis, ``name`` and ``shards`` shares it.

    A replica is registered on one shard (its home: the emptiest by count, then capacity);
    each shard routes exactly inside itself (least loaded, sticky sessions, leases,
    liveness, capacity, ejection) with the options given here. A new session (or GRPO group)
    is placed on a shard by the pool's directory, which records where it went so the
    session's later turns find it from any process. The methods are
    :class:`~redis_router.RedisLoadBalancer`'s, for the pool as one. See docs/sharding.md.
    """

    _shards: list[RedisLoadBalancer]

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
        ``router_kwargs``, as a YAML router config gives it). ``name``: the pool's (its
        directory's keys; shard i is the balancer ``<name>/shard-<n>``). Every other option
        is :class:`~redis_router.RedisLoadBalancer`'s, given to each shard."""
        redis, router_kwargs = self._setup(shards, name, redis, router_kwargs)
        if router_kwargs:
            options["router_kwargs"] = router_kwargs
        # The directory's calls run through a balancer on the pool's own name: its keys are
        # the directory's, and it never acquires (so it never sends a heartbeat).
        self._dir = RedisLoadBalancer(redis=redis, name=self.name, **options)
        self.url = self._dir.url
        self._attach(self._dir._core)
        self._options = {k: v for k, v in options.items() if k not in self._dir._client_options}
        self._shards = []
        self._extend(self._layout())
        self._publisher: keeper.ThreadKeeper | None = None
        if servers:
            self.add_servers(servers)

    def _layout(self) -> Layout:
        layout = self._run(self._directory.layout())
        if not layout.names:
            names = self._named(self._primaries())
            try:
                layout = self._run(self._directory.layout("create", names))
            except rx.ResponseError as exc:
                raise self._directory.refused(exc) from None
        return self._joined(layout)

    def _primaries(self) -> list[list[tuple[int, int]]]:
        client = self._dir._client
        return cluster_primaries(client.cluster_slots()) if _is_cluster(client) else []

    def _extend(self, layout: Layout) -> None:
        """Make balancers for the layout's shards this process lacks (all, at first; the new
        ones after the pool grew), and take its replicas' homes."""
        for n in layout.names[len(self._shards) :]:
            self._shards.append(RedisLoadBalancer(redis=self._dir._client, name=n, **self._options))
        self._k = len(self._shards)
        self._homes = dict(layout.homes)

    def _refresh(self) -> None:
        """Read the layout again: replicas added by other processes, shards added by grow()."""
        self._extend(self._joined(self._run(self._directory.layout())))

    def grow(self, shards: int) -> list[str]:
        """Grow the pool to ``shards`` shards, for every process (docs/sharding.md): the new
        shards start empty; replicas added from now on fill them first (homes go to the
        emptiest shard), and new sessions go to them as soon as they have replicas. Sessions
        already placed keep their shard. Returns the shards' names."""
        k = shard_count(shards)
        self._refresh()
        if k < self._k:
            raise ValueError(f"shards: a pool only grows; it has {self._k}, got {k}")
        if k > self._k:
            names = more_names(self.name, self.shard_names, k, self._primaries())
            try:
                self._extend(self._run(self._directory.layout("grow", names)))
            except rx.ResponseError as exc:
                raise self._directory.refused(exc) from None
        return self.shard_names

    def _run(self, op: Op[T]) -> T:
        return self._dir._run(op)

    # -- routing ---------------------------------------------------------------------------

    def _shard_of(self, keys: list[str], avoid: tuple[int, ...] = ()) -> list[int]:
        missing = self._unplaced(keys, avoid)
        if missing:
            placed = self._run(self._directory.place(missing, avoid))
            if max(placed) >= len(self._shards):  # the pool grew since this process looked
                self._refresh()
            self._remember(missing, placed)
        self._publish_from_now()
        return self._placed(keys)

    def _routed(
        self, request_id: str, fields: Mapping[str, Any], wait: float | None, call: Any
    ) -> Any:
        """Run ``call(shard, wait)`` on the request's shard. A session its shard cannot take
        (every replica there draining, full or excluded) is placed on another, each shard
        once; only the first waits (``wait``), the others answer at once."""
        key = self._key(request_id, fields)
        avoid: tuple[int, ...] = ()
        while True:
            shard = self._shard_of([key], avoid)[0]
            try:
                return self._granted(shard, call(self._shards[shard], wait if not avoid else 0.0))
            except ReplicaEjected:  # the session is kept on its replica: it does not move
                raise
            except NoServersAvailable:
                avoid = (*avoid, shard)
                if len(avoid) >= self._k:
                    raise

    def acquire_server(
        self,
        request_id: str,
        *,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> tuple[str, Any]:
        """As :meth:`RedisLoadBalancer.acquire_server`, on the session's shard."""
        self._check(request_id, fields, exclude)
        return self._routed(  # type: ignore[no-any-return]
            request_id,
            fields,
            wait,
            lambda b, w: b.acquire_server(request_id, wait=w, exclude=exclude, **fields),
        )

    def acquire(
        self,
        request_id: str,
        *,
        token: str | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> Lease:
        """As :meth:`RedisLoadBalancer.acquire`; the lease ends on its shard."""
        self._check(request_id, fields, exclude, token)
        return self._routed(  # type: ignore[no-any-return]
            request_id,
            fields,
            wait,
            lambda b, w: b.acquire(request_id, token=token, wait=w, exclude=exclude, **fields),
        )

    @contextmanager
    def lease(
        self,
        request_id: str,
        *,
        renew_every: float | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> Iterator[Lease]:
        """As :meth:`RedisLoadBalancer.lease`."""
        self._check(request_id, fields, exclude)
        key = self._key(request_id, fields)
        shard = self._shards[self._shard_of([key])[0]]
        with shard.lease(
            request_id, renew_every=renew_every, wait=wait, exclude=exclude, **fields
        ) as held:
            yield held

    def acquire_many(
        self, request_ids: list[str], *, wait: float | None = None, **fields: Any
    ) -> list[tuple[str, Any]]:
        """As :meth:`RedisLoadBalancer.acquire_many`: one directory call for the batch's new
        sessions, then one call per shard it touches. If a shard refuses its part, the parts
        already granted are released and the error raised: the batch is granted whole or
        not at all."""
        rids, per = self._check_many(request_ids, fields)
        shards = self._shard_of([self._key(r, f) for r, f in zip(rids, per, strict=True)])
        out: list[tuple[str, Any] | None] = [None] * len(rids)
        granted: list[tuple[RedisLoadBalancer, str, str]] = []
        try:
            for shard, idx in self._by_shard(shards).items():
                b = self._shards[shard]
                part = [rids[i] for i in idx]
                got = b.acquire_many(part, wait=wait, **self._fields_of(per, idx, fields))
                for i, grant in zip(idx, got, strict=True):
                    out[i] = self._granted(shard, grant)
                    granted.append((b, grant[0], rids[i]))
        except BaseException:
            for b, sid, rid in granted:
                b.release_server(sid, rid)
            raise
        return [g for g in out if g is not None]

    def release_server(
        self,
        server_id: str,
        request_id: str | None = None,
        *,
        failed: bool = False,
        **fields: Any,
    ) -> Released[bool]:
        """As :meth:`RedisLoadBalancer.release_server`, on the replica's shard."""
        b = self._shards[next(iter(self._homes_of([server_id])))]
        return b.release_server(server_id, request_id, failed=failed, **fields)

    # -- the pool --------------------------------------------------------------------------

    def add_servers(
        self, servers: Mapping[str, Any], *, capacity: Mapping[str, int] | None = None
    ) -> int:
        """Register replicas, each on its home shard (a new one: the emptiest by count,
        then capacity). Returns how many are new."""
        caps = self._capacities(servers, capacity)
        homes = self._run(self._directory.assign(caps))
        self._homes.update(homes)
        added = 0
        for shard, part in self._split_servers(servers, capacity, homes).items():
            added += self._shards[shard].add_servers(part[0], capacity=part[1])
        return added

    def remove_servers(self, server_ids: list[str]) -> int:
        """Take replicas out of their shards, then out of the directory."""
        removed = sum(
            self._shards[s].remove_servers(ids) for s, ids in self._homes_of(server_ids).items()
        )
        self._run(self._directory.unassign(self._whole(server_ids)))
        return removed

    def drain_servers(self, server_ids: list[str]) -> int:
        """As :meth:`RedisLoadBalancer.drain_servers`."""
        return sum(
            self._shards[s].drain_servers(ids) for s, ids in self._homes_of(server_ids).items()
        )

    def undrain_servers(self, server_ids: list[str]) -> int:
        return sum(
            self._shards[s].undrain_servers(ids) for s, ids in self._homes_of(server_ids).items()
        )

    def get_all_servers(self) -> list[str]:
        return sorted(sid for b in self._shards for sid in b.get_all_servers())

    def get_inflight_count(self, server_id: str) -> int:
        return self._shards[next(iter(self._homes_of([server_id])))].get_inflight_count(server_id)

    def get_total_inflight(self) -> int:
        return sum(b.get_total_inflight() for b in self._shards)

    def report_engine_load(self, loads: Mapping[str, Any]) -> int:
        return sum(
            self._shards[s].report_engine_load({sid: loads[sid] for sid in ids})
            for s, ids in self._homes_of(list(loads)).items()
        )

    def get_status(self) -> dict[str, Any]:
        """The pool as one (replicas, totals) with each shard's own under ``shards`` and the
        directory's per-shard view under ``placement``."""
        found = [b.get_status() for b in self._shards]
        return self._status(found, self._run(self._directory.stats()))

    def request_owner(self, request_id: str) -> str | None:
        b: RedisLoadBalancer
        for b in self._in_turn(request_id):
            owner = b.request_owner(request_id)
            if owner is not None:
                return owner
        return None

    def end_session(self, *request_ids: str) -> int:
        return sum(b.end_session(*request_ids) for b in self._shards)

    def bump_weight_version(self, *, sticky: bool = False) -> dict[str, int]:
        return self._bumped([b.bump_weight_version(sticky=sticky) for b in self._shards])

    def clear_sticky_cache(self) -> dict[str, Any]:
        return self._cleared([b.clear_sticky_cache() for b in self._shards])

    def reap(self) -> int:
        return sum(b.reap() for b in self._shards)

    def destroy(self) -> int:
        """Delete every key of the pool: each shard's, then the directory's."""
        n = sum(b.destroy() for b in self._shards) + self._dir.destroy()
        self._forget_all()
        return n

    # -- the directory's totals ------------------------------------------------------------

    def _publish_from_now(self) -> None:
        if self._publisher is None:
            ref = weakref.ref(self)
            self._publisher = keeper.ThreadKeeper(lambda: _publish(ref), PUBLISH_EVERY)

    def _homes_of(self, server_ids: list[str]) -> dict[int, list[str]]:
        """``server_ids`` by home shard; an id this process has not seen reads the homes."""
        if any(not self._known(s) for s in validation.server_ids(server_ids)):
            self._refresh()
        return self._by_home(server_ids)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Close every shard (their leases end) and the directory's connection."""
        stopping, self._publisher = self._publisher, None
        if stopping is not None:
            stopping.stop()
        for b in self._shards:
            b.close()
        self._dir.close()

    def __enter__(self) -> ShardedLoadBalancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _publish(ref: weakref.ReferenceType[ShardedLoadBalancer]) -> bool:
    """One period's publishing: claim the shards due, read and publish their totals."""
    pool = ref()
    if pool is None or pool._dir._core.closed:
        return False
    try:
        due = pool._run(pool._directory.totals({}))
        if due:
            if max(due) >= len(pool._shards):
                pool._refresh()
            totals = {s: pool._shards[s].get_total_inflight() for s in due}
            pool._run(pool._directory.totals(totals))
    except (rx.RedisError, NoServersAvailable, ConnectionError) as exc:
        keeper.log.debug("sharded pool %r: publishing totals failed: %s", pool.name, exc)
    return True


def _is_cluster(client: Any) -> bool:
    return hasattr(client, "cluster_slots") and hasattr(client, "nodes_manager")
