"""The model-based fuzzing machine shared by tests/test_fuzz*.py.

A Hypothesis state machine drives several balancer instances on one balancer name, one per
simulated process (each a holder with its own keeper), against a real server, and checks
every reply, the counts and the raw keys against tests/model.py. Processes acquire (one,
many, retried with a granted token, a token twice in one batch), release (by lease, by
request, by replica only), renew, change the pool, clear sticky sessions, run long past
lease_ttl (their leases must stay), die (``invariants.silence``: their leases must come back
exactly once, counted in ``reclaimed``, through reap, a heartbeat or the other processes'
keepers, while acquires route on counts that may or may not still hold them), close (their
leases are reclaimable at once), lose their network past lease_ttl and release late (their
leases reclaimed and their requests' next turns taken by others: the late releases end
nothing of those) and meet faults: a server stalled past the client's timeout
(commands resent), connections dropped between calls and killed while a command waits.

Timing: a dead holder's deadline is read from Redis when it dies, so the machine knows to
a few ms when its leases become reclaimable; before that they must stay, and a step that could
run past it first waits for it and has the leases reclaimed (the model then knows exactly what
is left). Live holders' leases never expire, so nothing else waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from redis.backoff import NoBackoff
from redis.retry import Retry

from redis_router import AsyncRedisLoadBalancer, NoCapacity, NoServersAvailable, RedisLoadBalancer
from redis_router.core import Call, new_token
from redis_router.local_server import LocalServer, first_server_binary
from redis_router.outbox import Released
from redis_router.plugins.least_tokens import AsyncLeastTokensRouter, LeastTokensRouter
from redis_router.plugins.prefix_cache import (
    AsyncPrefixCacheRouter,
    PrefixCacheRouter,
    chain_hashes,
)
from redis_router.scripts import load

from . import invariants
from .model import EJECT_AFTER, MAX_EJECTED, Model, NoServers, PrefixPolicy, Prompt

# Long enough that a stall slowed down 4x by a loaded 2-core machine stays inside a live
# holder's slack (Stall.join), short enough that dead holders are reclaimed within a step.
LEASE_TTL = 0.8
MARGIN = 0.02  # slack (s) around a dead holder's deadline: the ms clock and the round trip
STEP = 0.3  # a step that could end past a dead holder's deadline waits for it first
PROCESSES = 3
KEEPERS_WAIT = LEASE_TTL + 2.0  # the most a reclaim waits for the live keepers to act
SERVERS = ["s0", "s1", "s2", "{s3}", "ü:4"]
REQUESTS = ["r0", "r1", "r2", "r3", "{r4}", "*:r5", "ß6", "r7"]

# Faults: a client that gives up on a reply after TIMEOUT and resends (as redis-py does with
# retries configured), and a script that keeps the server busy meanwhile. A stall stays well
# under lease_ttl * 3/4, the slack of a live holder whose heartbeats wait behind it.
TIMEOUT = 0.05
STALL = 2 * TIMEOUT
STALL_EVERY = 200  # operations per stall, at most (each costs STALL)
PAUSE = 1.2 * LEASE_TTL  # processes live this long without a call, their keepers beating
PAUSE_EVERY = 400  # operations per pause, at most
PARTITION_EVERY = 400  # operations per partitioned process (each waits out its lease_ttl)
# The server itself stops (SIGSTOP) for longer than lease_ttl, then goes on: live holders are
# on probation, not dead (lib/base.lua liveness()), and keep every lease.
SERVER_PAUSE = 1.5 * LEASE_TTL
SERVER_PAUSE_EVERY = 400
# How often the listener (below) is heard: well under half the lease ttl, the gap that makes
# Redis assume it was paused.
LISTEN_EVERY = LEASE_TTL / 16
BUSY = "local n = 0 for i = 1, tonumber(ARGV[1]) do n = n + i end return 1"

# prefix_cache: blocks of 4 tokens; prompts that share 2, 1 or no leading blocks with A.
BLOCK = 4
MIN_MATCH = 0.5
PREFIX = PrefixPolicy(balance_abs=1, balance_rel=1.5)
_A = list(range(100, 116))
PROMPTS: list[list[int] | None] = [
    None,
    _A,  # 4 blocks
    _A[:8] + list(range(200, 208)),  # shares 2 of 4 blocks with A: counts (min_match 0.5)
    _A[:4] + list(range(300, 312)),  # shares 1 of 4: too short a match to count
    list(range(400, 412)),  # 3 blocks of its own
    _A[:12],  # A's first 3 blocks
    [7, 8, 9],  # shorter than a block
]

BINARY = first_server_binary()
needs_server = pytest.mark.skipif(BINARY is None, reason="no server binary found")


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[LocalServer]:
    """Persistent (AOF, written through on shutdown), so that a restart keeps every key."""
    assert BINARY is not None
    with LocalServer(BINARY, persistent=True, args=("--appendfsync", "everysec")) as s:
        BalancerMachine.server = s
        yield s
        BalancerMachine.server = None


@dataclass
class Stats:
    operations: int = 0  # balancer calls made by rules
    sequences: int = 0
    deaths: int = 0  # processes whose heartbeats stopped
    closes: int = 0
    partitions: int = 0  # processes whose heartbeats stopped while they lived, then released
    late: int = 0  # ... their releases after their leases were reclaimed
    reclaims: int = 0  # reclaims of dead holders' leases, and leases reclaimed
    reclaimed: int = 0
    probations: int = 0  # reclaims that waited out a probation (the machine stalled)
    pauses: int = 0  # waits past lease_ttl with leases held
    server_pauses: int = 0  # the server stopped (SIGSTOP) past lease_ttl
    restarts: int = 0  # the server restarted (persistent) after being down past lease_ttl
    stalls: int = 0  # calls made while the server was stalled past the client's timeout
    resent: int = 0  # ... that timed out and were sent again
    drops: int = 0  # connections closed between calls
    kills: int = 0  # connections killed while a command waited behind a stall
    batches: int = 0  # coalesced gathers (asyncio machine)
    ejections: int = 0  # replicas ejected by failed requests
    full: int = 0  # acquires refused with NoCapacity
    capped: int = 0  # grants made while some replica declared a capacity
    overruns: int = 0  # runs not judged: a call outlasted a dead holder's deadline ...
    slow_stalls: int = 0  # ... or a stall a live holder's slack

    def line(self) -> str:
        return (
            f"{self.operations} operations in {self.sequences} sequences; "
            f"{self.deaths} deaths, {self.closes} closes, {self.partitions} partitions "
            f"({self.late} late releases), {self.reclaimed} leases reclaimed in "
            f"{self.reclaims} reclaims ({self.probations} after a probation), {self.pauses} "
            f"pauses past lease_ttl, "
            f"{self.server_pauses} server pauses and {self.restarts} restarts past lease_ttl, "
            f"{self.stalls} "
            f"calls under a stall past the client timeout ({self.resent} resent), "
            f"{self.kills} connections killed while their command waited, {self.drops} "
            f"dropped between calls, {self.batches} coalesced gathers; {self.ejections} "
            f"ejections, {self.capped} grants under capacities, {self.full} refused full; "
            f"runs not judged: {self.overruns} (a call outlasted a dead holder's deadline), "
            f"{self.slow_stalls} (a stall outlasted a live holder's slack)"
        )


# -- processes -----------------------------------------------------------------------------


class LoopThread:
    """An event loop running in a thread, so an asyncio balancer's keeper beats between steps."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Process:
    """One simulated process: a balancer instance (a holder) driven synchronously."""

    impatient = False

    def __init__(self, lb: Any) -> None:
        self.lb = lb
        self.holder: str = lb._core.holder
        self.lo = self.hi = float("inf")  # once dead: when its leases become reclaimable

    def run(self, op: Any) -> Any:
        return self.lb._run(op)

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.lb, method)(*args)
        # A release's outcome is read when asked for: the model checks it, and the keys.
        return result.result() if isinstance(result, Released) else result

    def beating(self) -> bool:
        return self.lb._keeper is not None

    def partition(self) -> None:
        """The process's network fails: its heartbeats stop; it lives, and so do its
        connections (the network heals before it calls again)."""
        if self.lb._keeper is not None:
            invariants.silence(self.lb)

    def silence(self) -> None:
        self.partition()
        self.lb._client.close()  # the process is gone; its holder is not retired

    def close(self) -> None:
        self.lb.close()

    def drop_connections(self) -> None:
        self.lb._client.connection_pool.disconnect()


