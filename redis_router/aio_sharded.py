"""The asyncio sharded pool: :class:`AsyncShardedLoadBalancer`, K asyncio balancers as one.
It runs :mod:`redis_router.sharded_base`'s operations, awaiting."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import weakref
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any

from redis import exceptions as rx

from . import keeper, validation
from .aio import KEEPER_STOP_TIMEOUT, AsyncLease, AsyncRedisLoadBalancer, AsyncReleased
from .coalesce import Coalescer
from .core import run_steps_async
from .errors import NoServersAvailable
from .sharded_base import OnDirectory, OnShard, Placing, ShardedBase, ShardedOp, ShardStep, T
from .shards import PUBLISH_EVERY, capacities, cluster_primaries, on_cluster


class AsyncShardedLoadBalancer(ShardedBase):
    """The asyncio form of :class:`~redis_router.sharded.ShardedLoadBalancer` (same
    arguments, methods are coroutines). The layout is read (or written) by the first call,
    which makes the shards' balancers."""

    _balancer = AsyncRedisLoadBalancer
    _shards: list[AsyncRedisLoadBalancer]
    _dir: AsyncRedisLoadBalancer

    def _begin(self, servers: dict[str, Any]) -> None:
        self._initial = servers
        capacities(self._initial, None)  # checked now, registered by the first call
        self._ready: asyncio.Future[None] | None = None
        self._publisher: asyncio.Future[None] | None = None
        # New sessions placed in one loop turn share one directory call (redis_router.coalesce).
        self._placer: Coalescer[str, int] = Coalescer(self._place_batch)
        # Releases on replicas this process had not seen, waiting for the layout.
        self._looking_up: set[asyncio.Future[bool]] = set()

    # -- driving the operations ------------------------------------------------------------

    async def _drive(self, op: ShardedOp[T]) -> T:
        """Run an operation once the pool is joined (the first call joins it)."""
        await self._joined()
        return await self._run(op)

    async def _run(self, op: ShardedOp[T]) -> T:
        return await run_steps_async(op, self._step)

    async def _step(self, step: ShardStep) -> Any:
        if isinstance(step, OnShard):
            got = getattr(self._shards[step.shard], step.method)(*step.args, **step.kwargs)
            return await got if inspect.iscoroutine(got) else got
        if isinstance(step, OnDirectory):
            return await self._dir._call(step.op)
        if isinstance(step, Placing):
            if step.avoid:  # a session moving off a shard: by itself
                return await self._dir._call(self._place(step.keys, step.avoid))
            return list(await asyncio.gather(*(self._placer.submit(k) for k in step.keys)))
        client = self._dir._client
        if on_cluster(client):
            return cluster_primaries(await client.cluster_slots())
        return []

    async def _place_batch(self, keys: list[str]) -> list[int | BaseException]:
        return list(await self._dir._call(self._place(keys)))

    async def _joined(self) -> None:
        """Read the layout and register the constructor's replicas, once."""
        if self._ready is None or (self._ready.done() and self._ready.exception() is not None):
            self._ready = asyncio.ensure_future(self._join_with_servers())
        await asyncio.shield(self._ready)

    async def _join_with_servers(self) -> None:
        await self._run(self._join())
        if self._initial:
            await self._run(self._add(self._initial, None))
            self._initial = {}

    def _publish_from_now(self) -> None:
        if self._publisher is None:
            self._publisher = asyncio.ensure_future(_publish(weakref.ref(self)))

    async def grow(self, shards: int) -> list[str]:
        """See ShardedLoadBalancer.grow."""
        return await self._drive(self._grow(shards))

    # -- routing ---------------------------------------------------------------------------

    async def acquire_server(
        self,
        request_id: str,
        *,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> tuple[str, Any]:
        """See ShardedLoadBalancer.acquire_server."""
        op = self._routed("acquire_server", request_id, fields, wait=wait, exclude=exclude)
        return await self._drive(op)

    async def acquire(
        self,
        request_id: str,
        *,
        token: str | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> AsyncLease:
        """See ShardedLoadBalancer.acquire."""
        op = self._routed("acquire", request_id, fields, token=token, wait=wait, exclude=exclude)
        return await self._drive(op)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        request_id: str,
        *,
        renew_every: float | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> AsyncIterator[AsyncLease]:
        """See AsyncRedisLoadBalancer.lease (released exactly once, also on cancellation); a
        session its shard cannot take is placed on another, as by acquire."""
        self._check(request_id, fields, exclude)
        key = self._key(request_id, fields)
        avoid: tuple[int, ...] = ()
        async with contextlib.AsyncExitStack() as stack:
            while True:
                index = (await self._drive(self._shard_of([key], avoid)))[0]
                lease = self._shards[index].lease(
                    request_id, **self._lease_kw(avoid, renew_every, wait, exclude), **fields
                )
                try:
                    held = await stack.enter_async_context(lease)
                    break
                except NoServersAvailable as refused:
                    avoid = self._elsewhere(avoid, index, refused)
            yield self._granted(index, held)

    async def acquire_many(
        self, request_ids: list[str], *, wait: float | None = None, **fields: Any
    ) -> list[tuple[str, Any]]:
        """See ShardedLoadBalancer.acquire_many: granted whole or not at all."""
        return await self._drive(self._acquire_many(request_ids, wait, fields))

    def release_server(
        self,
        server_id: str,
        request_id: str | None = None,
        *,
        failed: bool = False,
        **fields: Any,
    ) -> AsyncReleased:
        """See ShardedLoadBalancer.release_server. Not a coroutine (as
        AsyncRedisLoadBalancer's): on a replica whose home this process knows (from the
        layout it read, or a grant that named it) the release is queued at once, in order
        with this process's other releases; on one it has not seen, it goes once the layout
        is read, as in the blocking pool."""
        sid, rid, bad = validation.release(server_id, request_id, failed)
        if self._shards and self._knows(sid):
            return self._shards[self._home(sid)].release_server(sid, rid, failed=bad, **fields)

        async def once_the_home_is_known() -> bool:
            b = self._shards[await self._drive(self._release_home(sid))]
            return await b.release_server(sid, rid, failed=bad, **fields)

        task = asyncio.ensure_future(once_the_home_is_known())
        self._looking_up.add(task)  # held until done (close() waits for it)
        task.add_done_callback(self._looking_up.discard)
        return AsyncReleased(task)

    release_server.returns_awaitable = True  # type: ignore[attr-defined]

    # -- the pool --------------------------------------------------------------------------

    async def add_servers(
        self, servers: Mapping[str, Any], *, capacity: Mapping[str, int] | None = None
    ) -> int:
        return await self._drive(self._add(servers, capacity))

    async def remove_servers(self, server_ids: list[str]) -> int:
        return await self._drive(self._remove(server_ids))

    async def drain_servers(self, server_ids: list[str]) -> int:
        return await self._drive(self._per_home("drain_servers", server_ids))

    async def undrain_servers(self, server_ids: list[str]) -> int:
        return await self._drive(self._per_home("undrain_servers", server_ids))

    async def get_all_servers(self) -> list[str]:
        return await self._drive(self._all_servers())

    async def get_inflight_count(self, server_id: str) -> int:
        return await self._drive(self._inflight(server_id))

    async def get_total_inflight(self) -> int:
        return await self._drive(self._total())

    async def report_engine_load(self, loads: Mapping[str, Any]) -> int:
        return await self._drive(self._report(loads))

    async def get_status(self) -> dict[str, Any]:
        return await self._drive(self._status())

    async def request_owner(self, request_id: str) -> str | None:
        return await self._drive(self._owner(request_id))

    async def end_session(self, *request_ids: str) -> int:
        return await self._drive(self._sum_each("end_session", *request_ids))

    async def bump_weight_version(self, *, sticky: bool = False) -> dict[str, int]:
        return await self._drive(self._bump(sticky))

    async def clear_sticky_cache(self) -> dict[str, Any]:
        return await self._drive(self._clear())

    async def reap(self) -> int:
        return await self._drive(self._sum_each("reap"))

    async def destroy(self) -> int:
        """See ShardedLoadBalancer.destroy."""
        await self._stop_publishing()
        return await self._drive(self._destroy(self._dir._core.destroy()))

    # -- lifetime --------------------------------------------------------------------------

    async def _stop_publishing(self) -> None:
        stopping, self._publisher = self._publisher, None
        if stopping is not None:
            stopping.cancel()
            await asyncio.wait({stopping}, timeout=KEEPER_STOP_TIMEOUT)

    async def close(self) -> None:
        """Close every shard (their leases end) and the directory's connection."""
        if self._looking_up:  # releases waiting for the layout go first
            await asyncio.wait(set(self._looking_up))
        await self._stop_publishing()
        for b in self._shards:
            await b.close()
        await self._dir.close()

    async def __aenter__(self) -> AsyncShardedLoadBalancer:
        await self._joined()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _publish(ref: weakref.ReferenceType[AsyncShardedLoadBalancer]) -> None:
    """Every period, the pool's publishing (until the pool is gone or closed)."""
    while True:
        await asyncio.sleep(PUBLISH_EVERY)
        pool = ref()
        if pool is None or pool._dir._core.closed:
            return
        try:
            await pool._run(pool._publish())
        except (rx.RedisError, NoServersAvailable, ConnectionError) as exc:
            keeper.log.debug("sharded pool %r: publishing totals failed: %s", pool.name, exc)
        del pool
