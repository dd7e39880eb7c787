"""Least outstanding tokens: balance replicas by in-flight prompt tokens, not requests.

Algorithm (the Lua is ``least_tokens.lua``, built on the shared ``acquire_all``): a request
weighs ``len(prompt_ids)``. A new session goes to the replica whose live leases weigh least
in total, among replicas taking new sessions, ties broken uniformly at random with entropy from
this process. A later turn of a session goes to its sticky replica, as in the core, and adds
its weight there. A lease's weight leaves the replica's total when the lease ends, however it
ends (release, reclaim after its process died, removal of the replica). One 30k-token prompt
then counts as much as a hundred 300-token ones, so a burst of long prompts no longer piles
onto a replica that merely has few requests.

Declares ``prompt_ids`` for acquire (the weight) and ``request_id`` for release (so the
release ends that request's lease and subtracts its weight, not another's). A request sent
without ``prompt_ids`` weighs 0: it is counted as a request but not as tokens.

Use: ``get_router_handle(servers, "plugins/least_tokens.yaml")``, ``policy="least_tokens"`` on
any balancer, or the classes below.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from redis_router.aio import AsyncRedisLoadBalancer
from redis_router.balancer import RedisLoadBalancer
from redis_router.policy import RoutingPolicy

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
    try:
        n = len(prompt_ids)
    except (TypeError, OverflowError):  # a __len__ that is no int, or beyond sys.maxsize
        raise TypeError(
            f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__} "
            "whose length is not a valid int"
        ) from None
    if n > MAX_WEIGHT:
        raise ValueError(f"prompt_ids holds {n} tokens; at most {MAX_WEIGHT}")
    return n


class LeastTokens(RoutingPolicy):
    """New sessions go to the replica whose live leases weigh least in prompt tokens."""

    name = "least_tokens"
    script_path = Path(__file__).with_name("least_tokens.lua")
    acquire_fields = ("prompt_ids",)
    release_fields = ("request_id",)
    arity = 1

    def request_args(self, fields: Mapping[str, Any]) -> tuple[str, ...]:
        return (str(weight(fields.get("prompt_ids"))),)


class LeastTokensRouter(RedisLoadBalancer):
    """:class:`~redis_router.RedisLoadBalancer` with the :class:`LeastTokens` policy.

    Shares the core's keys, so ``redis-router status`` and every core method work on it; do
    not mix it with another policy under the same name (that one would not weigh its
    requests)."""

    default_policy = LeastTokens


class AsyncLeastTokensRouter(AsyncRedisLoadBalancer):
    """The asyncio twin of :class:`LeastTokensRouter` (same script, keys and behaviour)."""

    default_policy = LeastTokens
