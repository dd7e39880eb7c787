"""The synchronous balancer: :class:`RedisLoadBalancer` and its :class:`Lease`."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from redis import exceptions as rx

from . import health, keeper, validation
from .base import BalancerBase
from .connection import (
    TRANSIENT_BACKOFF,
    client_for,
    direct_pool,
    final_failure,
    resends,
    send_failure,
    sentinel_check_due,
    stale_pools,
)
from .core import (
    Admission,
    Attempt,
    Block,
    Call,
    Grant,
    Op,
    Pause,
    Step,
    T,
    admit,
    fields_per_request,
    run_steps,
)
from .engine import EngineLoad
from .errors import NoCapacity, RedisRouterError, RedisUnavailable
from .invoke import Sender, unsent
from .outbox import Outbox, Released


class Lease:
    """One request's hold on a replica, from acquire until release.

    It stays counted as long as its balancer's process lives (the balancer's keeper sends
    heartbeats), up to ``max_lease_age``; ``release()`` ends it exactly once, and later calls
    return False without a round trip.
    """

    __slots__ = ("_balancer", "_released", "handle", "request_id", "server_id", "sticky", "token")

    def __init__(self, balancer: RedisLoadBalancer, grant: Grant) -> None:
        self._balancer = balancer
        self._released = False
        self.server_id, self.handle = grant.server_id, grant.handle
        self.request_id, self.token, self.sticky = grant.request_id, grant.token, grant.sticky

    def renew(self, remaining: int | None = None) -> bool:
        """Restart the lease's age, for a request that may outlive max_lease_age (liveness
        needs no renewal). ``remaining``: the lease's weight from now on, what is left of its
        work in its policy's units (least_tokens with remaining_work: ``policy.weigh(...)``);
        absolute, so sending it twice changes nothing more. False if the lease is already
        gone, as after the balancer's close() (nothing is written)."""
        if self._released or self._balancer._core.closed:
            if remaining is not None:
                validation.weight(remaining, "remaining")
            return False
        return self._balancer._run(self._balancer._core.renew(self.token, remaining))

    def release(self) -> Released[bool]:
        """End the lease, without waiting for Redis (see ``release_server``). Its result,
        when asked for, is True if this call ended it."""
        return self._end(False)

    def fail(self) -> Released[bool]:
        """End the lease and report that its request failed: ``eject_after`` failures in a
        row eject the replica for every process. Its result: True if this call ended it."""
        return self._end(True)

    def _end(self, failed: bool) -> Released[bool]:
        """Send the release once; a send that raised (Redis unreachable) leaves the lease
        releasable, so calling again after the outage ends it."""
        if self._released:
            return Released.of(False)
        self._released = True
        b = self._balancer
        try:
            return b._post(b._core.release(self.server_id, self.request_id, self.token, failed))
        except BaseException:
            self._released = False
            raise

    def __repr__(self) -> str:
        return f"Lease(server_id={self.server_id!r}, request_id={self.request_id!r})"


