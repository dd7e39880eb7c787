"""Model-based fuzzing of the router plugins: the machine of tests/fuzzing.py (several
processes, deaths, closes, stalls, dropped connections) with the least-tokens and the
prefix-cache policies, sync and coalesced asyncio.

least_tokens: a new session goes to a replica whose live leases weigh least in prompt tokens
(ties: the allowed set), and ``rr:{NAME}:weighted`` holds exactly the model's per-replica sums
of live leases' prompt lengths, whatever ended the leases. prefix_cache: modelled exactly, with
its index (prefix hash -> replicas it was sent to, compared with ``pc:idx``): a new session
goes to the least loaded of the replicas taking new sessions that hold the deepest counted
prefix of its prompt, unless the pool is imbalanced, else to the least loaded replica.
"""

from __future__ import annotations

import time

import pytest

from redis_router.local_server import LocalServer

from .fuzzing import BalancerMachine, fuzz_server, needs_server
from .test_fuzz import SHORT_OPERATIONS, run_machine
from .test_fuzz_async import AsyncMachine

OPERATIONS = 1_500

pytestmark = needs_server
__all__ = ["fuzz_server"]


class LeastTokensMachine(BalancerMachine):
    router = "least_tokens"
    name_prefix = "flt"


class PrefixCacheMachine(BalancerMachine):
    router = "prefix_cache"
    name_prefix = "fpc"


class AsyncLeastTokensMachine(AsyncMachine):
    router = "least_tokens"
    name_prefix = "falt"


class AsyncPrefixCacheMachine(AsyncMachine):
    router = "prefix_cache"
    name_prefix = "fapc"


@pytest.mark.parametrize(
    "machine",
    [LeastTokensMachine, PrefixCacheMachine, AsyncLeastTokensMachine, AsyncPrefixCacheMachine],
    ids=["least_tokens", "prefix_cache", "least_tokens-asyncio", "prefix_cache-asyncio"],
)
@pytest.mark.parametrize(
    "operations",
    [
        pytest.param(SHORT_OPERATIONS, id="short"),
        pytest.param(OPERATIONS, id="full", marks=pytest.mark.slow),
    ],
)
def test_plugin_routers_never_diverge_from_the_model(
    fuzz_server: LocalServer, machine: type[BalancerMachine], operations: int
) -> None:
    t0 = time.monotonic()
    short = operations < OPERATIONS
    stats = run_machine(machine, fuzz_server.url, operations, examples=2 if short else 10)
    took = time.monotonic() - t0
    print(f"\n{machine.router} fuzz on {fuzz_server.binary.label}: {stats.line()}, {took:.1f}s")
    assert stats.operations >= operations and (short or stats.reclaimed)