class AsyncProcess(Process):
    """An AsyncRedisLoadBalancer (coalescing) whose coroutines run on a LoopThread."""

    def __init__(self, lb: Any, loop: LoopThread) -> None:
        super().__init__(lb)
        self.loop = loop

    def run(self, op: Any) -> Any:
        return self.loop.run(self.lb._run(op))

    def call(self, method: str, *args: Any) -> Any:
        return self.loop.run(_awaited(getattr(self.lb, method), *args))

    def beating(self) -> bool:
        return self.lb._keeper is not None and not self.lb._keeper.done()

    def partition(self) -> None:
        async def stop() -> None:
            # Detached first, as close() does: the keeper checks that it is still wanted, since
            # a cancel can be lost (before Python 3.12) and awaiting it would then hang.
            keeper, self.lb._keeper = self.lb._keeper, None
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper

        self.loop.run(stop())

    def silence(self) -> None:
        self.partition()
        self.loop.run(self.lb._client.aclose())

    def close(self) -> None:
        try:
            self.loop.run(asyncio.wait_for(self.lb.close(), 10))
        except TimeoutError:
            stacks = io.StringIO()
            for task in asyncio.all_tasks(self.loop.loop):
                task.print_stack(file=stacks)
            raise AssertionError(f"close() took over 10 s; tasks:\n{stacks.getvalue()}") from None

    def drop_connections(self) -> None:
        self.loop.run(self.lb._client.connection_pool.disconnect())


class ImpatientProcess(Process):
    """A process whose one connection gives up on a reply after TIMEOUT and resends."""

    impatient = True