class RedisLoadBalancer(BalancerBase):
    """A global least-in-flight balancer with sticky sessions, shared through Redis.

    Any number of processes that construct it with the same Redis and ``name`` share one
    balancer; each acquire and release is one atomic Lua script (see ``lua/``).

    ``lease_ttl`` is how long a silent process is still taken for alive: its leases are
    reclaimed that long after its last heartbeat (sent every lease_ttl / 4 from a background
    thread). ``max_lease_age`` ends a lease its process forgot to release. Constructing a
    balancer writes nothing unless ``servers`` are given; the first acquire pins sticky_ttl.

    Its options are the constructor's (:class:`~redis_router.base.BalancerBase`).
    """

    def _open(self, servers: dict[str, Any], redis: Any, **client: Any) -> None:
        self._keeper: keeper.ThreadKeeper | None = None
        self._keeper_lock = threading.Lock()
        self._client, self.url, self._owns_client = client_for(redis, asyncio=False, **client)
        self._scripts = Sender(self._client)  # FCALL or EVALSHA, probed on the first call
        # Releases are written at once and answered later (redis_router.outbox); through a
        # Cluster or Sentinel client they wait for their reply (connection.direct_pool).
        pool = direct_pool(self._client)
        self._outbox = Outbox(pool, self._command, self._exec_plain) if pool is not None else None
        self._release_loaded = False  # loaded before the first release is written directly
        self._run(self._core.setup(servers))
        self._core.on_acquire = self._keep_alive
        keeper.track(self)

    # -- driving the core ------------------------------------------------------------------

    def _exec(self, call: Call) -> Any:
        """Send one script call; behind this balancer's releases still unanswered, on their
        connection, so Redis runs them first and one round trip answers all."""
        outbox = self._outbox
        if outbox is not None and outbox.unanswered:
            sent, reply = outbox.call(call)
            if sent:
                if isinstance(reply, rx.ResponseError):
                    if not unsent(reply):  # the script's refusal, as the ordinary path says it
                        raise self._failure(reply)
                elif isinstance(reply, rx.TimeoutError):  # Redis silent: not resent
                    raise self._failure(reply)
                elif isinstance(reply, (rx.RedisError, OSError)):  # the connection broke
                    if not resends(self._client):  # a client made without retries
                        raise self._failure(rx.ConnectionError(str(reply)))
                else:
                    return reply
        return self._exec_plain(call)

    def _failure(self, exc: Exception) -> Exception:
        """What a failed call raises (as the ordinary path raises it)."""
        return final_failure(exc, self.url, self._core.script_error)

    def _exec_plain(self, call: Call) -> Any:
        """Send one script call. A dropped connection is retried by redis-py with the same
        arguments (an acquire's lease token makes the resend idempotent); a reply that proves
        nothing was written (READONLY after a failover, LOADING) is resent after a pause."""
        sentinel = sentinel_check_due(self._client)
        if sentinel is not None:
            with contextlib.suppress(rx.RedisError):  # the master may be fine; the call will tell
                sentinel.get_master_address()
        for pause in (*TRANSIENT_BACKOFF, None):
            try:
                return self._send(call)
            except (rx.ConnectionError, rx.TimeoutError, rx.ResponseError) as exc:
                error = send_failure(exc, self.url, self._core.script_error, pause is None)
                if error is not None:
                    raise error from None
            for pool in stale_pools(self._client):
                pool.disconnect(inuse_connections=False)
            assert pause is not None  # the last try raised above
            time.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    def _send(self, call: Call) -> Any:
        return self._scripts.send(call.script, self._core.prefix, call.args)

    def _command(self, call: Call) -> tuple[Any, ...] | None:
        return self._scripts.command(call.script, self._core.prefix, call.args)

    def _post(self, op: Op[bool]) -> Released[bool]:
        """Run a release without waiting for its reply (written at once, read later). After
        close() a release is a no-op whose result is False: close() ended the leases."""
        if self._core.closed:
            op.close()
            return Released.of(False)
        if self._outbox is None:
            return Released.of(self._run(op))
        self._load_release()
        return self._outbox.post(op)

    def _load_release(self) -> None:
        """Load the release script where it must be (Functions) before a release is written
        directly: done by the first acquire, which waits for Redis anyway, so that the first
        release does not (a process that releases without acquiring loads it then)."""
        if not self._release_loaded and self._scripts.functions is not None:
            self._release_loaded = True
            self._scripts.preload(self._core.release_script)

    def _keep_alive(self) -> None:
        """Start the heartbeats (first acquire): from now on this process holds leases."""
        if self._keeper is not None:
            return
        self._load_release()
        with self._keeper_lock:
            if self._keeper is None:
                ref = weakref.ref(self)
                self._keeper = keeper.ThreadKeeper(
                    lambda: keeper.beat_sync(ref), self._core.heartbeat_every
                )

    def _forked(self) -> None:
        """In a forked child: a holder of its own; the parent's keeper thread is not here."""
        self._core.new_holder()
        self._keeper = None
        if self._outbox is not None:
            self._outbox.forked()
        self._keeper_lock = threading.Lock()

    def _acquire(
        self,
        request_ids: list[str],
        tokens: list[str] | None = None,
        fields: Sequence[Mapping[str, Any]] | None = None,
        wait: float | None = None,
        exclude: tuple[str, ...] = (),
    ) -> list[Grant]:
        started = time.monotonic()
        core = self._core
        try:
            return self._run(core.acquire(request_ids, tokens, fields, exclude=exclude))
        except NoCapacity as refused:  # reclaim, wait: core.admit decides
            op = admit(core, refused, request_ids, fields, wait, started, tokens, exclude)
            return self._admit(op)

    def _admit(self, op: Admission) -> list[Grant]:
        """Drive :func:`~redis_router.core.admit`: run each step, throw its error back in."""
        return run_steps(op, self._step)

    def _step(self, step: Step) -> Any:
        if isinstance(step, Attempt):
            core = self._core
            return self._run(core.acquire(*step[:3], ticket=step.ticket, exclude=step.exclude))
        if isinstance(step, Pause):
            time.sleep(step.seconds)
        elif isinstance(step, Block):
            self._block(step.key, step.timeout)
        else:
            return self._exec(step)
        return None

    def _block(self, key: str, timeout: float) -> None:
        """BLPOP for at most ``timeout`` s (at most BLOCK_MAX s: within the socket timeout; a
        wake lost in a failover is made up for by the next try)."""
        try:
            self._client.blpop([key], timeout=round(min(timeout, health.BLOCK_MAX), 3) or 0.001)
        except (rx.ConnectionError, rx.TimeoutError):
            time.sleep(min(timeout, TRANSIENT_BACKOFF[0]))

    def _run(self, op: Op[T]) -> T:
        if self._core.closed:
            op.close()
            raise self._core.closed_error()
        try:
            call = next(op)
            while True:
                call = op.send(self._exec(call))
        except StopIteration as stop:
            result: T = stop.value
            return result
        finally:
            op.close()  # a failed call's operation still runs its cleanup, now

    # -- routing ---------------------------------------------------------------------------

    def acquire_server(
        self,
        request_id: str,
        *,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> tuple[str, Any]:
        """Route a request: its sticky replica, else where the policy places it (default: the
        least loaded). ``fields``: what the policy reads (``require_acquire_fields``).
        ``wait``: seconds to wait for a place when every eligible replica is full (default
        the balancer's ``wait_timeout``; 0 raises NoCapacity at once). ``exclude``: server
        ids the request must not go to (a retry's failed replicas), sticky or new: a session
        on one is placed anew and pinned where it goes; NoServersAvailable when they leave
        none that takes new sessions (NoCapacity when one that is not excluded is full or
        ejected). Returns (id, handle)."""
        rid = validation.request_id(request_id)
        excl = self._core.check_acquire(fields, exclude)
        g = self._acquire([rid], None, [fields] if fields else None, _wait(wait), excl)[0]
        return g.server_id, g.handle

    def acquire_many(
        self, request_ids: list[str], *, wait: float | None = None, **fields: Any
    ) -> list[tuple[str, Any]]:
        """Route many requests in one round trip, as if acquired one after another; each
        field is a sequence with one value per request id (``prompt_ids=[...]``). With
        capacities, the batch is granted whole or not at all."""
        rids = validation.request_ids(request_ids)
        self._core.check_acquire(fields)
        per = fields_per_request(len(rids), fields)
        grants = self._acquire(rids, None, per, _wait(wait))
        return [(g.server_id, g.handle) for g in grants]

    def acquire(
        self,
        request_id: str,
        *,
        token: str | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> Lease:
        """Route a request and return its :class:`Lease`. Passing the token of an earlier,
        failed attempt makes a retry safe: a lease already granted is returned, not doubled.
        ``wait``, ``exclude``: as acquire_server."""
        rid = validation.request_id(request_id)
        tokens = [validation.token(token)] if token is not None else None
        excl = self._core.check_acquire(fields, exclude)
        per = [fields] if fields else None
        return Lease(self, self._acquire([rid], tokens, per, _wait(wait), excl)[0])

    @contextmanager
    def lease(
        self,
        request_id: str,
        *,
        renew_every: float | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> Iterator[Lease]:
        """``with lb.lease(rid) as lease:`` routes, yields the lease, releases it exactly once.

        ``renew_every`` (seconds) restarts its age from a background thread, for requests
        that may outlive max_lease_age (liveness needs nothing: the balancer's heartbeats
        keep every lease alive).
        """
        if renew_every is not None:
            validation.seconds(renew_every, "renew_every", validation.MAX_LEASE_TTL)
        held = self.acquire(request_id, wait=wait, exclude=exclude, **fields)
        stop = threading.Event()
        renewer = None
        if renew_every is not None:
            renewer = threading.Thread(
                target=_renew_age, args=(held, stop, renew_every), daemon=True
            )
            renewer.start()
        try:
            yield held
        finally:
            stop.set()
            if renewer is not None:
                renewer.join()
            held.release()

    def release_server(
        self,
        server_id: str,
        request_id: str | None = None,
        *,
        failed: bool = False,
        **fields: Any,
    ) -> Released[bool]:
        """End the request's lease on that replica (without request_id: this process's own
        lease there, else the replica's oldest).

        It does not wait for Redis: the release is written at once, ahead of every later
        call of this balancer, and its reply read later (by the next call, or within a few
        milliseconds from the background). The result, ``.result()`` (or ``bool()`` of what
        this returns), waits for the reply: True if a lease ended. Releasing twice, or for an
        unknown or removed replica, is a no-op whose result is False; a copy resent after a
        timeout reports the first one's result and ends nothing else; so is a release after
        close(), which ended this balancer's leases (nothing is sent).
        ``failed=True``: the request failed (passive health, see ``Lease.fail``)."""
        sid, rid, bad = validation.release(server_id, request_id, failed)
        return self._post(self._core.release(sid, rid, None, bad))

    # -- the pool --------------------------------------------------------------------------

    def add_servers(
        self, servers: Mapping[str, Any], *, capacity: Mapping[str, int] | None = None
    ) -> int:
        """Register replicas; existing ones keep count and leases. Returns how many are new.
        A replica's capacity (requests it can hold; never exceeded) comes from ``capacity``
        or its metadata's ``"capacity"`` key."""
        return self._run(self._core.add_servers(servers, capacity))

    def remove_servers(self, server_ids: list[str]) -> int:
        """Take replicas out atomically: no acquire reaches them after this returns."""
        return self._run(self._core.remove_servers(server_ids))

    def drain_servers(self, server_ids: list[str]) -> int:
        """Send no new sessions to these replicas; their sticky sessions still go there."""
        return self._run(self._core.set_draining(server_ids, True))

    def undrain_servers(self, server_ids: list[str]) -> int:
        """Let draining replicas take new sessions again."""
        return self._run(self._core.set_draining(server_ids, False))

    def get_all_servers(self) -> list[str]:
        return sorted(self._run(self._core.counts()))

    def get_inflight_count(self, server_id: str) -> int:
        """Requests in flight on the replica (a data-parallel replica's id: on all its
        ranks); 0 for an id not in the pool."""
        return self._run(self._core.inflight(server_id))

    def get_total_inflight(self) -> int:
        return sum(self._run(self._core.counts()).values())

    def report_engine_load(self, loads: Mapping[str, EngineLoad]) -> int:
        """Store what the engines report of their own load ({server id: EngineLoad}: running
        and waiting requests, KV-cache usage), stamped with Redis's clock, in one script for
        every worker to read; ids not in the pool are skipped. Every entry is checked before
        anything is written. Returns how many reports were stored. ``redis-router load``
        calls this from the replicas' metrics endpoints (docs/engine-load.md)."""
        return self._run(self._core.report_engine(loads))

    def get_status(self) -> dict[str, Any]:
        """A consistent snapshot; ``sticky_sessions`` counts sessions whose entry has not yet
        expired (approximate: entries of removed replicas count until their next turn)."""
        return self._run(self._core.status())

    def request_owner(self, request_id: str) -> str | None:
        """The replica serving ``request_id`` now (it holds a live lease of it), or None:
        where to send a targeted abort. A few lookups, no scan."""
        return self._run(self._core.request_owner(request_id))

    def end_session(self, *request_ids: str) -> int:
        """The sessions are over: forget their sticky entries now rather than sticky_ttl after
        their last turn, so new sessions see their replicas free (a session thinking between
        turns counts as pinned to its replica, which new sessions avoid among the least
        loaded). Leases are untouched; a later turn of the id is a new session. Returns how
        many had a live entry."""
        return self._run(self._core.end_sessions(list(request_ids)))

    def bump_weight_version(self, *, sticky: bool = False) -> dict[str, int]:
        """After a weight update: drop every cache-locality record (the prefix index, group
        placements, the policy's ``locality_keys``; with ``sticky`` the sticky sessions too)
        atomically for every worker. Leases and in-flight counts are untouched. Returns the
        new version and what was dropped."""
        return self._run(self._core.bump_weight_version(sticky))

    def clear_sticky_cache(self) -> dict[str, Any]:
        """Forget every sticky session. Returns ``{"cleared_entries": n, "server_loads":
        {server id: in-flight}}``, as verl's rebalancing reads it."""
        return self._run(self._core.clear_sticky())

    def reap(self) -> int:
        """Reclaim now every lease of a dead holder (no heartbeat for lease_ttl). Returns how
        many. Acquires and heartbeats also do this, a few at a time."""
        return self._run(self._core.reap())

    def destroy(self) -> int:
        """Delete every key of this balancer from Redis. Returns how many keys went."""
        return self._run(self._core.destroy())

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the heartbeats and end this balancer's unreleased leases at once
        (nothing can keep them alive any more); close the connection pool if this balancer
        made it (a client you passed stays open). Releases not yet answered are read first.
        Afterwards every call raises BalancerClosed, except a release or renewal, which
        returns False (the lease is gone), and close() itself (it does nothing more)."""
        if self._outbox is not None:
            self._outbox.close()
        stopping, self._keeper = self._keeper, None
        if stopping is not None:
            stopping.stop()
            try:
                self._run(self._core.retire())
            except (RedisRouterError, rx.RedisError) as exc:
                keeper.report_close_failed(self._core, exc)
        self._core.closed = True
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> RedisLoadBalancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _renew_age(lease: Lease, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        try:
            if not lease.renew():
                return
        except RedisUnavailable:
            continue  # try again next period; the lease has lease_ttl of slack


def _wait(wait: float | None) -> float | None:
    """A ``wait`` argument, checked before anything is sent."""
    return None if wait is None else health.wait_seconds(wait)
