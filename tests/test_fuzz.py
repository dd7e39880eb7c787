"""Model-based fuzzing: random operation sequences of several processes sharing one balancer,
against a real server and tests/model.py (the machine is tests/fuzzing.py).

Processes acquire, release (also as failed requests, which eject replicas), renew, change the
pool (also declaring capacities) and clear sticky sessions; they live long past lease_ttl
(their leases stay), die (their leases come back exactly once, counted), close, lose their
network past lease_ttl and release late (ending nothing of the others'), and meet stalls past
the client's timeout (resent commands) and dropped connections. Every reply, the counts, the
reclaimed counters and the raw keys are checked against the model.
Runs on the first server binary only, in about a minute.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from redis_router import RedisLoadBalancer
from redis_router.local_server import LocalServer

from .fuzzing import BalancerMachine, Stats, fuzz_server, needs_server

MIN_OPERATIONS = 10_000
SHORT_OPERATIONS = 200

pytestmark = needs_server
__all__ = ["fuzz_server"]


class CoreMachine(BalancerMachine):
    router = "core"
    name_prefix = "fz"


def run_machine(
    machine: type[BalancerMachine], url: str, operations: int, *, examples: int = 10
) -> Stats:
    """Run sequences of ``machine`` (``examples`` per round) until ``operations`` balancer
    calls were made."""
    machine.url, machine.stats = url, Stats()
    options = settings(
        max_examples=examples,
        stateful_step_count=150,
        deadline=None,
        database=None,
        phases=(Phase.generate,),  # no shrinking: sequences depend on timing
        suppress_health_check=list(HealthCheck),
    )
    while machine.stats.operations < operations:
        run_state_machine_as_test(machine, settings=options)
    return machine.stats


# The quick tier runs a short fuzz (a few sequences); the exhaustive tier the full one, long
# enough that every kind of fault has happened.
LENGTHS = [
    pytest.param((SHORT_OPERATIONS, 2), id="short"),
    pytest.param((MIN_OPERATIONS, 10), id="full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("length", LENGTHS)
def test_processes_sharing_a_balancer_never_diverge_from_the_model(
    fuzz_server: LocalServer, length: tuple[int, int]
) -> None:
    operations, examples = length
    t0 = time.monotonic()
    stats = run_machine(CoreMachine, fuzz_server.url, operations, examples=examples)
    print(f"\nfuzz on {fuzz_server.binary.label}: {stats.line()}, {time.monotonic() - t0:.1f}s")
    assert stats.operations >= operations
    if operations >= MIN_OPERATIONS:
        assert stats.deaths and stats.closes and stats.reclaimed and stats.pauses
        assert stats.partitions and stats.late
        assert stats.resent and stats.drops and stats.kills
        assert stats.ejections and stats.capped and stats.full


# -- ids -------------------------------------------------------------------------------------

ODD = st.one_of(
    st.text(max_size=20),
    st.text(alphabet="{}*:?[]\\ \x00\x1f\x7f\n\t", max_size=8),
    st.text(min_size=100, max_size=600),
    st.sampled_from(["", "{", "}", "{}", "*", ":", "\ud800", "a" * 512, "é" * 257, "\x00"]),
)


def _dump(r: redis.Redis) -> dict[bytes, Any]:
    return {k: (r.dump(k), r.pttl(k) > 0) for k in r.scan_iter(count=1000)}


@pytest.mark.slow
def test_every_id_is_routed_or_refused_without_writing(fuzz_server: LocalServer) -> None:
    r = redis.Redis.from_url(fuzz_server.url)
    # The keeper beats every lease_ttl / 4 from its own thread: a beat between the two dumps
    # would be a write no refused id made, so it beats once an hour here.
    lb = RedisLoadBalancer({"a": None}, redis=fuzz_server.url, name="ids", lease_ttl=3600)
    outcomes = {"routed": 0, "refused": 0}

    @settings(max_examples=300, deadline=None, database=None)
    @given(value=ODD, kind=st.sampled_from(["request", "server", "token"]))
    def check(value: str, kind: str) -> None:
        assume(kind != "server" or value != "a")  # removing it would empty the pool
        before = _dump(r)
        try:
            if kind == "request":
                result = lb.acquire_server(value)
                assert result[0] == "a"
            elif kind == "server":
                lb.add_servers({value: None})
                assert value in lb.get_all_servers()
                lb.remove_servers([value])
            else:
                assert lb.acquire("req", token=value).server_id == "a"
        except (ValueError, TypeError) as exc:
            assert str(exc)
            assert _dump(r) == before, f"a refused {kind} id {value!r} wrote to Redis"
            outcomes["refused"] += 1
            return
        outcomes["routed"] += 1

    check()
    lb.destroy()
    lb.close()
    r.close()
    print(f"\nids: {outcomes}")
    assert outcomes["routed"] and outcomes["refused"]
