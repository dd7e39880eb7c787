"""A drop-in router for verl: its plugin loader builds this class as a Ray actor, as-is.

verl (``verl/workers/rollout/router.py``, 0.9.1) constructs a router in one of two ways, both
accepted here:

- from a YAML file (``rollout.router_config_path``): ``ray.remote(cls).remote(servers,
  yaml_dict)``, the whole file, ``router_class`` included, as the second positional argument;
- as ``load_balancer_cls``: ``ray.remote(cls).remote(servers=..., max_cache_size=10000)``;
  the settings then come from the environment (``REDIS_URL``) and the defaults.

``config=`` and ``router_kwargs=`` are accepted as keywords too. verl passes
``full_determinism`` only to its own balancer, never to a plugin: set it in the YAML.

Every method is a coroutine, so Ray runs the actor as an async actor: many
``LLMServerClient`` calls are in flight at once and each is one Redis round trip. verl awaits
``acquire_server.remote(request_id=..., **declared fields)`` and fires
``release_server.remote(server_id=..., request_id=...)`` without awaiting it. When no replica
can take a request the error is a ``RuntimeError`` whose message contains verl's "No available
servers in load balancer", which verl's ``FullyAsyncLLMServerClient`` waits on.

Each job owns its pool. Without a ``name`` in the config the balancer's name is derived from
the replica ids (verl's server ids are the replicas' ``ip:port`` addresses), so a second job,
or a teacher model's balancer, on the same Redis gets a pool of its own, and a restarted job
with the same replicas finds its own pool (sticky sessions included). For such a pool the
constructor's servers are the truth: replicas registered under that name by an earlier
incarnation but not given now are removed. An explicit ``name`` shares a pool on purpose; a
grant of a replica whose handle this process does not hold (a Ray actor handle cannot be
stored in Redis) is released at once and raised as :class:`UnusableReplica`, never returned
as ``None``.

The balancer keeps its leases alive from the background for as long as this actor lives, so
a generation of any length stays counted; ``lease_ttl`` is how long a dead actor's requests
keep counting before they are reclaimed.

``python -m redis_router.verl`` prints verl's override line for the shipped ``verl.yaml``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .. import dp, validation
from ..client import call
from ..errors import NoServersAvailable, RedisRouterError
from ..loader import resolve_config_path, resolve_router_class

VERL_NO_SERVERS = "No available servers in load balancer"
DEFAULT_BALANCER = "redis_router.AsyncRedisLoadBalancer"
# The shipped config, wherever the package is installed (a wheel or a source checkout).
CONFIG_URL = "pkg://redis_router.plugins/verl.yaml"
OVERRIDE_KEY = "actor_rollout_ref.rollout.router_config_path"


class UnusableReplica(RedisRouterError, RuntimeError):
    """The balancer granted a replica whose handle this process does not hold (another
    process registered it). The lease has been released; the message says what to do."""


def pool_name(server_ids: Mapping[str, Any] | list[str]) -> str:
    """The balancer name of a pool of replicas: ``verl-`` and the first 12 hex digits of the
    SHA-1 of the sorted ids, so the same replicas always give the same name. Ids cannot hold
    control characters, so the newline that joins them is unambiguous."""
    ids = sorted(server_ids)
    digest = hashlib.sha1("\n".join(ids).encode(), usedforsecurity=False).hexdigest()
    return f"verl-{digest[:12]}"


class VerlRouter:
    """verl's ``RequestLoadBalancer`` over a redis-router balancer.

    Config keys (YAML, ``router_kwargs`` or ``config``): ``redis`` (URL), ``name`` (absent or
    null: one pool per set of replicas, see the module docstring), ``sticky_ttl``,
    ``lease_ttl``, ``max_lease_age``, ``full_determinism``, and ``balancer_class``: the
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
        spec = opts.pop("balancer_class", None) or DEFAULT_BALANCER
        opts.pop("router_class", None)
        if full_determinism is not None:
            if opts.get("full_determinism", full_determinism) != full_determinism:
                raise TypeError("full_determinism given both as an argument and in the config")
            opts["full_determinism"] = full_determinism
        # max_cache_size bounds verl's in-memory sticky LRU; here sticky entries expire after
        # sticky_ttl in Redis instead, so it is accepted for compatibility and not used.
        del max_cache_size
        self._handles = validation.servers_mapping(servers) if servers is not None else {}
        # A pool this router owns (derived name) is exactly its servers; an explicit name is a
        # pool shared on purpose, to which servers are only added.
        self._owns_pool = opts.get("name") is None
        if self._owns_pool:
            opts["name"] = pool_name(self._handles) if self._handles else _fresh_name()
        cls = resolve_router_class(str(spec), source="balancer_class")
        self._lb = cls(dict(self._handles), router_kwargs=opts)
        self._ready: asyncio.Future[None] | None = None

    @property
    def balancer(self) -> Any:
        """The redis-router balancer this actor drives."""
        return self._lb

    @property
    def name(self) -> str:
        """The balancer name in Redis (``redis-router --name NAME status`` watches it)."""
        return str(self._lb.name)

    async def _prepare(self) -> None:
        """Once, before the first call: in a pool this router owns, remove the replicas an
        earlier incarnation registered that are not among this router's servers. Concurrent
        first calls share one attempt; a failed attempt is made again by the next call."""
        if self._ready is None or (self._ready.done() and self._ready.exception()):
            self._ready = asyncio.ensure_future(self._remove_strangers())
        await asyncio.shield(self._ready)

    async def _remove_strangers(self) -> None:
        if not self._owns_pool:
            return
        registered = await call(self._lb.get_all_servers)
        # a rank of a data-parallel replica (redis_router.dp) belongs to its replica
        strangers = [
            sid
            for sid in registered
            if sid not in self._handles and dp.replica_of(sid)[0] not in self._handles
        ]
        if strangers:
            await call(self._lb.remove_servers, strangers)

    async def require_acquire_fields(self) -> list[str]:
        return list(await call(self._lb.require_acquire_fields))

    async def require_release_fields(self) -> list[str]:
        """``request_id`` always: verl then sends it, and a release ends that request's lease
        rather than the replica's oldest one."""
        declared = list(await call(self._lb.require_release_fields))
        return ["request_id", *(f for f in declared if f != "request_id")]

    async def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Any]:
        await self._prepare()
        try:
            server_id, handle = await call(self._lb.acquire_server, request_id, **fields)
        except NoServersAvailable as exc:
            raise NoServersAvailable(f"{VERL_NO_SERVERS}: {exc}") from None
        if server_id not in self._handles:
            await call(self._lb.release_server, server_id, request_id)
            raise UnusableReplica(
                f"balancer {self.name!r} granted replica {server_id!r} to request "
                f"{request_id!r}, but this router holds no handle for it: another process "
                "registered it, and a Ray actor handle cannot be shared through Redis. The "
                "lease was released. Routers share a pool only when their configs set the same "
                "`name`: remove `name` from the router config so that each job gets a pool of "
                "its own, or register every replica with every router that shares the name."
            )
        return server_id, handle

    async def release_server(
        self, server_id: str, request_id: str | None = None, **fields: Any
    ) -> bool:
        return bool(await call(self._lb.release_server, server_id, request_id, **fields))

    async def add_servers(self, servers: Mapping[str, Any]) -> int:
        await self._prepare()
        checked = validation.servers_mapping(servers)
        added = int(await call(self._lb.add_servers, checked))
        self._handles.update(checked)
        return added

    async def remove_servers(self, server_ids: list[str]) -> int:
        await self._prepare()
        ids = validation.server_ids(server_ids)
        removed = int(await call(self._lb.remove_servers, ids))
        for sid in ids:
            self._handles.pop(sid, None)
        return removed

    async def get_all_servers(self) -> list[str]:
        await self._prepare()
        return list(await call(self._lb.get_all_servers))

    async def get_inflight_count(self, server_id: str) -> int:
        return int(await call(self._lb.get_inflight_count, server_id))

    async def get_total_inflight(self) -> int:
        return int(await call(self._lb.get_total_inflight))

    async def get_status(self) -> dict[str, Any]:
        await self._prepare()
        return dict(await call(self._lb.get_status))

    async def clear_sticky_cache(self) -> dict[str, Any]:
        """Forget every sticky session; verl's report: ``{"cleared_entries": int,
        "server_loads": {server_id: in-flight}}`` (its fully-async rollouter reads both)."""
        return dict(await call(self._lb.clear_sticky_cache))

    async def close(self) -> None:
        await call(self._lb.close)


def _fresh_name() -> str:
    """A pool that starts empty (verl's hybrid-only mode registers replicas later) has no ids
    to derive a name from: it gets a name of its own, unique to this router."""
    return f"verl-{os.urandom(6).hex()}"


def _plain(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain dict of a router config (an OmegaConf node is resolved first)."""
    if config is None:
        return {}
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
    if not isinstance(config, Mapping):
        raise TypeError(f"router config must be a mapping, got {type(config).__name__}")
    return {str(k): v for k, v in config.items()}


def config_path() -> str:
    """The absolute path of the shipped ``verl.yaml`` in this installation."""
    return str(resolve_config_path(CONFIG_URL))
