"""The synchronous sharded pool: :class:`ShardedLoadBalancer`, K balancers as one. It runs
:mod:`redis_router.sharded_base`'s operations, blocking."""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from redis import exceptions as rx

from . import keeper, validation
from .balancer import Lease, RedisLoadBalancer
from .core import run_steps
from .errors import NoServersAvailable
from .outbox import Released
from .sharded_base import OnDirectory, OnShard, Placing, ShardedBase, ShardedOp, ShardStep, T
from .shards import PUBLISH_EVERY, cluster_primaries, on_cluster


class ShardedLoadBalancer(ShardedBase):
    """One pool of replicas over ``shards`` balancers, so over as many Redis Cluster slots
    (spread over the primaries): a pool past one Redis core. Every process that constructs
    it with the same Redis and ``name`` shares it.

    A replica is registered on one shard (its home: the emptiest by count, then capacity);
    each shard routes exactly inside itself (least loaded, sticky sessions, leases,
    liveness, capacity, ejection) with the options given here. A new session (or GRPO group)
    is placed on a shard by the pool's directory, which records where it went so the
    session's later turns find it from any process. The methods are
    :class:`~redis_router.RedisLoadBalancer`'s, for the pool as one. See docs/sharding.md.
    """

    _balancer = RedisLoadBalancer
    _shards: list[RedisLoadBalancer]
    _dir: RedisLoadBalancer

    def _begin(self, servers: dict[str, Any]) -> None:
        self._publisher: keeper.ThreadKeeper | None = None
        self._drive(self._join())
        if servers:
            self.add_servers(servers)

    # -- driving the operations ------------------------------------------------------------

    def _drive(self, op: ShardedOp[T]) -> T:
        return run_steps(op, self._step)

    def _step(self, step: ShardStep) -> Any:
        if isinstance(step, OnShard):
            return getattr(self._shards[step.shard], step.method)(*step.args, **step.kwargs)
        if isinstance(step, OnDirectory):
            return self._dir._run(step.op)
        if isinstance(step, Placing):
            return self._dir._run(self._place(step.keys, step.avoid))
        client = self._dir._client
        if on_cluster(client):
            return cluster_primaries(client.cluster_slots())
        return []

    def _publish_from_now(self) -> None:
        if self._publisher is None:
            ref = weakref.ref(self)
            self._publisher = keeper.ThreadKeeper(lambda: _publish(ref), PUBLISH_EVERY)

    def grow(self, shards: int) -> list[str]:
        """Grow the pool to ``shards`` shards, for every process (docs/sharding.md): the new
        shards start empty; replicas added from now on fill them first (homes go to the
        emptiest shard), and new sessions go to them as soon as they have replicas. Sessions
        already placed keep their shard. Returns the shards' names."""
        return self._drive(self._grow(shards))

    # -- routing ---------------------------------------------------------------------------

    def acquire_server(
        self,
        request_id: str,
        *,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> tuple[str, Any]:
        """As :meth:`RedisLoadBalancer.acquire_server`, on the session's shard (a new
        session its shard cannot take goes to another)."""
        op = self._routed("acquire_server", request_id, fields, wait=wait, exclude=exclude)
        return self._drive(op)  # type: ignore[no-any-return]

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
        op = self._routed("acquire", request_id, fields, token=token, wait=wait, exclude=exclude)
        return self._drive(op)  # type: ignore[no-any-return]

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
        """As :meth:`RedisLoadBalancer.lease`; a session its shard cannot take is placed on
        another, as by :meth:`acquire`."""
        self._check(request_id, fields, exclude)
        key = self._key(request_id, fields)
        avoid: tuple[int, ...] = ()
        with ExitStack() as stack:
            while True:
                index = self._drive(self._shard_of([key], avoid))[0]
                kw = self._lease_kw(avoid, renew_every, wait, exclude)
                try:
                    held = stack.enter_context(
                        self._shards[index].lease(request_id, **kw, **fields)
                    )
                    break
                except NoServersAvailable as refused:
                    avoid = self._elsewhere(avoid, index, refused)
            yield self._granted(index, held)

    def acquire_many(
        self, request_ids: list[str], *, wait: float | None = None, **fields: Any
    ) -> list[tuple[str, Any]]:
        """As :meth:`RedisLoadBalancer.acquire_many`: one directory call for the batch's new
        sessions, then one call per shard it touches. If a shard refuses its part, the parts
        already granted are released and the error raised: the batch is granted whole or
        not at all."""
        return self._drive(self._acquire_many(request_ids, wait, fields))

    def release_server(
        self,
        server_id: str,
        request_id: str | None = None,
        *,
        failed: bool = False,
        **fields: Any,
    ) -> Released[bool]:
        """As :meth:`RedisLoadBalancer.release_server`, on the replica's shard."""
        sid, rid, bad = validation.release(server_id, request_id, failed)
        b = self._shards[self._drive(self._release_home(sid))]
        return b.release_server(sid, rid, failed=bad, **fields)

    # -- the pool --------------------------------------------------------------------------

    def add_servers(
        self, servers: Mapping[str, Any], *, capacity: Mapping[str, int] | None = None
    ) -> int:
        """Register replicas, each on its home shard (a new one: the emptiest by count,
        then capacity). Returns how many are new."""
        return self._drive(self._add(servers, capacity))

    def remove_servers(self, server_ids: list[str]) -> int:
        """Take replicas out of their shards, then out of the directory."""
        return self._drive(self._remove(server_ids))

    def drain_servers(self, server_ids: list[str]) -> int:
        return self._drive(self._per_home("drain_servers", server_ids))

    def undrain_servers(self, server_ids: list[str]) -> int:
        return self._drive(self._per_home("undrain_servers", server_ids))

    def get_all_servers(self) -> list[str]:
        return self._drive(self._all_servers())

    def get_inflight_count(self, server_id: str) -> int:
        return self._drive(self._inflight(server_id))

    def get_total_inflight(self) -> int:
        return self._drive(self._total())

    def report_engine_load(self, loads: Mapping[str, Any]) -> int:
        return self._drive(self._report(loads))

    def get_status(self) -> dict[str, Any]:
        """The pool as one (replicas, totals) with each shard's own under ``shards`` and the
        directory's per-shard view under ``placement``."""
        return self._drive(self._status())

    def request_owner(self, request_id: str) -> str | None:
        return self._drive(self._owner(request_id))

    def end_session(self, *request_ids: str) -> int:
        return self._drive(self._sum_each("end_session", *request_ids))

    def bump_weight_version(self, *, sticky: bool = False) -> dict[str, int]:
        return self._drive(self._bump(sticky))

    def clear_sticky_cache(self) -> dict[str, Any]:
        return self._drive(self._clear())

    def reap(self) -> int:
        return self._drive(self._sum_each("reap"))

    def destroy(self) -> int:
        """Delete every key of the pool: each shard's, then the directory's. Publishing stops
        first, as a period run after the delete would write the shards' totals again (the
        next placement starts it again)."""
        self._stop_publishing()
        return self._drive(self._destroy(self._dir._core.destroy()))

    # -- lifetime --------------------------------------------------------------------------

    def _stop_publishing(self) -> None:
        stopping, self._publisher = self._publisher, None
        if stopping is not None:
            stopping.stop()

    def close(self) -> None:
        """Close every shard (their leases end) and the directory's connection."""
        self._stop_publishing()
        for b in self._shards:
            b.close()
        self._dir.close()

    def __enter__(self) -> ShardedLoadBalancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _publish(ref: weakref.ReferenceType[ShardedLoadBalancer]) -> bool:
    """The publisher thread's period (False once the pool is gone)."""
    pool = ref()
    if pool is None or pool._dir._core.closed:
        return False
    try:
        pool._drive(pool._publish())
    except (rx.RedisError, NoServersAvailable, ConnectionError) as exc:
        keeper.log.debug("sharded pool %r: publishing totals failed: %s", pool.name, exc)
    return True
