"""Every state change is safe to resend: redis-py resends a command after a timeout, and the
first copy may already have run. A resent acquire returns the same lease; a resent release
reports the first copy's result and never ends a second lease."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from redis_router import RedisLoadBalancer, core
from redis_router.core import Call
from redis_router.scripts import load

from . import invariants
from .commandstats import script_calls

# Keeps the server busy inside one script: every other client waits, as behind a slow command.
BUSY = "local n = 0 for i = 1, tonumber(ARGV[1]) do n = n + i end return 1"
TIMEOUT = 0.3
# The stall is calibrated for STALL_TIMEOUTS client timeouts, and the client resends up to
# RETRIES times: a copy is resent even if this machine runs the stall several times faster
# than it ran the calibration, and the call still succeeds if several times slower.
STALL_TIMEOUTS = 5
RETRIES = 12


def _loop_count_for(r: redis.Redis, seconds: float) -> int:
    n = 2_000_000
    while True:
        t0 = time.perf_counter()
        r.eval(BUSY, 0, n)
        took = time.perf_counter() - t0
        if took > 0.05:
            return int(n * seconds / took)
        n *= 4


@pytest.fixture
def stall(r: redis.Redis) -> Iterator[Callable[[], threading.Thread]]:
    """Start a script that blocks the server for ~STALL_TIMEOUTS client timeouts, from
    another connection."""
    n = _loop_count_for(r, STALL_TIMEOUTS * TIMEOUT)
    blocker = redis.Redis(host="127.0.0.1", port=r.connection_pool.connection_kwargs["port"])
    threads: list[threading.Thread] = []

    def start() -> threading.Thread:
        t = threading.Thread(target=blocker.eval, args=(BUSY, 0, n))
        t.start()
        threads.append(t)
        time.sleep(0.05)  # the script is running: the next command waits behind it
        return t

    yield start
    for t in threads:
        t.join()
    blocker.close()


@pytest.fixture
def impatient(server: Any) -> Iterator[redis.Redis]:
    """A client that gives up on a reply after TIMEOUT and resends the command, as redis-py
    does with retries configured."""
    c = redis.Redis(
        host="127.0.0.1",
        port=server.port,
        socket_timeout=TIMEOUT,
        retry=Retry(NoBackoff(), RETRIES),
        decode_responses=True,
    )
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _close_balancers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every balancer a test made, so no keeper beats into later tests' servers."""
    made: list[RedisLoadBalancer] = []
    real = RedisLoadBalancer.__init__

    def tracked(self: RedisLoadBalancer, *a: Any, **kw: Any) -> None:
        real(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(RedisLoadBalancer, "__init__", tracked)
    yield
    for lb in made:
        lb.close()


def _lb(client: redis.Redis, name: str) -> RedisLoadBalancer:
    """A balancer whose scripts are loaded, so every EVALSHA counted later is a copy of the
    call under test (a first use would add a NOSCRIPT reply and a resend of its own)."""
    lb = RedisLoadBalancer({"s0": None}, redis=client, name=name)
    lb.acquire("warm").release()
    lb.release_server("s0", "warm")
    return lb


def _resent(
    r: redis.Redis, action: Callable[[], Any], stall: Callable[[], threading.Thread]
) -> Any:
    before = script_calls(r)
    stall().join(timeout=0)
    result = action()
    sent = script_calls(r) - before
    assert sent >= 2, f"the command was not resent ({sent} copies ran): the stall is too short"
    return result


def test_a_resent_release_without_request_id_ends_one_lease(impatient, r, stall):
    lb = _lb(impatient, "resend-replica")
    lb.acquire_server("a"), lb.acquire_server("b")
    assert _resent(r, lambda: lb.release_server("s0").result(), stall) is True
    assert lb.get_inflight_count("s0") == 1
    assert lb.release_server("s0") and not lb.release_server("s0")
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_resent_release_by_request_id_reports_true_and_ends_one_lease(impatient, r, stall):
    lb = _lb(impatient, "resend-request")
    lb.acquire_server("same"), lb.acquire_server("same")  # two leases of one request id
    assert _resent(r, lambda: lb.release_server("s0", "same").result(), stall) is True
    assert lb.get_inflight_count("s0") == 1
    assert lb.release_server("s0", "same")
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_resent_lease_release_reports_true(impatient, r, stall):
    lb = _lb(impatient, "resend-lease")
    lease, other = lb.acquire("x"), lb.acquire("y")
    assert _resent(r, lambda: lease.release().result(), stall) is True
    assert lb.get_inflight_count("s0") == 1 and other.release()
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_resent_acquire_takes_one_lease(impatient, r, stall):
    lb = _lb(impatient, "resend-acquire")
    lease = _resent(r, lambda: lb.acquire("x"), stall)
    assert lb.get_inflight_count("s0") == 1
    assert lease.release()
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_second_release_of_the_same_token_by_another_lease_object_is_false(make_lb, r):
    lb = make_lb({"s0": None})
    first = lb.acquire("req")
    again = lb.acquire("req", token=first.token)  # the same lease, held twice in this process
    assert first.release() and not again.release()
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_resent_release_by_request_id_from_another_process_ends_one_lease(impatient, r, stall):
    lb = _lb(impatient, "resend-request-other")
    lb.acquire_server("same"), lb.acquire_server("same")
    other = RedisLoadBalancer({"s0": None}, redis=impatient, name="resend-request-other")
    assert _resent(r, lambda: other.release_server("s0", "same").result(), stall) is True
    assert lb.get_inflight_count("s0") == 1
    assert other.release_server("s0", "same") and not other.release_server("s0", "same")
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_release_by_request_id_whose_own_lease_is_gone_ends_nothing(make_lb, r):
    a = make_lb({"s0": None})
    b = make_lb({"s0": None}, name=a.name)
    a.acquire_server("req")
    b.acquire_server("req")
    assert b.release_server("s0", "req")  # b names its own lease: a's stays
    assert a.release_server("s0", "req") and not b.release_server("s0", "req")
    a.acquire_server("req")
    b.acquire_server("req")
    assert b._run(b._core.release("s0", "req", a._core.latest[("s0", "req")]))  # a's, by token
    # a's own lease is gone: the request's other one is b's turn, not a's to end
    assert not a.release_server("s0", "req")
    assert b.get_inflight_count("s0") == 1 and b.release_server("s0", "req")
    assert invariants.check(r, a.name) == {"s0": 0}


def _rotations(lb: RedisLoadBalancer, r: redis.Redis) -> Callable[[], None]:
    """A heartbeat that finds the current generation of remembered releases a window old: the
    generation's start is back-dated, so each call rotates exactly once however slow the
    machine (the window itself, 60 s here, never passes during a test)."""

    def rotate() -> None:
        r.hset(lb._core.prefix + "clock", "remembered", 0)
        lb._run(lb._core.heartbeat())

    return rotate


def remembered(r: redis.Redis, key: str) -> set[str]:
    """The operation ids a generation of remembered releases holds: each field (an id's last
    three characters) holds the rest of each of its ids between separators; "@" marks a
    generation a heartbeat began."""
    ids = set()
    for field, packed in r.hgetall(key).items():
        if field == "@":
            continue
        assert packed.startswith(invariants.SEP) and packed.endswith(invariants.SEP), packed
        ids.update(rest + field for rest in packed[1:-1].split(invariants.SEP))
    return ids


def test_release_keys_are_remembered_a_window_and_forgotten_after_two(make_lb, r, monkeypatch):
    """A release's operation id is recognised across one rotation of the remembered keys
    (a resend within the window) and gone after the next: memory stays bounded, and an idle
    balancer keeps none (only its generations' marks, which expire)."""
    monkeypatch.setattr(core, "RESEND_WINDOW_MS", 60_000)
    lb = make_lb({"s0": None})
    done, old = lb._core.prefix + "remembered", lb._core.prefix + "remembered:old"
    rotate = _rotations(lb, r)

    def op(key: str) -> Iterator[Call]:  # the same release call each time, as a resend sends it
        return (yield Call(load("release"), ("s0", "a", "", key)))  # type: ignore[misc]

    def release_op_1() -> Any:
        return lb._run(op("op-1"))

    lb.acquire_server("a")
    assert release_op_1() != [0]
    assert remembered(r, done) == {"op-1"}
    lb._run(lb._core.heartbeat())  # within the window: nothing moves
    assert remembered(r, done) == {"op-1"} and release_op_1() == [1]
    rotate()  # op-1 is in the old generation, still recognised
    assert remembered(r, done) == set() and remembered(r, old) == {"op-1"}
    assert release_op_1() == [1]
    lb.acquire_server("a")
    assert lb._run(op("op-2")) != [0]
    rotate()  # op-1's generation is dropped, op-2's is now the old one
    assert remembered(r, done) == set() and remembered(r, old) == {"op-2"}
    assert release_op_1() == [0]
    rotate()  # nothing released since: both generations hold no id
    assert remembered(r, done) == set() and remembered(r, old) == set()
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_remembered_releases_expire_within_two_windows_of_the_last_process(make_lb, r):
    """Both generations of remembered releases expire by themselves: after releases and
    close() of the last process, each has an expiry that keeps its ids their window (30 s)
    and ends within two, whether a heartbeat began the generation or not."""
    window = core.RESEND_WINDOW_MS

    def releases(lb: RedisLoadBalancer, n: int) -> None:
        for sid, rid in [(lb.acquire_server(f"r{i}")[0], f"r{i}") for i in range(n)]:
            lb.release_server(sid, rid)

    # A process that closes before its first heartbeat (lease_ttl / 4 from its first acquire).
    lb = make_lb({"s0": None, "s1": None}, lease_ttl=3600)
    done = lb._core.prefix + "remembered"
    releases(lb, 200)
    assert r.pttl(done) == -1  # no heartbeat has begun (and timed) this generation
    lb.close()
    assert window < r.pttl(done) <= 2 * window
    # A generation a heartbeat began, and the one before it.
    lb = make_lb({"s0": None, "s1": None}, lease_ttl=3600)
    done, old = lb._core.prefix + "remembered", lb._core.prefix + "remembered:old"
    releases(lb, 100)
    _rotations(lb, r)()
    assert len(remembered(r, old)) == 100 and window - 10_000 < r.pttl(old) <= window
    releases(lb, 100)
    lb.close()
    assert len(remembered(r, done)) == 100 and window < r.pttl(done) <= 2 * window
    assert 0 < r.pttl(old) <= window
    assert invariants.check(r, lb.name) == {"s0": 0, "s1": 0}


def test_remembered_ids_that_share_a_field_are_each_recognised_and_no_other(make_lb, r):
    """Ids whose last three characters agree share one field: each is recognised, in a
    single release and in a batch, and an id made of another's parts, or a prefix or suffix of
    one, is not."""
    lb = make_lb({"s0": None})
    ids = ["AAAAAAAAAxyz", "BBBBBBBBBxyz", "+CCCCCCCCCxyz", "AAAAAxyz"]  # one field, "xyz"
    for rid, key in zip("abcd", ids, strict=True):
        lb.acquire_server(rid)
        one = ("s0", rid, "", key)
        assert lb._run(iter_call(one)) != [0]
    assert remembered(r, lb._core.prefix + "remembered") == set(ids)
    assert set(r.hkeys(lb._core.prefix + "remembered")) - {"@"} == {"xyz"}
    more = ["Pxyz1", "Qxyz1", "Rxy", "S"]  # two share field "yz1"; ids of 3 and 1 characters
    batch = [("s0", rid, "", key) for rid, key in zip("efgh", more, strict=True)]
    for _, rid, _, _ in batch:
        lb.acquire_server(rid)
    assert 0 not in lb._run(iter_call(*batch))
    assert remembered(r, lb._core.prefix + "remembered") == {*ids, *more}
    for key in [*ids, *more]:  # a resend: recognised, nothing ends
        assert lb._run(iter_call(("s0", "z", "", key))) == [1]
    for key in ("AAAAxyz", "AAAAAAAAAAxyz", "BBBBBBBBB", "xyz", "CCCCCCCCCxyz", "yz1"):
        assert lb._run(iter_call(("s0", "z", "", key))) == [0], key
    assert invariants.check(r, lb.name) == {"s0": 0}


def iter_call(*quads: tuple[str, str, str, str]) -> Iterator[Call]:
    """One release call of the given quads (replica, request id, token, operation id)."""
    return (yield Call(load("release"), tuple(x for q in quads for x in q)))  # type: ignore[misc]


def test_release_sets_of_earlier_clients_are_dropped_once_none_rotates_them(
    make_lb, r, monkeypatch
):
    """Clients before the packed hashes remembered release ids in sets ("released",
    "released:old", their start in the clock's "released") and rotate those themselves. While
    such a client rotates them they are kept; once none has for two windows, a heartbeat of
    this version drops them."""
    monkeypatch.setattr(core, "RESEND_WINDOW_MS", 60_000)
    lb = make_lb({"s0": None})
    clock, sets = (
        lb._core.prefix + "clock",
        [lb._core.prefix + k for k in ("released", "released:old")],
    )
    rotate = _rotations(lb, r)
    now_ms = int(r.time()[0]) * 1000
    r.sadd(sets[0], "e-1")
    r.sadd(sets[1], "e-0")
    r.hset(clock, "released", now_ms - 61_000)  # an earlier client rotated them a window ago
    rotate()
    assert r.exists(*sets) == 2 and r.hexists(clock, "released")
    r.hset(clock, "released", now_ms - 121_000)  # and none has for two windows
    rotate()
    assert r.exists(*sets) == 0 and not r.hexists(clock, "released")
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_release_keys_of_earlier_clients_are_dropped_a_generation_after_their_last_use(
    make_lb, r, monkeypatch
):
    """Clients before the sets remembered release ids in hashes ("ended", "ended:old", their
    start in "@since") and rotate those themselves. Heartbeats of this version rotate them
    the same way, so an earlier client's resend is recognised for as long as before, and
    drop them once nobody writes them: they never outlive an upgrade."""
    monkeypatch.setattr(core, "RESEND_WINDOW_MS", 60_000)
    lb = make_lb({"s0": None})
    ended, old = lb._core.prefix + "ended", lb._core.prefix + "ended:old"
    rotate = _rotations(lb, r)
    r.hset(ended, "e-1", "1")  # an earlier client's release, its generation not yet timed
    r.hset(old, "e-0", "1")
    rotate()  # "ended" gets its start, as an earlier client's heartbeat would give it
    assert r.hget(ended, "@since") and r.hexists(old, "e-0")
    rotate()  # within its window: nothing moves
    assert r.hexists(ended, "e-1") and r.hexists(old, "e-0")
    r.hset(ended, "@since", 0)
    rotate()  # its window is up: it becomes the old generation, the one before is dropped
    assert not r.exists(ended) and r.hexists(old, "e-1") and not r.hexists(old, "e-0")
    rotate()  # nobody wrote "ended" since: the old generation is marked idle
    assert r.hexists(old, "e-1") and r.hget(old, "@idle")
    rotate()  # within its window: kept
    assert r.hexists(old, "e-1")
    r.hset(old, "@idle", 0)
    rotate()  # and dropped a window after it was first seen alone
    assert not r.exists(ended, old)
    assert invariants.check(r, lb.name) == {"s0": 0}


def test_a_hint_whose_token_was_granted_again_for_another_request_ends_nothing_of_it(make_lb, r):
    a = make_lb({"s0": None})
    b = make_lb({"s0": None}, name=a.name)
    token = a.acquire("req").token
    assert b.release_server("s0", "req")  # ends a's lease: a still names it for "req"
    assert a.acquire("other", token=token).request_id == "other"  # the token, granted anew
    b.acquire_server("req")
    assert not a.release_server("s0", "req")  # the hint is another request's lease now
    assert a.get_inflight_count("s0") == 2
    assert a.release_server("s0", "other") and b.release_server("s0", "req")
    assert invariants.check(r, a.name) == {"s0": 0}
