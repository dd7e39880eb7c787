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

Remaining work (``remaining_work=True``, off by default): a lease weighs what is left of its
request's work, ``round(prefill_weight * len(prompt_ids)) + expected_output_tokens``, the second
an acquire field this option declares (a non-negative int; absent: 0), and a caller reports
progress with ``lease.renew(remaining=policy.weigh(prompt_ids, output_left))``, which sets the
lease's weight (its record, the replica's total) to that value in one script. The prompt part
stays for the lease's life (its context holds KV memory until the request ends); the output
part counts down. ``prefill_weight`` (default 1.0, any number from 0 to 1000) values a prompt
token against an output token: 1.0 weighs contexts as the plain policy does, a small value
(an engine's prefill cost per token over its decode cost per token) weighs the work to do.
Off, weights and script arguments are the plain policy's. Every process sharing a balancer
should use the same options: mixed weights keep every invariant (each lease carries its own
weight) but rank replicas by mixed units.

Use: ``get_router_handle(servers, "plugins/least_tokens.yaml")``, ``policy="least_tokens"`` on
any balancer, or the classes below.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from redis_router import validation
from redis_router.aio import AsyncRedisLoadBalancer
from redis_router.balancer import RedisLoadBalancer
from redis_router.policy import RoutingPolicy

# Weights travel as Lua numbers (doubles): integers are exact far beyond any prompt length.
MAX_WEIGHT = validation.MAX_WEIGHT
# The acquire field remaining_work declares: the output tokens a request is expected to make.
OUTPUT_FIELD = "expected_output_tokens"
MAX_PREFILL_WEIGHT = 1000.0


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
    acquire_fields: tuple[str, ...] = ("prompt_ids",)
    release_fields = ("request_id",)
    arity = 1

    def __init__(self, *, remaining_work: bool = False, prefill_weight: float = 1.0) -> None:
        self.remaining_work = validation.flag(remaining_work, "remaining_work")
        if isinstance(prefill_weight, bool) or not isinstance(prefill_weight, (int, float)):
            raise TypeError(
                f"prefill_weight must be a number from 0 to {MAX_PREFILL_WEIGHT:g} (weight of "
                f"a prompt token against an output token), got {type(prefill_weight).__name__}"
            )
        if not 0 <= prefill_weight <= MAX_PREFILL_WEIGHT:  # NaN fails both
            raise ValueError(
                f"prefill_weight must be a number from 0 to {MAX_PREFILL_WEIGHT:g} (weight of "
                f"a prompt token against an output token), got {prefill_weight!r}"
            )
        if prefill_weight != 1.0 and not self.remaining_work:
            raise ValueError("prefill_weight applies only with remaining_work=True")
        self.prefill_weight = float(prefill_weight)
        if self.remaining_work:
            self.acquire_fields = ("prompt_ids", OUTPUT_FIELD)

    def request_args(self, fields: Mapping[str, Any]) -> tuple[str, ...]:
        if not self.remaining_work:
            return (str(weight(fields.get("prompt_ids"))),)
        out = fields.get(OUTPUT_FIELD)
        return (str(self.weigh(fields.get("prompt_ids"), 0 if out is None else out, OUTPUT_FIELD)),)

    def weigh(self, prompt_ids: Any, output_tokens: int, arg: str = "output_tokens") -> int:
        """The weight of a request with this prompt and ``output_tokens`` output tokens still
        to make: ``round(prefill_weight * len(prompt_ids)) + output_tokens``. What to pass as
        a lease's ``remaining`` when renewing it (``output_tokens``: the expected output less
        what the request has made so far, never below 0)."""
        n = validation.weight(output_tokens, arg)
        p = weight(prompt_ids)
        total = (p if self.prefill_weight == 1.0 else round(self.prefill_weight * p)) + n
        if total > MAX_WEIGHT:
            raise ValueError(
                f"{arg} ({n}) with the prompt's weight makes {total}; at most {MAX_WEIGHT}"
            )
        return total

    def options(self) -> dict[str, Any]:
        if not self.remaining_work:
            return {}
        return {"remaining_work": True, "prefill_weight": self.prefill_weight}


class LeastTokensRouter(RedisLoadBalancer):
    """:class:`~redis_router.RedisLoadBalancer` with the :class:`LeastTokens` policy.

    Shares the core's keys, so ``redis-router status`` and every core method work on it; do
    not mix it with another policy under the same name (that one would not weigh its
    requests)."""

    default_policy = LeastTokens


class AsyncLeastTokensRouter(AsyncRedisLoadBalancer):
    """The asyncio twin of :class:`LeastTokensRouter` (same script, keys and behaviour)."""

    default_policy = LeastTokens