class Listener:
    """Heartbeats of a holder that owns nothing and reaps nothing, from a thread: Redis
    hears the living at all times, as in a deployment whose workers' keepers beat. Without
    it, a stretch in which no simulated process beats would look to Redis like a pause of
    its own, and a dead holder's leases would wait out a probation the model does not
    predict (tests/test_redis_faults.py covers that case)."""

    def __init__(self, lb: Any) -> None:
        c = lb._core
        self._lb, self.holder = lb, c.holder
        self._args = c.heartbeat_args(budget=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        script = load("heartbeat")
        while not self._stop.wait(LISTEN_EVERY):
            with contextlib.suppress(Exception):  # a pause of the server, a dropped link
                self._lb._exec(Call(script, self._args))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._lb.close()


class Stall:
    """A script keeping the server busy, run from another connection's thread; ``took`` is how
    long it kept the server."""

    def __init__(self, blocker: redis.Redis, loops: int) -> None:
        self.took, self.loops = 0.0, loops
        self._thread = threading.Thread(target=self._run, args=(blocker, loops))
        self._thread.start()
        time.sleep(0.02)  # the script is running: the next command waits behind it

    def _run(self, blocker: redis.Redis, loops: int) -> None:
        t0 = time.monotonic()
        blocker.eval(BUSY, 0, loops)
        self.took = time.monotonic() - t0

    def join(self) -> None:
        self._thread.join()


def _loop_count_for(r: redis.Redis, seconds: float) -> int:
    """Iterations of BUSY that keep this server busy for about ``seconds``."""
    n = 2_000_000
    while True:
        t0 = time.perf_counter()
        r.eval(BUSY, 0, n)
        took = time.perf_counter() - t0
        if took > 0.05:
            return int(n * seconds / took)
        n *= 4


# -- the machine ---------------------------------------------------------------------------


def _pick(items: list[str], index: int) -> str | None:
    return items[index % len(items)] if items else None


class BalancerMachine(RuleBasedStateMachine):
    url = ""
    server: LocalServer | None = None  # the fuzz server, which the restart rule restarts
    router = "core"  # "core" | "least_tokens" | "prefix_cache"
    name_prefix = "fz"
    stats = Stats()
    stall_loops = 0  # BUSY iterations for one STALL, measured once per server

    def __init__(self) -> None:
        super().__init__()
        self.stats.sequences += 1
        self.name = f"{self.name_prefix}{self.stats.sequences}"
        self.p = invariants.prefix(self.name)
        self.r = redis.Redis.from_url(self.url, decode_responses=True)
        self.model = Model(self.router, PREFIX if self.router == "prefix_cache" else None)
        self.procs: list[Process] = [self.spawn(slot) for slot in range(PROCESSES)]
        self.dying: list[Process] = []  # silenced; their leases go after their deadline
        self.gone: list[str] = []  # tokens that were leases once, to use again
        self.steps = 0
        self._blocker: redis.Redis | None = None
        self.listener = Listener(self.new_balancer(self.url))
        if not BalancerMachine.stall_loops:
            BalancerMachine.stall_loops = _loop_count_for(self.r, STALL)

    # -- processes -------------------------------------------------------------------------

    def new_balancer(self, redis_: Any, *, asyncio: bool = False) -> Any:
        """A balancer of this machine's router (``asyncio``: its asyncio twin, coalescing)."""
        kw: dict[str, Any] = {
            "redis": redis_,
            "name": self.name,
            "lease_ttl": LEASE_TTL,
            # Failed releases eject; an ejection outlasts the run (only removal ends it).
            "eject_after": EJECT_AFTER,
            "eject_for": 3600.0,
            "eject_max": 3600.0,
            "max_ejected": MAX_EJECTED,
            # The plugins' machines keep pinned-session counts (I13) through every fault; the
            # core's runs the default path.
            "spread_sessions": self.router != "core",
        }
        if self.router == "least_tokens":
            return (AsyncLeastTokensRouter if asyncio else LeastTokensRouter)(**kw)
        if self.router == "prefix_cache":
            return (AsyncPrefixCacheRouter if asyncio else PrefixCacheRouter)(
                block_size=BLOCK,
                balance_abs_threshold=PREFIX.balance_abs,
                balance_rel_threshold=PREFIX.balance_rel,
                min_match=MIN_MATCH,
                **kw,
            )
        return (AsyncRedisLoadBalancer if asyncio else RedisLoadBalancer)(**kw)

    def spawn(self, slot: int) -> Process:
        """A new process for ``slot``: the last slot is the impatient one."""
        if slot == PROCESSES - 1:
            port = self.r.connection_pool.connection_kwargs["port"]
            client = redis.Redis(
                host="127.0.0.1",
                port=port,
                socket_timeout=TIMEOUT,
                retry=Retry(NoBackoff(), 10),
                decode_responses=True,
                single_connection_client=True,
            )
            return ImpatientProcess(self.new_balancer(client))
        return Process(self.new_balancer(self.url))

    def proc(self, who: int, *, patient: bool = False) -> Process:
        """A live process; ``patient``: not the impatient one (for calls whose reply is not
        resend-safe, such as a pool change's count)."""
        procs = [p for p in self.procs if not (patient and p.impatient)]
        return procs[who % len(procs)]

    def teardown(self) -> None:
        self.listener.close()
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.close()
                if p.impatient:
                    p.lb._client.close()
        for p in self.dying:
            with contextlib.suppress(Exception):
                p.close()
        cleaner = self.new_balancer(self.url)
        cleaner.destroy()
        cleaner.close()
        self.r.close()
        if self._blocker is not None:
            self._blocker.close()

    # -- time ------------------------------------------------------------------------------

    def _deadline(self) -> float:
        """Monotonic time before which no dead holder's lease can be reclaimed."""
        return min((p.lo for p in self.dying), default=float("inf"))

    def _ready(self, step: float = STEP) -> None:
        """Start of every rule: a dead holder whose leases could become reclaimable during
        the step is waited for, and its leases are reclaimed (checked) first."""
        now = time.monotonic()
        due = [p for p in self.dying if p.lo < now + step]
        if not due:
            return
        # Those that come due while waiting for these, or while they are reclaimed (a
        # reclaim waits up to a heartbeat period for the keepers), go with them.
        while True:
            until = max(p.hi for p in due)
            more = [p for p in self.dying if p not in due and p.lo < until + step + LEASE_TTL]
            if not more:
                break
            due += more
        time.sleep(max(0.0, until - now))
        for p in due:
            self.dying.remove(p)
        self._reclaim(due)

    def _due(self, what: str, every: int) -> bool:
        """Rules that wait (a pause, a stall) run about once per ``every`` operations, so the
        run time stays bounded however often Hypothesis picks them."""
        return getattr(self.stats, what) * every <= self.stats.operations

    @contextlib.contextmanager
    def _judging(self) -> Iterator[None]:
        """Calls and reads the model judges: no dead holder's lease may have become
        reclaimable by their end (else the model could not say what they saw)."""
        try:
            yield
        finally:
            if time.monotonic() >= self._deadline():
                # They ran past a dead holder's deadline (a loaded machine stalled them): a
                # keeper may have reclaimed that holder's leases meanwhile, and the model
                # cannot say what they saw, passed or failed. Such a run is not judged;
                # Hypothesis draws another (and fails the test as Unsatisfiable if too few
                # can be judged).
                self.stats.overruns += 1
                reject()

    def _call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
        """Run one balancer call (judged: see _judging)."""
        self.stats.operations += 1
        with self._judging():
            t0 = time.monotonic()
            out = fn(*args)
            t1 = time.monotonic()
        return out, t0, t1

    # -- dead holders ----------------------------------------------------------------------

    def _die(self, proc: Process, *, closing: bool) -> None:
        """The process dies (or closes): the model learns when its leases become reclaimable."""
        if closing:
            # Holders already dying that could come due while this one's leases go are
            # reclaimed first (while it still lives), so no deadline passes during the reclaim.
            self._ready(STEP + LEASE_TTL)
        self.procs.remove(proc)
        self.procs.append(self.spawn(PROCESSES - 1 if proc.impatient else 0))
        if closing:
            tokens = self.model.tokens_of(proc.holder)
            proc.close()
            self.stats.closes += 1
            # close() ends the leases itself, as releases (not counted as reclaimed), and
            # its holder leaves.
            assert self._still_leases(tokens) == [], "close() left leases counted"
            for token in tokens:
                self.model.release_token(token, None)
            self.gone += tokens
            assert self.r.zscore(self.p + "holders", proc.holder) is None
            return
        proc.silence()
        self.stats.deaths += 1
        t0 = time.monotonic()
        deadline, now = self.r.zscore(self.p + "holders", proc.holder), self._redis_ms()
        t1 = time.monotonic()
        if deadline is None:  # never acquired: not a holder, nothing to reclaim
            assert not self.model.tokens_of(proc.holder)
            return
        left = (deadline - now) / 1000
        # A live holder's deadline is at least 3/4 lease_ttl ahead (heartbeats every 1/4).
        assert left > LEASE_TTL / 4, f"a live holder was {left:.3f}s from being declared dead"
        proc.lo, proc.hi = t0 + left - MARGIN, t1 + left + MARGIN
        self.dying.append(proc)

    def _reclaim(self, dead: list[Process]) -> None:
        """The dead holders' leases are reclaimable now: have them reclaimed by a reap, a
        heartbeat or the live processes' keepers (in turn; or an acquire routes while the
        keepers reclaim them, then a reap), then check each went exactly once and was
        counted."""
        tokens = [t for p in dead for t in self.model.tokens_of(p.holder)]
        self.model.limbo |= set(tokens)
        how = ("reap", "heartbeat", "acquire", "keepers")[self.stats.reclaims % 4]
        if how == "acquire" and self.model.capacity:
            how = "reap"  # whether a replica is full must not depend on the keepers' timing
        self.stats.reclaims += 1
        live = self.proc(self.stats.reclaims, patient=True)
        if how == "keepers" and not any(p.beating() for p in self.procs):
            how = "reap"
        if how == "keepers" and self._deadline() < time.monotonic() + KEEPERS_WAIT:
            how = "reap"  # waiting for the keepers could outlast another dying holder's deadline
        if how == "heartbeat" and not live.beating():  # heartbeats come from keepers only
            how = "reap"
        if how == "reap":
            n = self._call(live.call, "reap")[0]
            assert 0 <= n <= len(tokens)
        elif how == "heartbeat":
            beat = self._call(live.run, live.lb._core.heartbeat())[0]
            assert not beat.registered_anew, "a live holder had been declared dead"
            assert beat.overdue == [] and 0 <= beat.reclaimed <= len(tokens)
            if self._still_leases(tokens):
                assert self._probation(dead) > 0, "a heartbeat left dead leases"
        elif how == "acquire":
            # An acquire routes while they may be going (the keepers reap concurrently).
            self._acquire(live, [REQUESTS[self.stats.reclaims % len(REQUESTS)]])
        else:
            limit = time.monotonic() + KEEPERS_WAIT
            while self._still_leases(tokens):
                assert time.monotonic() < limit, "the keepers left dead leases unreclaimed"
                time.sleep(0.01)
        # A probation running (lib/base.lua liveness()) spares the dead holders until its end.
        wait = self._probation(dead)
        if wait > 0:
            self.stats.probations += 1
            time.sleep(wait + MARGIN)
        self._call(live.call, "reap")  # whatever is left: with no keeper, reap is the way
        assert self._still_leases(tokens) == []
        for t in tokens:
            self.model.reclaim(t)
        self.stats.reclaimed += len(tokens)
        self.gone += tokens
        got = self.r.hgetall(self.p + "reclaimed")
        assert {s: int(n) for s, n in got.items() if int(n)} == {
            s: n for s, n in self.model.reclaimed.items() if n
        }
        known = self.r.zmscore(self.p + "holders", [p.holder for p in dead])
        assert known == [None] * len(dead), "a dead holder outlived its leases"

    def _probation(self, dead: list[Process]) -> float:
        """Seconds left of a probation that spares one of ``dead``: Redis heard no heartbeat
        for over half a lease_ttl (the machine, not only Redis, stalled that long), so the
        holders whose deadline fell after that silence began are not dead until it ends."""
        since, till = self.r.hmget(self.p + "clock", "since", "till")
        now = self._redis_ms()
        if since is None or till is None or int(till) <= now:
            return 0.0
        deadlines = self.r.zmscore(self.p + "holders", [p.holder for p in dead])
        if not any(d is not None and d > int(since) for d in deadlines):
            return 0.0
        return (int(till) - now) / 1000

    def _redis_ms(self) -> int:
        """Redis's clock in ms, the clock every deadline is kept in."""
        secs, micros = self.r.time()
        return int(secs) * 1000 + int(micros) // 1000

    def _still_leases(self, tokens: list[str]) -> list[str]:
        if not tokens:
            return []
        got = self.r.hmget(self.p + "leases", tokens)
        return [t for t, v in zip(tokens, got, strict=True) if v is not None]

    # -- acquiring -------------------------------------------------------------------------

    def prompt(self, index: int) -> tuple[list[int] | None, Prompt]:
        raw = PROMPTS[index % len(PROMPTS)]
        if raw is None:
            return None, Prompt()
        depths, hashes = chain_hashes(raw, BLOCK, 1024)
        need = MIN_MATCH * (len(raw) // BLOCK)
        first = next((k for k, d in enumerate(depths, 1) if d >= need), len(depths))
        return raw, Prompt(len(raw), tuple(hashes), first)

    def fields(self, index: int) -> dict[str, Any]:
        """The request fields of prompt ``index`` (none for no prompt, or for the core's
        policy, which reads no prompt and refuses a keyword it does not declare)."""
        raw = PROMPTS[index % len(PROMPTS)]
        return {} if raw is None or self.router == "core" else {"prompt_ids": raw}

    def acquire_op(
        self, proc: Process, rids: list[str], tokens: list[str], prompts: list[Any]
    ) -> Any:
        """The acquire every path sends (through the balancer's routing policy)."""
        fields = [{} if raw is None else {"prompt_ids": raw} for raw in prompts]
        return proc.lb._core.acquire(rids, tokens, fields)

    def _acquire(
        self,
        proc: Process,
        rids: list[str],
        tokens: list[str] | None = None,
        prompt_picks: list[int] | None = None,
        *,
        resent: bool = False,
        call: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        """Acquire as ``proc`` and check the grants against the model, in order. ``resent``:
        the reply may be a resent copy's (every grant then reads as a retry)."""
        tokens = tokens or [new_token() for _ in rids]
        picks = [self.prompt(i) for i in (prompt_picks or [0] * len(rids))]
        raws, prompts = [p[0] for p in picks], [p[1] for p in picks]
        requests = list(zip(rids, tokens, strict=True))

        def send() -> Any:
            return proc.run(self.acquire_op(proc, rids, tokens, raws))

        run = call or (lambda f: self._call(f))
        try:
            self.model.check_batch(requests)
        except NoServers as refused:
            with pytest.raises(NoCapacity if refused.capacity else NoServersAvailable) as got:
                run(send)
            assert isinstance(got.value, NoCapacity) == refused.capacity
            self.stats.full += refused.capacity
            return
        self.stats.capped += bool(self.model.capacity) * len(rids)
        grants, t0, t1 = run(send)
        for (rid, token), g, prompt in zip(requests, grants, prompts, strict=True):
            allowed, how = self.model.destination(rid, token, prompt)
            assert g.server_id in allowed, (rid, g.server_id, allowed, self.model)
            assert (g.token, g.request_id) == (token, rid)
            if not resent:
                assert g.sticky == (how == 1)
            self.model.grant(rid, token, g.server_id, how, proc.holder, t0, t1, prompt)

    # -- rules -----------------------------------------------------------------------------

    @initialize(ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=4))
    def start(self, ids: list[str]) -> None:
        p = self.proc(0, patient=True)
        assert self._call(p.call, "add_servers", dict.fromkeys(ids))[0] == self.model.add(ids)

    @rule(who=st.integers(0, 7), rid=st.sampled_from(REQUESTS), prompt=st.integers(0, 63))
    def acquire(self, who: int, rid: str, prompt: int) -> None:
        self._ready()
        self._acquire(self.proc(who), [rid], prompt_picks=[prompt])

    @rule(
        who=st.integers(0, 7),
        batch=st.lists(
            st.tuples(st.sampled_from(REQUESTS), st.integers(0, 63)), min_size=1, max_size=6
        ),
    )
    def acquire_many(self, who: int, batch: list[tuple[str, int]]) -> None:
        self._ready()
        rids = [rid for rid, _ in batch]
        self._acquire(self.proc(who), rids, prompt_picks=[p for _, p in batch])

    # Rules pick leases by an index drawn up front: which leases exist depends on timing (a
    # dead holder's leases go when its deadline passes), and Hypothesis needs draws that do not.
    @rule(who=st.integers(0, 7), pick=st.integers(0, 255))
    def acquire_again_with_a_granted_token(self, who: int, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases) + self.gone[-3:], pick)
        if token is None:
            return
        lease = self.model.leases.get(token)
        rid = lease.request_id if lease else REQUESTS[pick % len(REQUESTS)]
        self._acquire(self.proc(who), [rid], [token], [pick])

    @rule(who=st.integers(0, 7), rids=st.lists(st.sampled_from(REQUESTS), min_size=2, max_size=4))
    def one_token_twice_in_a_batch(self, who: int, rids: list[str]) -> None:
        self._ready()
        token = new_token()
        tokens = [token] + [new_token() for _ in rids[1:-1]] + [token]
        rids = [*rids[:-1], rids[0]]
        self._acquire(self.proc(who), rids, tokens)

    @rule(who=st.integers(0, 7), pick=st.integers(0, 255))
    def release_lease(self, who: int, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases) + self.gone[-5:], pick)
        if token is None:
            return
        lease = self.model.leases.get(token)
        sid, rid = (lease.server_id, lease.request_id) if lease else ("s0", "r0")
        p = self.proc(who)
        done = self._call(p.run, p.lb._core.release(sid, rid, token))[0]
        assert done == self.model.release_token(token)
        self.gone.append(token)

    @rule(who=st.integers(0, 7), pick=st.integers(0, 255))
    def a_request_fails(self, who: int, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases) + self.gone[-3:], pick)
        if token is None:
            return
        lease = self.model.leases.get(token)
        sid, rid = (lease.server_id, lease.request_id) if lease else ("s0", "r0")
        p = self.proc(who)
        ejected = len(self.model.ejected)
        done = self._call(p.run, p.lb._core.release(sid, rid, token, True))[0]
        assert done == self.model.release_token(token, False)
        self.stats.ejections += len(self.model.ejected) - ejected
        self.gone.append(token)

    @rule(
        who=st.integers(0, 7),
        ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=2),
        cap=st.integers(1, 3),
    )
    def declare_capacity(self, who: int, ids: list[str], cap: int) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        op = p.lb._core.add_servers(dict.fromkeys(ids), dict.fromkeys(ids, cap))
        assert self._call(p.run, op)[0] == self.model.add(ids, cap)

    @rule(who=st.integers(0, 7), sid=st.sampled_from(SERVERS), rid=st.sampled_from(REQUESTS))
    def release_by_request(self, who: int, sid: str, rid: str) -> None:
        self._ready()
        p = self.proc(who)
        token = self.model.ended_by_request(sid, rid, p.lb._core.latest.get((sid, rid)))
        assert self._call(p.call, "release_server", sid, rid)[0] == (token is not None)
        if token is not None:
            assert self._still_leases([token]) == []
            self.model.release_token(token)
            self.gone.append(token)

    @rule(who=st.integers(0, 7), sid=st.sampled_from(SERVERS))
    def release_by_server(self, who: int, sid: str) -> None:
        self._ready()
        p = self.proc(who)
        self._release_by_server(p, sid, lambda: self._call(p.call, "release_server", sid)[0])

    def _release_by_server(self, p: Process, sid: str, release: Any) -> None:
        """A release by replica only ends the process's own lease there when its ledger has
        one there (none if that lease is gone), else the replica's oldest."""
        core = p.lb._core
        rid, mine = next(
            ((r, t) for (s, r), t in core.latest.copy().items() if s == sid and t in core.held),
            (None, None),
        )
        if mine is None:
            self._release_oldest(sid, release())
            return
        lease = self.model.leases.get(mine)
        # The hint holds while the token is a lease of that request there (whoever holds it:
        # a token can be granted again by a retry); else nothing ends.
        if lease is None or (lease.server_id, lease.request_id) != (sid, rid):
            assert not release()
            return
        assert release()
        assert self._still_leases([mine]) == []
        self.model.release_token(mine)
        self.gone.append(mine)

    def _release_oldest(self, sid: str, done: bool) -> None:
        candidates = self.model.oldest_candidates(sid)
        assert done == bool(candidates)
        if done:
            with self._judging():
                gone = set(self.model.leases) - set(self.r.hkeys(self.p + "leases"))
                assert len(gone) == 1 and gone <= candidates, self._explain_loss(gone, candidates)
            token = gone.pop()
            self.model.release_token(token)
            self.gone.append(token)

    def _explain_loss(self, gone: set[str], expected: set[str]) -> str:
        """Which processes the leases that went belonged to, and how they stand in Redis."""
        now_ms = self._redis_ms()
        lines = [f"expected one of {sorted(expected)} to go; went:"]
        for t in sorted(gone):
            holder = self.model.leases[t].holder
            lines.append(f"  {t} of {holder} {self._standing(holder, now_ms)}")
        return "\n".join(lines)

    def _standing(self, holder: str, now_ms: int) -> str:
        """A holder's kind (its process's class, else not live) and how far its deadline in
        Redis is (negative: past)."""
        kind = next((type(p).__name__ for p in self.procs if p.holder == holder), "not live")
        deadline = self.r.zscore(self.p + "holders", holder)
        left = None if deadline is None else int(deadline - now_ms)
        return f"({kind}), deadline in {left} ms"

    def _explain_holders(self) -> str:
        """Each holder's leases in the model, which of them Redis still has, its kind and how
        far its deadline is (negative: past): what a count that differs is read against."""
        now_ms, have = self._redis_ms(), set(self.r.hkeys(self.p + "leases"))
        lines = [f"Redis has {len(have)} leases, the model {len(self.model.leases)}:"]
        for holder in sorted({x.holder for x in self.model.leases.values()}):
            tokens = self.model.tokens_of(holder)
            kept = sum(t in have for t in tokens)
            lines.append(
                f"  {holder} {self._standing(holder, now_ms)}: {kept} of {len(tokens)} kept"
            )
        dying = [(q.holder, round(q.lo - time.monotonic(), 3)) for q in self.dying]
        lines.append(f"dying holders (holder, s until reclaimable): {dying}")
        return "\n".join(lines)

    @rule(who=st.integers(0, 7), pick=st.integers(0, 255))
    def renew(self, who: int, pick: int) -> None:
        self._ready()
        token = _pick(list(self.model.leases) + self.gone[-3:], pick)
        if token is None:
            return
        p = self.proc(who)
        assert self._call(p.run, p.lb._core.renew(token))[0] == (token in self.model.leases)

    @rule(who=st.integers(0, 7), ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=3))
    def add(self, who: int, ids: list[str]) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        assert self._call(p.call, "add_servers", dict.fromkeys(ids))[0] == self.model.add(ids)

    @rule(who=st.integers(0, 7), ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=2))
    def remove(self, who: int, ids: list[str]) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        gone = [t for t, x in self.model.leases.items() if x.server_id in ids]
        assert self._call(p.call, "remove_servers", ids)[0] == self.model.remove(ids)
        self.gone += gone

    @rule(who=st.integers(0, 7), ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=2))
    def drain(self, who: int, ids: list[str]) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        assert self._call(p.call, "drain_servers", ids)[0] == self.model.set_draining(ids, True)

    @rule(who=st.integers(0, 7), ids=st.lists(st.sampled_from(SERVERS), min_size=1, max_size=3))
    def undrain(self, who: int, ids: list[str]) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        done = self._call(p.call, "undrain_servers", ids)[0]
        assert done == self.model.set_draining(ids, False)

    @rule(who=st.integers(0, 7))
    def clear_sticky(self, who: int) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        assert self._call(p.call, "clear_sticky_cache")[0] == self.model.clear_sticky()

    @rule(who=st.integers(0, 7))
    def reap_takes_nothing_from_live_processes(self, who: int) -> None:
        self._ready()
        p = self.proc(who, patient=True)
        assert self._call(p.call, "reap")[0] == 0

    @rule(who=st.integers(0, 7))
    def a_process_dies(self, who: int) -> None:
        self._ready()
        self._die(self.proc(who), closing=False)

    @rule(who=st.integers(0, 7))
    def a_process_closes_its_balancer(self, who: int) -> None:
        self._ready()
        self._die(self.proc(who), closing=True)

    @rule(who=st.integers(0, 7), kinds=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def a_partitioned_process_releases_late(self, who: int, kinds: list[int]) -> None:
        """A process's network fails (its heartbeats stop, the process lives) past lease_ttl:
        its leases are reclaimed and the others take its requests' next turns, sticky. When
        the network heals it releases each request it held (by lease, by request id, by
        replica only): each ends nothing of the others' leases (the model says what ends, I1),
        and no replica goes past its capacity (I10). Then it closes."""
        p = self.proc(who)
        leases = [(t, self.model.leases[t]) for t in self.model.tokens_of(p.holder)]
        if not leases or not self._due("partitions", PARTITION_EVERY):
            return
        # No other dying holder may come due while this one's leases go.
        self._ready(LEASE_TTL + KEEPERS_WAIT + 2 * STEP)
        self.procs.remove(p)
        self.procs.append(self.spawn(PROCESSES - 1 if p.impatient else 0))
        p.partition()
        time.sleep(MARGIN)  # a heartbeat written as its keeper stopped has run
        self.stats.partitions += 1
        deadline, now = self.r.zscore(self.p + "holders", p.holder), self._redis_ms()
        assert deadline is not None
        time.sleep(max(0.0, (deadline - now) / 1000) + MARGIN)
        self._reclaim([p])
        for i, (_, lease) in enumerate(leases):  # the requests' next turns, elsewhere
            self._acquire(self.proc(who + i), [lease.request_id])
        # The network heals: late releases, by lease, then by request id, then by replica only
        # (one of each style per request, so each names a lease of the process's own).
        late = sorted((kinds[i % len(kinds)], i) for i in range(len(leases)))
        core = p.lb._core
        for kind, i in late:
            token, lease = leases[i]
            sid, rid = lease.server_id, lease.request_id
            self.stats.late += 1
            if kind == 0:
                done = self._call(p.run, core.release(sid, rid, token))[0]
                assert not done and not self.model.release_token(token)
            elif kind == 1:
                mine = core.latest.get((sid, rid))
                assert mine is not None, "a process that held the request sends no hint"
                ends = self.model.ended_by_request(sid, rid, mine)
                assert self._call(p.call, "release_server", sid, rid)[0] == (ends is not None)
                if ends is not None:  # a lease another process took with one of its tokens
                    self.model.release_token(ends)
                    self.gone.append(ends)
            else:
                assert any(s == sid and t in core.held for (s, _), t in core.latest.items())
                self._release_by_server(
                    p, sid, lambda s=sid: self._call(p.call, "release_server", s)[0]
                )
            assert invariants.check(self.r, self.name) == self.model.counts()
        p.close()

    @rule(n=st.integers(0, 7))
    def every_process_closes(self, n: int) -> None:
        if n:  # one in eight: it ends most of the state
            return
        self._ready()
        for p in list(self.procs):
            self._die(p, closing=True)
        assert invariants.check(self.r, self.name) == self.model.counts()

    @rule()
    def processes_live_past_lease_ttl(self) -> None:
        if not self._due("pauses", PAUSE_EVERY):
            return
        self._ready(PAUSE + STEP)
        time.sleep(PAUSE)  # the keepers keep every live lease
        self.stats.pauses += 1

    @rule()
    def the_server_pauses_past_lease_ttl(self) -> None:
        if not self._due("server_pauses", SERVER_PAUSE_EVERY):
            return
        # No dying holder may come due during the pause and the probation after it: the
        # model would not know when its leases go.
        self._ready(SERVER_PAUSE + LEASE_TTL + STEP)
        pid = int(self.r.info("server")["process_id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(SERVER_PAUSE)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(LEASE_TTL)  # the probation, and the keepers heard again: no lease went
        self.stats.server_pauses += 1

    @rule()
    def the_server_restarts_past_lease_ttl(self) -> None:
        """A persistent restart (AOF) that keeps the server down longer than lease_ttl: every
        key comes back, the holders are on probation, and no live lease goes."""
        if self.server is None or not self._due("restarts", SERVER_PAUSE_EVERY):
            return
        self._ready(SERVER_PAUSE + LEASE_TTL + 2.0 + STEP)
        self.server.stop()
        time.sleep(SERVER_PAUSE)
        self.server.start()
        time.sleep(LEASE_TTL)  # the probation, and the keepers heard again: no lease went
        self.stats.restarts += 1

    @rule(who=st.integers(0, 7))
    def connections_drop_between_calls(self, who: int) -> None:
        self._ready()
        self.proc(who).drop_connections()
        self.stats.drops += 1

    def _stall(self) -> Stall:
        """Keep the server busy in one script for about STALL, from another connection."""
        if self._blocker is None:
            self._blocker = redis.Redis.from_url(self.url)
        return Stall(self._blocker, BalancerMachine.stall_loops)

    def _unstall(self, stall: Stall) -> None:
        """Wait for the stall's end; rescale the next ones to how long this one took (the
        server's speed varies with the machine's load). A stall that outlasted a live holder's
        slack (its heartbeats wait behind it) may have let a live holder be declared dead: an
        overloaded machine, not a balancer bug, and the model cannot judge the run."""
        stall.join()
        loops = stall.loops * STALL / max(stall.took, 1e-3)
        BalancerMachine.stall_loops = int((BalancerMachine.stall_loops + loops) / 2)
        if stall.took >= 0.6 * LEASE_TTL:
            self.stats.slow_stalls += 1
            reject()

    def _impatient(self) -> Process:
        return next(p for p in self.procs if p.impatient)

    @rule(kind=st.integers(0, 3), rid=st.sampled_from(REQUESTS), pick=st.integers(0, 255))
    def the_server_stalls_past_the_client_timeout(self, kind: int, rid: str, pick: int) -> None:
        if not self._due("stalls", STALL_EVERY):
            return
        self._ready(3 * STALL + STEP)
        p = self._impatient()
        self.stats.stalls += 1

        def stalled(fn: Callable[[], Any]) -> tuple[Any, float, float]:
            before = p.lb._client.client_id()
            stall = self._stall()
            try:
                return self._call(fn)
            finally:
                self._unstall(stall)
                # A command that timed out (this call's, or a heartbeat's waiting for the
                # same connection) was resent on a new connection.
                self.stats.resent += p.lb._client.client_id() != before

        self._fault(p, kind, rid, pick, stalled)

    @rule(kind=st.integers(0, 3), rid=st.sampled_from(REQUESTS), pick=st.integers(0, 255))
    def a_connection_is_killed_while_its_command_waits(
        self, kind: int, rid: str, pick: int
    ) -> None:
        if not self._due("kills", STALL_EVERY // 2):
            return
        self._ready(3 * STALL + STEP)
        p = self._impatient()
        victim = p.lb._client.client_id()
        self.stats.kills += 1

        def killed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
            stall = self._stall()  # the kill is sent while the command waits
            out: list[Any] = []

            def work() -> None:
                try:
                    out.append(self._call(fn))
                except Exception as exc:  # raised again in the machine's thread
                    out.append(exc)

            worker = threading.Thread(target=work)
            worker.start()
            time.sleep(0.01)
            self.r.client_kill_filter(_id=victim)  # runs before or after the command
            worker.join()
            self._unstall(stall)
            if isinstance(out[0], Exception):
                raise out[0]
            return out[0]

        self._fault(p, kind, rid, pick, killed)

    def _fault(self, p: Process, kind: int, rid: str, pick: int, call: Callable[..., Any]) -> None:
        """One call of ``p`` under a fault: acquire, release by lease, by request, by replica."""
        if kind == 0:
            self._acquire(p, [rid], prompt_picks=[pick], resent=True, call=call)
            return
        if kind == 1:
            token = _pick(list(self.model.leases) + self.gone[-2:], pick)
            if token is None:
                return
            lease = self.model.leases.get(token)
            sid, owner = (lease.server_id, lease.request_id) if lease else ("s0", rid)
            done = call(lambda: p.run(p.lb._core.release(sid, owner, token)))[0]
            assert done == self.model.release_token(token)
            self.gone.append(token)
            return
        token = _pick(list(self.model.leases), pick)
        sid = self.model.leases[token].server_id if token else SERVERS[pick % len(SERVERS)]
        if kind == 2:
            token = self.model.ended_by_request(sid, rid, p.lb._core.latest.get((sid, rid)))
            assert call(lambda: p.call("release_server", sid, rid))[0] == (token is not None)
            if token is not None:
                self.model.release_token(token)
                self.gone.append(token)
            return
        self._release_by_server(p, sid, lambda: call(lambda: p.call("release_server", sid))[0])

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def counts_match_the_model(self) -> None:
        self._ready()  # a dead holder due during the reads is reclaimed first
        with self._judging():
            self._counts_match_the_model()

    def _counts_match_the_model(self) -> None:
        p = self.proc(0, patient=True)
        counts = p.run(p.lb._core.counts())
        if counts != self.model.counts():
            print(self._explain_holders())  # shown in full with the failure (captured output)
        assert counts == self.model.counts()
        self.steps += 1
        if self.steps % 4:
            return  # the full check reads every key: every few steps
        assert not self.model.limbo
        draining = sorted(s for s, d in self.model.servers.items() if d)
        assert p.call("get_status")["draining_servers"] == draining
        assert invariants.check(self.r, self.name) == self.model.counts()
        owners = {x.holder for x in self.model.leases.values()}
        registered = set(self.r.zrange(self.p + "holders", 0, -1))
        assert owners <= registered, "a holder with leases is not registered"
        known = {q.holder for q in self.procs + self.dying} | {self.listener.holder}
        assert registered <= known, "unknown holder"
        self.check_router_state()

    def check_router_state(self) -> None:
        """The router's own keys against the model: health and admission, then the
        policy's."""
        caps = self.r.hgetall(self.p + "capacity")
        assert {s: int(c) for s, c in caps.items()} == self.model.capacity
        assert set(self.r.zrange(self.p + "ejected", 0, -1)) == self.model.ejected
        fails = self.r.hgetall(self.p + "fails")
        assert {s: int(n) for s, n in fails.items() if int(n)} == self.model.fails
        if self.router == "least_tokens":
            got = self.r.zrange(self.p + "weighted", 0, -1, withscores=True)
            assert {s: int(w) for s, w in got} == self.model.weights()
        elif self.router == "prefix_cache":
            index: dict[str, set[str]] = {}
            for h, v in self.r.hgetall(self.p + "pc:idx").items():
                index[h] = set(v.split("\x1f")[0:-1:2])
            assert index == self.model.index


async def _awaited(method: Any, *args: Any) -> Any:
    """Call a method on the event loop and await what it returns (a coroutine, or a
    release's awaitable)."""
    return await method(*args)
