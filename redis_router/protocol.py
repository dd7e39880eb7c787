"""The router interface: what every balancer and router plugin implements.

Structural typing (``typing.Protocol``), as in verl's ``router.py`` (0.9.1): a plugin needs no
base class and no import from this library, only these ten methods. ``isinstance`` checks that
they exist (runtime-checkable protocols cannot check signatures).

An asyncio implementation (:class:`~redis_router.AsyncRedisLoadBalancer`) satisfies
:class:`RequestLoadBalancer` at runtime with coroutine methods;
:class:`AsyncRequestLoadBalancer` spells out those signatures for type checkers.
:class:`~redis_router.RouterClient` drives either kind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, Protocol, runtime_checkable

METHODS = (
    "require_acquire_fields",
    "require_release_fields",
    "acquire_server",
    "release_server",
    "add_servers",
    "remove_servers",
    "get_all_servers",
    "get_status",
    "clear_sticky_cache",
    "get_total_inflight",
)
"""The method names of the protocol, for error messages that list what a class lacks."""

CLIENT_METHODS = (
    "require_acquire_fields",
    "require_release_fields",
    "acquire_server",
    "release_server",
)
"""The methods a client that routes requests calls (verl's ``LLMServerClient``,
:class:`~redis_router.RouterClient`); a router older than the protocol may have only these."""


@runtime_checkable
class RequestLoadBalancer(Protocol):
    """A load balancer for inference replicas.

    ``acquire_server`` routes and counts a request in one atomic call and returns
    ``(server_id, handle)``; ``release_server`` ends it. Routers that need request data
    (``prompt_ids`` for a cache- or token-aware router) declare the names in
    ``require_acquire_fields`` / ``require_release_fields``; clients send only those (a router
    that declares ``request_id`` for release gets it, so a release can end exactly that
    request's lease). ``clear_sticky_cache`` returns verl's rebalance report,
    ``{"cleared_entries": int, "server_loads": {server_id: in-flight}}``, which verl's
    fully-async rollouter reads after forgetting every session.
    """

    def require_acquire_fields(self) -> list[str]: ...

    def require_release_fields(self) -> list[str]: ...

    def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Any]: ...

    def release_server(
        self, server_id: str, request_id: str | None = None, **fields: Any
    ) -> Any: ...

    def add_servers(self, servers: Mapping[str, Any]) -> Any: ...

    def remove_servers(self, server_ids: list[str]) -> Any: ...

    def get_all_servers(self) -> list[str]: ...

    def get_status(self) -> dict[str, Any]: ...

    def clear_sticky_cache(self) -> dict[str, Any]: ...

    def get_total_inflight(self) -> int: ...


@runtime_checkable
class AsyncRequestLoadBalancer(Protocol):
    """:class:`RequestLoadBalancer` with coroutine methods (the field declarations may be
    plain methods or coroutines; clients accept both)."""

    def require_acquire_fields(self) -> Any: ...

    def require_release_fields(self) -> Any: ...

    async def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Any]: ...

    def release_server(
        self, server_id: str, request_id: str | None = None, **fields: Any
    ) -> Awaitable[Any]: ...

    async def add_servers(self, servers: Mapping[str, Any]) -> Any: ...

    async def remove_servers(self, server_ids: list[str]) -> Any: ...

    async def get_all_servers(self) -> list[str]: ...

    async def get_status(self) -> dict[str, Any]: ...

    async def clear_sticky_cache(self) -> dict[str, Any]: ...

    async def get_total_inflight(self) -> int: ...


def missing_methods(obj: object, methods: tuple[str, ...] = METHODS) -> list[str]:
    """The ``methods`` (default: the whole protocol) that ``obj`` (a class or an instance)
    lacks or has as non-callables."""
    return [m for m in methods if not callable(getattr(obj, m, None))]
