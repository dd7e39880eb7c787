"""Least outstanding tokens: balance replicas by in-flight prompt tokens, not requests.

Algorithm (the Lua is ``least_tokens.lua``, built on the core's ``acquire_all``): a request
weighs ``len(prompt_ids)``. A new session goes to the replica whose live leases weigh least
in total, among replicas taking new sessions, ties broken uniformly at random with entropy from
this process. A later turn of a session goes to its sticky replica, as in the core, and adds
its weight there. A lease's weight leaves the replica's total when the lease ends, however it
ends (release, expiry, removal of the replica). One 30k-token prompt then counts as much as a
hundred 300-token ones, so a burst of long prompts no longer piles onto a replica that merely
has few requests.

Declares ``prompt_ids`` for acquire (the weight) and ``request_id`` for release (so the
release ends that request's lease and subtracts its weight, not another's). A request sent
without ``prompt_ids`` weighs 0: it is counted as a request but not as tokens.

Use: ``get_router_handle(servers, "plugins/least_tokens.yaml")``, or the class directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redis_router import scripts, validation
from redis_router.aio import AsyncLease, AsyncRedisLoadBalancer
from redis_router.balancer import Lease, RedisLoadBalancer
from redis_router.core import BalancerCore, Grant, Op

LUA = Path(__file__).with_name("least_tokens.lua")
# Weights travel as Lua numbers (doubles): integers are exact far beyond any prompt length.
MAX_WEIGHT = 2**40


def weight(prompt_ids: Any) -> int:
    """A request's weight: its prompt length in tokens (0 when no prompt was given)."""
    if prompt_ids is None:
        return 0
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise TypeError(
            f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}"
        )
    n = len(prompt_ids)
    if n > MAX_WEIGHT:
        raise ValueError(f"prompt_ids holds {n} tokens; at most {MAX_WEIGHT}")
    return n


def _acquire(
    core: BalancerCore,
    request_ids: list[str],
    prompts: Sequence[Any],
    tokens: list[str] | None = None,
) -> Op[list[Grant]]:
    """The core's acquire with this router's script; weights are checked before any write."""
    if len(prompts) != len(request_ids):
        raise ValueError(
            f"got {len(prompts)} prompt_ids for {len(request_ids)} request ids; give one each"
        )
    extras = [(weight(p),) for p in prompts]
    return core.acquire(request_ids, tokens, script=scripts.load_file(LUA), extras=extras)


class LeastTokensRouter(RedisLoadBalancer):
    """:class:`~redis_router.RedisLoadBalancer` that balances by in-flight prompt tokens.

    Shares the core's keys, so ``redis-router status`` and every core method work on it; do
    not mix it with a plain RedisLoadBalancer under the same name (that one would not weigh
    its requests).
    """

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    def acquire_server(
        self, request_id: str, prompt_ids: Any = None, **fields: Any
    ) -> tuple[str, Any]:
        """Route a request weighing ``len(prompt_ids)`` tokens. Returns (id, handle)."""
        g = self._run(_acquire(self._core, [_rid(request_id)], [prompt_ids]))[0]
        return g.server_id, g.handle

    def acquire_many(
        self, request_ids: list[str], prompt_ids: Sequence[Any] | None = None
    ) -> list[tuple[str, Any]]:
        """Route many requests in one round trip; ``prompt_ids`` holds one prompt each."""
        rids = _rids(request_ids)
        prompts = [None] * len(rids) if prompt_ids is None else list(prompt_ids)
        return [(g.server_id, g.handle) for g in self._run(_acquire(self._core, rids, prompts))]

    def acquire(
        self, request_id: str, *, token: str | None = None, prompt_ids: Any = None
    ) -> Lease:
        tokens = [_rid(token, "token")] if token is not None else None
        grant = self._run(_acquire(self._core, [_rid(request_id)], [prompt_ids], tokens))[0]
        return Lease(self, grant)


class AsyncLeastTokensRouter(AsyncRedisLoadBalancer):
    """The asyncio twin of :class:`LeastTokensRouter` (same script, keys and behaviour)."""

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    async def acquire_server(
        self, request_id: str, prompt_ids: Any = None, **fields: Any
    ) -> tuple[str, Any]:
        g = (await self._run(_acquire(self._core, [_rid(request_id)], [prompt_ids])))[0]
        return g.server_id, g.handle

    async def acquire_many(
        self, request_ids: list[str], prompt_ids: Sequence[Any] | None = None
    ) -> list[tuple[str, Any]]:
        rids = _rids(request_ids)
        prompts = [None] * len(rids) if prompt_ids is None else list(prompt_ids)
        grants = await self._run(_acquire(self._core, rids, prompts))
        return [(g.server_id, g.handle) for g in grants]

    async def acquire(
        self, request_id: str, *, token: str | None = None, prompt_ids: Any = None
    ) -> AsyncLease:
        tokens = [_rid(token, "token")] if token is not None else None
        grant = (await self._run(_acquire(self._core, [_rid(request_id)], [prompt_ids], tokens)))[0]
        return AsyncLease(self, grant)


_rid = validation.request_id
_rids = validation.request_ids
