"""The asyncio sharded pool: :class:`AsyncShardedLoadBalancer`, K asyncio balancers as one."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any

from redis import exceptions as rx

from . import keeper, validation
from .aio import KEEPER_STOP_TIMEOUT, AsyncLease, AsyncRedisLoadBalancer, AsyncReleased
from .core import Op, T
from .errors import NoServersAvailable, ReplicaEjected
from .shards import (
    PUBLISH_EVERY,
    Layout,
    ShardedBase,
    cluster_primaries,
    more_names,
    shard_count,
)


class AsyncShardedLoadBalancer(ShardedBase):
    """The asyncio form of :class:`~redis_router.sharded.ShardedLoadBalancer` (same
    arguments, methods are coroutines). The layout is read (or written) by the first call,
    which makes the shards' balancers."""

    _shards: list[AsyncRedisLoadBalancer]

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
        redis, router_kwargs = self._setup(shards, name, redis, router_kwargs)
        if router_kwargs:
            options["router_kwargs"] = router_kwargs
        self._dir = AsyncRedisLoadBalancer(redis=redis, name=self.name, **options)
        self.url = self._dir.url
        self._attach(self._dir._core)
        self._options = {k: v for k, v in options.items() if k != "max_connections"}
        self._initial = dict(servers) if servers else {}
        self._shards = []
        self._ready: asyncio.Future[None] | None = None
        self._publisher: asyncio.Future[None] | None = None

    async def _joined_pool(self) -> None:
        """Make the shards' balancers once (the first call of any method waits for it)."""
        if self._ready is None or (self._ready.done() and self._ready.exception() is not None):
            self._ready = asyncio.ensure_future(self._join())
        await asyncio.shield(self._ready)

    async def _join(self) -> None:
        self._extend(await self._layout())
        if self._initial:
            initial, self._initial = self._initial, {}
            await self._add(initial, None)

    async def _layout(self) -> Layout:
        layout = await self._run(self._directory.layout())
        if not layout.names:
            names = self._named(await self._primaries())
            try:
                layout = await self._run(self._directory.layout("create", names))
            except rx.ResponseError as exc:
                raise self._directory.refused(exc) from None
        return self._joined(layout)

    async def _primaries(self) -> list[list[tuple[int, int]]]:
        client = self._dir._client
        if hasattr(client, "cluster_slots") and hasattr(client, "nodes_manager"):
            return cluster_primaries(await client.cluster_slots())
        return []

    def _extend(self, layout: Layout) -> None:
        """See ShardedLoadBalancer._extend."""
        for n in layout.names[len(self._shards) :]:
            self._shards.append(
                AsyncRedisLoadBalancer(redis=self._dir._client, name=n, **self._options)
            )
        self._k = len(self._shards)
        self._homes = dict(layout.homes)

    async def _refresh(self) -> None:
        self._extend(self._joined(await self._run(self._directory.layout())))

    async def grow(self, shards: int) -> list[str]:
        """See ShardedLoadBalancer.grow."""
        k = shard_count(shards)
        await self._joined_pool()
        await self._refresh()
        if k < self._k:
            raise ValueError(f"shards: a pool only grows; it has {self._k}, got {k}")
        if k > self._k:
            names = more_names(self.name, self.shard_names, k, await self._primaries())
            try:
                self._extend(await self._run(self._directory.layout("grow", names)))
            except rx.ResponseError as exc:
                raise self._directory.refused(exc) from None
        return self.shard_names

    async def _run(self, op: Op[T]) -> T:
        return await self._dir._call(op)

    @property
    def shard_names(self) -> list[str]:
        """The shards' balancer names, in order (empty before the first call)."""
        return [b.name for b in self._shards]

    # -- routing ---------------------------------------------------------------------------

    async def _shard_of(self, keys: list[str], avoid: tuple[int, ...] = ()) -> list[int]:
        await self._joined_pool()
        missing = self._unplaced(keys, avoid)
        if missing:
            placed = await self._run(self._directory.place(missing, avoid))
            if max(placed) >= len(self._shards):  # the pool grew since this process looked
                await self._refresh()
            self._remember(missing, placed)
        self._publish_from_now()
        return self._placed(keys)

    async def _routed(
        self, request_id: str, fields: Mapping[str, Any], wait: float | None, call: Any
    ) -> Any:
        """As ShardedLoadBalancer._routed: a session its shard cannot take moves, once per
        shard; only the first waits."""
        key = self._key(request_id, fields)
        avoid: tuple[int, ...] = ()
        while True:
            shard = (await self._shard_of([key], avoid))[0]
            try:
                got = await call(self._shards[shard], wait if not avoid else 0.0)
                return self._granted(shard, got)
            except ReplicaEjected:
                raise
            except NoServersAvailable:
                avoid = (*avoid, shard)
                if len(avoid) >= self._k:
                    raise

    async def acquire_server(
        self,
        request_id: str,
        *,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> tuple[str, Any]:
        self._check(request_id, fields, exclude)
        return await self._routed(  # type: ignore[no-any-return]
            request_id,
            fields,
            wait,
            lambda b, w: b.acquire_server(request_id, wait=w, exclude=exclude, **fields),
        )

    async def acquire(
        self,
        request_id: str,
        *,
        token: str | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> AsyncLease:
        self._check(request_id, fields, exclude, token)
        return await self._routed(  # type: ignore[no-any-return]
            request_id,
            fields,
            wait,
            lambda b, w: b.acquire(request_id, token=token, wait=w, exclude=exclude, **fields),
        )

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
        self._check(request_id, fields, exclude)
        shard = self._shards[(await self._shard_of([self._key(request_id, fields)]))[0]]
        async with shard.lease(
            request_id, renew_every=renew_every, wait=wait, exclude=exclude, **fields
        ) as held:
            yield held

    async def acquire_many(
        self, request_ids: list[str], *, wait: float | None = None, **fields: Any
    ) -> list[tuple[str, Any]]:
        """See ShardedLoadBalancer.acquire_many: granted whole or not at all."""
        rids, per = self._check_many(request_ids, fields)
        shards = await self._shard_of([self._key(r, f) for r, f in zip(rids, per, strict=True)])
        out: list[tuple[str, Any] | None] = [None] * len(rids)
        granted: list[tuple[AsyncRedisLoadBalancer, str, str]] = []
        try:
            for shard, idx in self._by_shard(shards).items():
                b = self._shards[shard]
                part = [rids[i] for i in idx]
                got = await b.acquire_many(part, wait=wait, **self._fields_of(per, idx, fields))
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
    ) -> AsyncReleased:
        """See ShardedLoadBalancer.release_server (a replica this process has not seen is
        released through shard 0, which answers False for it)."""
        b = self._shards[self._home(server_id)] if self._shards else None
        if b is None:
            raise NoServersAvailable(
                f"sharded pool {self.name!r}: nothing was acquired through this balancer yet"
            )
        return b.release_server(server_id, request_id, failed=failed, **fields)

    release_server.returns_awaitable = True  # type: ignore[attr-defined]

    # -- the pool --------------------------------------------------------------------------

    async def add_servers(
        self, servers: Mapping[str, Any], *, capacity: Mapping[str, int] | None = None
    ) -> int:
        self._capacities(servers, capacity)  # checked before anything is sent
        await self._joined_pool()
        return await self._add(servers, capacity)

    async def _add(self, servers: Mapping[str, Any], capacity: Mapping[str, int] | None) -> int:
        caps = self._capacities(servers, capacity)
        homes = await self._run(self._directory.assign(caps))
        self._homes.update(homes)
        added = 0
        for shard, part in self._split_servers(servers, capacity, homes).items():
            added += await self._shards[shard].add_servers(part[0], capacity=part[1])
        return added

    async def _homes_of(self, server_ids: list[str]) -> dict[int, list[str]]:
        await self._joined_pool()
        ids = validation.server_ids(server_ids)
        if any(not self._known(s) for s in ids):
            await self._refresh()
        return self._by_home(ids)

    async def remove_servers(self, server_ids: list[str]) -> int:
        removed = 0
        for s, ids in (await self._homes_of(server_ids)).items():
            removed += await self._shards[s].remove_servers(ids)
        await self._run(self._directory.unassign(self._whole(server_ids)))
        return removed

    async def drain_servers(self, server_ids: list[str]) -> int:
        n = 0
        for s, ids in (await self._homes_of(server_ids)).items():
            n += await self._shards[s].drain_servers(ids)
        return n

    async def undrain_servers(self, server_ids: list[str]) -> int:
        n = 0
        for s, ids in (await self._homes_of(server_ids)).items():
            n += await self._shards[s].undrain_servers(ids)
        return n

    async def get_all_servers(self) -> list[str]:
        await self._joined_pool()
        return sorted([sid for b in self._shards for sid in await b.get_all_servers()])

    async def get_inflight_count(self, server_id: str) -> int:
        shard = (await self._homes_of([server_id])).popitem()[0]
        return await self._shards[shard].get_inflight_count(server_id)

    async def get_total_inflight(self) -> int:
        await self._joined_pool()
        return sum([await b.get_total_inflight() for b in self._shards])

    async def report_engine_load(self, loads: Mapping[str, Any]) -> int:
        n = 0
        for s, ids in (await self._homes_of(list(loads))).items():
            n += await self._shards[s].report_engine_load({sid: loads[sid] for sid in ids})
        return n

    async def get_status(self) -> dict[str, Any]:
        await self._joined_pool()
        found = [await b.get_status() for b in self._shards]
        return self._status(found, await self._run(self._directory.stats()))

    async def request_owner(self, request_id: str) -> str | None:
        await self._joined_pool()
        b: AsyncRedisLoadBalancer
        for b in self._in_turn(request_id):
            owner = await b.request_owner(request_id)
            if owner is not None:
                return owner
        return None

    async def end_session(self, *request_ids: str) -> int:
        await self._joined_pool()
        return sum([await b.end_session(*request_ids) for b in self._shards])

    async def bump_weight_version(self, *, sticky: bool = False) -> dict[str, int]:
        await self._joined_pool()
        return self._bumped([await b.bump_weight_version(sticky=sticky) for b in self._shards])

    async def clear_sticky_cache(self) -> dict[str, Any]:
        await self._joined_pool()
        return self._cleared([await b.clear_sticky_cache() for b in self._shards])

    async def reap(self) -> int:
        await self._joined_pool()
        return sum([await b.reap() for b in self._shards])

    async def destroy(self) -> int:
        await self._joined_pool()
        n = sum([await b.destroy() for b in self._shards]) + await self._dir.destroy()
        self._forget_all()
        return n

    # -- the directory's totals ------------------------------------------------------------

    def _publish_from_now(self) -> None:
        if self._publisher is None:
            self._publisher = asyncio.ensure_future(_publish(weakref.ref(self)))

    # -- lifetime --------------------------------------------------------------------------

    async def close(self) -> None:
        """Close every shard (their leases end) and the directory's connection."""
        stopping, self._publisher = self._publisher, None
        if stopping is not None:
            stopping.cancel()
            await asyncio.wait({stopping}, timeout=KEEPER_STOP_TIMEOUT)
        for b in self._shards:
            await b.close()
        await self._dir.close()

    async def __aenter__(self) -> AsyncShardedLoadBalancer:
        await self._joined_pool()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _publish(ref: weakref.ReferenceType[AsyncShardedLoadBalancer]) -> None:
    """Every period: claim the shards due, read and publish their totals."""
    while True:
        await asyncio.sleep(PUBLISH_EVERY)
        pool = ref()
        if pool is None or pool._dir._core.closed:
            return
        try:
            due = await pool._run(pool._directory.totals({}))
            if due:
                if max(due) >= len(pool._shards):
                    await pool._refresh()
                totals = {s: await pool._shards[s].get_total_inflight() for s in due}
                await pool._run(pool._directory.totals(totals))
        except (rx.RedisError, NoServersAvailable, ConnectionError) as exc:
            keeper.log.debug("sharded pool %r: publishing totals failed: %s", pool.name, exc)
        del pool
