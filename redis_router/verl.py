"""A drop-in router for verl: its plugin loader builds this class as a Ray actor, as-is.

verl (``verl/workers/rollout/router.py``) constructs a YAML-named router in one of these ways,
all accepted here:

- ``ray.remote(cls).remote(servers, yaml_config)``: the whole YAML, ``router_class`` included,
  as the second positional argument (what the seed calls ``router_kwargs``);
- ``ray.remote(cls).remote(servers=..., router_kwargs=...)``;
- ``ray.remote(cls).remote(servers=..., config=...)`` (newer verl: the router config plus
  ``full_determinism``);
- as ``load_balancer_cls``: ``.remote(servers=..., max_cache_size=..., full_determinism=...)``.

Every method is a coroutine, so Ray runs the actor as an async actor: many
``LLMServerClient`` calls are in flight at once and each is one Redis round trip. verl awaits
``acquire_server.remote(request_id=..., **declared fields)`` and the two
``require_*_fields.remote()``, and fires ``release_server.remote(server_id=..., ...)`` without
awaiting it; all of that works unchanged. When no replica can take a request, the error is a
``RuntimeError`` whose message contains verl's "No available servers in load balancer", which
verl's ``FullyAsyncLLMServerClient`` waits on.

The state lives in Redis, not in the actor: the actor can restart, and several actors (several
verl jobs, or a job and an operator's CLI) with the same Redis and ``name`` are one balancer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .client import call
from .errors import NoServersAvailable
from .loader import resolve_router_class

VERL_NO_SERVERS = "No available servers in load balancer"
# Keys of a router config that verl or this adaptor consume rather than the balancer.
_ADAPTOR_KEYS = ("router_class", "balancer_class")


class VerlRouter:
    """verl's ``RequestLoadBalancer`` over a redis-router balancer.

    Config keys (YAML, ``router_kwargs`` or ``config``): ``redis`` (URL), ``name``,
    ``sticky_ttl``, ``lease_ttl``, ``full_determinism``, and ``balancer_class``: the
    redis-router balancer to drive, a class name or a registered router name (default
    ``redis_router.AsyncRedisLoadBalancer``; e.g. ``least_tokens`` to balance by tokens).
    """

    def __init__(
        self,
        servers: Mapping[str, Any] | None = None,
        router_kwargs: Mapping[str, Any] | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        full_determinism: bool | None = None,
        max_cache_size: int | None = None,
    ) -> None:
        if router_kwargs is not None and config is not None:
            raise TypeError("give router_kwargs or config, not both")
        opts = _plain(router_kwargs if router_kwargs is not None else config)
        spec = opts.pop("balancer_class", None) or "redis_router.AsyncRedisLoadBalancer"
        opts.pop("router_class", None)
        if full_determinism is not None:
            if opts.get("full_determinism", full_determinism) != full_determinism:
                raise TypeError("full_determinism given both as an argument and in the config")
            opts["full_determinism"] = full_determinism
        # max_cache_size bounds verl's in-memory sticky LRU; here sticky entries expire after
        # sticky_ttl in Redis instead, so it is accepted for compatibility and not used.
        del max_cache_size
        cls = resolve_router_class(str(spec), source="balancer_class")
        self._lb = cls(servers, router_kwargs=opts)

    @property
    def balancer(self) -> Any:
        """The redis-router balancer this actor drives."""
        return self._lb

    async def require_acquire_fields(self) -> list[str]:
        return list(await call(self._lb.require_acquire_fields))

    async def require_release_fields(self) -> list[str]:
        return list(await call(self._lb.require_release_fields))

    async def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Any]:
        try:
            return await call(self._lb.acquire_server, request_id, **fields)
        except NoServersAvailable as exc:
            raise NoServersAvailable(f"{VERL_NO_SERVERS}: {exc}") from None

    async def release_server(
        self, server_id: str, request_id: str | None = None, **fields: Any
    ) -> bool:
        return await call(self._lb.release_server, server_id, request_id, **fields)

    async def add_servers(self, servers: Mapping[str, Any]) -> int:
        return await call(self._lb.add_servers, servers)

    async def remove_servers(self, server_ids: list[str]) -> int:
        return await call(self._lb.remove_servers, server_ids)

    async def get_all_servers(self) -> list[str]:
        return await call(self._lb.get_all_servers)

    async def get_inflight_count(self, server_id: str) -> int:
        return await call(self._lb.get_inflight_count, server_id)

    async def get_total_inflight(self) -> int:
        return await call(self._lb.get_total_inflight)

    async def get_status(self) -> dict[str, Any]:
        return await call(self._lb.get_status)

    async def clear_sticky_cache(self) -> None:
        await call(self._lb.clear_sticky_cache)

    async def close(self) -> None:
        await call(self._lb.close)


def _plain(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain dict of a router config (an OmegaConf node is resolved first)."""
    if config is None:
        return {}
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
    if not isinstance(config, Mapping):
        raise TypeError(f"router config must be a mapping, got {type(config).__name__}")
    return {str(k): v for k, v in config.items()}
