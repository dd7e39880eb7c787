"""Declared fields: send a router only the request data it asked for.

A caller packs everything it knows about a request (``prompt_ids``, ``sampling_params``...);
:class:`RouterClient` asks the router once which of those it wants for acquire and for release,
caches the answer, and passes only those. The default balancer declares none, so nothing
extra crosses the wire; a token- or cache-aware router declares ``prompt_ids``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .errors import RouterConfigError
from .outbox import Released
from .protocol import CLIENT_METHODS, missing_methods

Fields = tuple[tuple[str, ...], tuple[str, ...]]

# Releases of leases granted to a task cancelled while it waited for them; referenced here so
# they are not garbage-collected before they run.
_late_releases: set[asyncio.Future[Any]] = set()


class RouterClient:
    """Drive any :class:`~redis_router.RequestLoadBalancer`, sync or asyncio.

    ``async with client.session(rid, **fields) as (server_id, handle)`` acquires with the
    declared acquire fields and releases in a ``finally`` with the declared release fields,
    also when the task is cancelled (a grant that lands after the cancellation is released
    too). A sync balancer's calls run in a worker thread, so a slow Redis never blocks the
    event loop. :meth:`session_sync` is the blocking form, for sync balancers.

    The balancer needs only the methods the client calls (``require_acquire_fields``,
    ``require_release_fields``, ``acquire_server``, ``release_server``), as verl's client:
    a router older than the full protocol works.
    """

    def __init__(self, balancer: Any) -> None:
        missing = missing_methods(balancer, CLIENT_METHODS)
        if missing:
            raise RouterConfigError(
                f"RouterClient needs a router with {list(CLIENT_METHODS)}; "
                f"{type(balancer).__name__} lacks {missing}"
            )
        self.balancer = balancer
        self._is_async = inspect.iscoroutinefunction(balancer.acquire_server)
        self._fields: Fields | None = None
        self._asking: asyncio.Future[Fields] | None = None
        self._lock = threading.Lock()
        self._release_accepts = _accepted_names(balancer.release_server)

    # -- the declarations, asked once ------------------------------------------------------

    async def fields(self) -> Fields:
        """(acquire fields, release fields), asked on first use, both at once, then cached.
        Concurrent first callers share one question; a failed question is asked again."""
        if self._fields is not None:
            return self._fields
        if self._asking is None or (self._asking.done() and self._asking.exception()):
            self._asking = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._asking)

    async def _ask(self) -> Fields:
        b = self.balancer
        acquire, release = await asyncio.gather(
            call(b.require_acquire_fields), call(b.require_release_fields)
        )
        self._fields = _names(acquire, "acquire"), _names(release, "release")
        return self._fields

    def fields_sync(self) -> Fields:
        """:meth:`fields` for a sync balancer."""
        with self._lock:
            if self._fields is None:
                b = self.balancer
                self._fields = (
                    _names(b.require_acquire_fields(), "acquire"),
                    _names(b.require_release_fields(), "release"),
                )
            return self._fields

    # -- acquire / release -----------------------------------------------------------------

    async def acquire(self, request_id: str, **fields: Any) -> tuple[str, Any]:
        """Route the request, passing only the declared acquire fields that were given."""
        wanted, _ = await self.fields()
        picked = {k: fields[k] for k in wanted if k in fields}
        server_id, handle = await call(
            self.balancer.acquire_server, request_id=request_id, **picked
        )
        return server_id, handle

    async def release(self, server_id: str, request_id: str, **fields: Any) -> None:
        """End the request, passing only the declared release fields (``request_id``
        included only if declared), and only those the balancer's signature accepts."""
        await call(self.balancer.release_server, server_id, **self._release_kw(request_id, fields))

    @contextlib.asynccontextmanager
    async def session(self, request_id: str, **fields: Any) -> AsyncIterator[tuple[str, Any]]:
        """Hold a replica for the body; released exactly once however the body ends."""
        pending = asyncio.ensure_future(self.acquire(request_id, **fields))
        try:
            server_id, handle = await asyncio.shield(pending)
        except asyncio.CancelledError:
            # The acquire runs on; if it grants, give the replica back instead of leaking it.
            pending.add_done_callback(lambda t: self._release_late(t, request_id, fields))
            raise
        try:
            yield server_id, handle
        finally:
            await asyncio.shield(self.release(server_id, request_id, **fields))

    @contextlib.contextmanager
    def session_sync(self, request_id: str, **fields: Any) -> Iterator[tuple[str, Any]]:
        """:meth:`session` for a sync balancer, without an event loop."""
        if self._is_async:
            raise TypeError(
                f"{type(self.balancer).__name__} is asyncio: use `async with session()`"
            )
        wanted, _ = self.fields_sync()
        picked = {k: fields[k] for k in wanted if k in fields}
        server_id, handle = self.balancer.acquire_server(request_id=request_id, **picked)
        try:
            yield server_id, handle
        finally:
            self.balancer.release_server(server_id, **self._release_kw(request_id, fields))

    # -- helpers ---------------------------------------------------------------------------

    def _release_kw(self, request_id: str, fields: dict[str, Any]) -> dict[str, Any]:
        assert self._fields is not None
        pool = {**fields, "request_id": request_id}
        return {
            k: pool[k]
            for k in self._fields[1]
            if k in pool and (self._release_accepts is None or k in self._release_accepts)
        }

    def _release_late(
        self, task: asyncio.Future[Any], request_id: str, fields: dict[str, Any]
    ) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        server_id, _ = task.result()
        late = asyncio.ensure_future(self.release(server_id, request_id, **fields))
        _late_releases.add(late)
        late.add_done_callback(_late_releases.discard)


async def call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a balancer method from asyncio: await a coroutine method (or one marked
    ``returns_awaitable``, such as AsyncRedisLoadBalancer.release_server, which must run on
    the event loop), run a blocking one in a worker thread. An awaitable result (a sync
    wrapper around an async router) is awaited."""
    if inspect.iscoroutinefunction(method) or getattr(method, "returns_awaitable", False):
        result = await method(*args, **kwargs)
    else:
        result = await asyncio.to_thread(_settled, method, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


def _settled(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A blocking method's result, in the worker thread; a sync release's outcome is read
    there too, never on the event loop."""
    result = method(*args, **kwargs)
    return result.result() if isinstance(result, Released) else result


def _names(value: Any, which: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value or ()):
        raise TypeError(
            f"require_{which}_fields() must return a list of field names, got {value!r}"
        )
    return tuple(value or ())


def _accepted_names(method: Callable[..., Any]) -> frozenset[str] | None:
    """Keyword names ``method`` accepts besides server_id; None if it takes **kwargs (or its
    signature cannot be read). The legacy ``release_server(server_id)`` accepts none."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
