"""The HTTP front: clients that only speak OpenAI's API reach the shared balancer.

- ``redis-router serve`` (:mod:`redis_router.http.server`): a stateless aiohttp router
  process; any number on one Redis route as one balancer.
- :mod:`redis_router.http.transport`: httpx transports (sync and async) that route each
  request of an ordinary ``httpx`` or ``openai`` client through a balancer in-process, with
  the same session, lease and failure rules.
- :mod:`redis_router.http.routing`: what both read from a request (no HTTP stack).

Needs the http extra (from a checkout: ``pip install -e '.[http]'``); the core does not import this.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncRouterTransport", "RouterTransport"]


def __getattr__(name: str) -> Any:
    """The transports, imported on first use (httpx is an optional dependency)."""
    if name in __all__:
        from . import transport

        return getattr(transport, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
