"""The asyncio twin: :class:`AsyncRedisLoadBalancer`, same scripts, keys and validation.

Only the sending differs from :mod:`redis_router.balancer`: both drive the operations of
:class:`~redis_router.core.BalancerCore`. A sync and an async instance with the same Redis and
name are one balancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Generator,
    Mapping,
    Sequence,
)
from typing import Any

from redis import exceptions as rx

from . import health, keeper, validation
from .base import BalancerBase
from .coalesce import MAX_BATCH, Coalescer, Outcomes
from .connection import (
    TRANSIENT_BACKOFF,
    client_for,
    connect,
    direct_pool,
    final_failure,
    resends,
    resolve_url,
    send_failure,
    sentinel_check_due,
    stale_pools,
    unavailable,
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
    new_token,
    new_tokens,
    run_steps_async,
)
from .direct import Pipe
from .engine import EngineLoad
from .errors import (
    NoCapacity,
    NoServersAvailable,
    RedisRouterError,
    RedisUnavailable,
)
from .invoke import Sender

log = logging.getLogger("redis_router")

# Seconds close() waits for the cancelled keeper task to finish.
KEEPER_STOP_TIMEOUT = 5.0

# A coalesced acquire: request id, the token of an earlier attempt (or None), the policy's
# arguments for it.
_AcquireItem = tuple[str, str | None, tuple[str, ...]]
# The same with its token: the earlier attempt's, or a new one.
_Filled = tuple[str, str, tuple[str, ...]]
# A coalesced release: server id, request id, token, whether the request failed.
_ReleaseItem = tuple[str, str | None, str | None, bool]


class AsyncReleased:
    """A release on its way: queued at once (ahead of every later call of its balancer) and
    answered in the background. ``await`` it for its result, True if a lease ended; awaiting
    is optional, and cancelling the awaiting task does not stop the release."""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[bool]) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, bool]:
        return asyncio.shield(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> bool:
        """The result once done (asyncio.InvalidStateError before)."""
        return self._future.result()

    def __repr__(self) -> str:
        if not self._future.done():
            return "AsyncReleased(pending)"
        if self._future.cancelled() or self._future.exception() is not None:
            return "AsyncReleased(failed)"
        return f"AsyncReleased(result={self._future.result()!r})"


class AsyncLease:
    """One request's hold on a replica; ``release()`` ends it exactly once."""

    __slots__ = (
        "_balancer",
        "_release",
        "handle",
        "request_id",
        "server_id",
        "sticky",
        "token",
    )

    def __init__(self, balancer: AsyncRedisLoadBalancer, grant: Grant) -> None:
        self._balancer = balancer
        # The release sent, once it is: a lease stays released unless that one failed.
        self._release: asyncio.Future[bool] | None = None
        self.server_id, self.handle = grant.server_id, grant.handle
        self.request_id, self.token, self.sticky = grant.request_id, grant.token, grant.sticky

    async def renew(self, remaining: int | None = None) -> bool:
        """Restart the lease's age and, with ``remaining``, set its weight (see Lease.renew).
        False if the lease is already gone (as after the balancer's close())."""
        if self._released or self._balancer._core.closed:
            if remaining is not None:
                validation.weight(remaining, "remaining")
            return False
        return await self._balancer._run(self._balancer._core.renew(self.token, remaining))

    def release(self) -> AsyncReleased:
        """End the lease without waiting for Redis (see release_server); ``await`` it for the
        result, True if this call ended it. Safe from a cancelled task's cleanup: the release
        goes out whatever happens to the task awaiting it."""
        return self._end(False)

    def fail(self) -> AsyncReleased:
        """End the lease and report that its request failed (see Lease.fail)."""
        return self._end(True)

    @property
    def _released(self) -> bool:
        """Released: a release was sent and has not failed (Redis unreachable), so a lease
        whose release failed may be released again once Redis is back."""
        sent = self._release
        if sent is None:
            return False
        return not (sent.done() and (sent.cancelled() or sent.exception() is not None))

    def _end(self, failed: bool) -> AsyncReleased:
        if self._released:
            return self._balancer._post_done(False)
        sent = self._balancer._post(self.server_id, self.request_id, self.token, failed)
        self._release = sent._future
        return sent

    def __repr__(self) -> str:
        return f"AsyncLease(server_id={self.server_id!r}, request_id={self.request_id!r})"


class AsyncRedisLoadBalancer(BalancerBase):
    """The asyncio form of :class:`~redis_router.RedisLoadBalancer` (same arguments, methods
    are coroutines). Its keeper is a task on the event loop of the first acquire.

    ``coalesce`` (default True): acquires and releases made while another is in flight go
    together in the next round trip, with the result of making them one after another
    (:mod:`redis_router.coalesce`); a lone call waits one loop turn. False sends each by itself.
    Coalesced calls go through the policy like every other acquire.

    A caller cancelled during an acquire (``asyncio.wait_for``) gets its CancelledError at
    once; the script call finishes on its connection and what it granted is released. Built
    from a URL, the balancer follows the running event loop: used from a second
    ``asyncio.run()``, it makes its client again there and its keeper beats from there, so
    leases of the first loop stay releasable (a client passed in cannot be remade: once its
    loop is closed, calls raise RedisRouterError).
    """

    _client_options = ("max_connections", "coalesce")

    def _open(self, servers: dict[str, Any], redis: Any, **client: Any) -> None:
        coalesce = client.get("coalesce", True)
        if not isinstance(coalesce, bool):
            raise TypeError(f"coalesce must be a bool, got {type(coalesce).__name__}")
        max_connections = client.get("max_connections")
        self._keeper: asyncio.Future[None] | None = None
        self._initial = servers
        self._client, self.url, self._owns_client = client_for(
            redis, asyncio=True, max_connections=max_connections
        )
        # What the client was made from, to make it again on another event loop (below).
        self._given_url = resolve_url(redis) if self._owns_client else None
        self._max_connections = max_connections
        self._scripts = Sender(self._client)  # FCALL or EVALSHA, probed on the first call
        self._setup: asyncio.Future[None] | None = None
        self._coalesce = coalesce
        self._acquires: Coalescer[_AcquireItem, Grant] | None = None
        self._releases: Coalescer[_ReleaseItem, bool] | None = None
        # Coalesced acquires and releases, written in order on a connection of the
        # balancer's own (redis_router.direct); releases posted in one turn of the event loop
        # go in one call, written at the start of the next turn (a lone session's at once).
        self._pipe: Pipe | None = None
        self._outgoing: list[tuple[_ReleaseItem, asyncio.Future[bool]]] = []
        # The latest release written alone, in its caller's step (see _alone).
        self._freeing: asyncio.Future[bool] | None = None
        self._make_coalescers()
        # Releases posted and not yet answered, awaited by close().
        self._posted: set[asyncio.Future[bool]] = set()
        self._tasks: set[asyncio.Future[None]] = set()  # background sends, referenced
        # The last release sent the ordinary way: the next one goes after it (_release_later).
        self._last_ordinary: asyncio.Future[None] | None = None
        # The event loop the client's connections, the keeper and the coalescers belong to.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core.on_acquire = self._keep_alive
        keeper.track(self)

    def _make_coalescers(self) -> None:
        if self._coalesce:
            self._acquires = Coalescer(
                self._acquire_batch, self._release_orphan, self._write_acquires, self._alone
            )
            self._releases = Coalescer(self._release_batch)
            # None through a Cluster or Sentinel client (connection.direct_pool).
            pool = direct_pool(self._client)
            if pool is not None:
                self._pipe = Pipe(
                    pool, self._command, self._exec, self._refused, resends(self._client)
                )

    # -- the event loop --------------------------------------------------------------------

    def _bind(self) -> None:
        """Serve the running event loop. Connections, the keeper task and the coalescers'
        futures belong to one loop; a balancer used again from a new loop (a second
        ``asyncio.run()``) makes its client again from its URL and restarts its keeper there,
        so the leases taken on the old loop stay alive and releasable. A client passed in
        cannot be made again: once its loop is closed, every call refuses, before anything
        is sent (its connections died with that loop)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        old, self._loop = self._loop, loop
        if old is None:
            return
        if self._given_url is None:
            if old.is_closed():
                self._loop = old
                raise RedisRouterError(
                    f"balancer {self.name!r}: the redis client passed to this "
                    "AsyncRedisLoadBalancer served an event loop that is now closed, and its "
                    "connections closed with it; pass a URL instead (the balancer then makes "
                    "its own client on each event loop), or make a new balancer with a "
                    "client made on this loop"
                )
        else:
            # The old client's connections belong to the old loop; they cannot even be closed
            # from here and go with the old client.
            self._client = connect(
                self._given_url, asyncio=True, max_connections=self._max_connections
            )
            self._scripts = Sender(self._client)
        self._make_coalescers()
        self._last_ordinary = None  # the old loop's, if any, is not awaited from this one
        if self._setup is not None and not self._setup.done():
            self._setup = None  # it was left behind on the old loop: set up again
        self._keeper = None  # the old loop's keeper stops when it sees it is not wanted
        if self._core.held:
            self._keep_alive()  # leases taken on the old loop are kept alive from this one

    # -- driving the core ------------------------------------------------------------------

    async def _exec(self, call: Call) -> Any:
        """Send one script call, retrying as RedisLoadBalancer._exec does."""
        sentinel = sentinel_check_due(self._client)
        if sentinel is not None:
            with contextlib.suppress(rx.RedisError):  # the master may be fine; the call will tell
                await sentinel.get_master_address()
        for pause in (*TRANSIENT_BACKOFF, None):
            try:
                return await self._send(call)
            except (rx.ConnectionError, rx.TimeoutError, rx.ResponseError) as exc:
                error = send_failure(exc, self.url, self._core.script_error, pause is None)
                if error is not None:
                    raise error from None
            for pool in stale_pools(self._client):
                await pool.disconnect(inuse_connections=False)
            assert pause is not None  # the last try raised above
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send(self, call: Call) -> Any:
        return await self._scripts.send_async(call.script, self._core.prefix, call.args)

    def _refused(self, exc: Exception) -> Exception:
        """What a script's error reply raises (as _exec would raise it)."""
        return final_failure(exc, self.url, self._core.script_error)

    def _command(self, call: Call) -> tuple[Any, ...] | None:
        return self._scripts.command(call.script, self._core.prefix, call.args)

    async def _drive(self, op: Op[T], pipe: Pipe | None = None) -> T:
        send = self._exec if pipe is None else pipe.send
        try:
            call = next(op)
            while True:
                call = op.send(await send(call))
        except StopIteration as stop:
            result: T = stop.value
            return result
        finally:
            op.close()  # a failed call's operation still runs its cleanup, now

    async def _run(self, op: Op[T], ordered: bool = False) -> T:
        """Run an operation; ``ordered``: on the balancer's ordered connection, behind the
        releases written before it (when it has one)."""
        if self._core.closed:
            op.close()
            raise self._core.closed_error()
        self._bind()
        if not _succeeded(self._setup):
            await self._ensure_setup()
        return await self._drive(op, self._pipe if ordered else None)

    async def _call(self, op: Op[T]) -> T:
        """Run an operation after the releases this balancer has posted, so that it sees
        them (reads, pool changes: everything but the coalesced acquires and releases, which
        go out in the order they were made)."""
        if self._posted:
            posted = set(self._posted)
            await asyncio.wait(posted)
            for future in posted:
                error = None if future.cancelled() else future.exception()
                if type(error) is RedisUnavailable:
                    # Redis failed them just now (silent for a whole socket timeout, or
                    # unreachable): this call fails with them rather than wait as long again.
                    op.close()
                    raise RedisUnavailable(str(error))
        return await self._run(op)

    async def _ensure_setup(self) -> None:
        self._bind()
        if self._setup is None or (self._setup.done() and not _succeeded(self._setup)):
            self._setup = asyncio.ensure_future(self._set_up())
        await asyncio.shield(self._setup)

    async def _set_up(self) -> None:
        """Check the pinned settings (and register the initial servers). An asyncio Cluster
        client reaches its nodes only now, and says it cannot with a RedisClusterException:
        an outage like any other, so RedisUnavailable (the sync client fails in connect())."""
        initialize = getattr(self._client, "initialize", None)
        if initialize is not None and hasattr(self._client, "get_nodes"):
            try:
                await initialize()
            except (rx.RedisClusterException, rx.ConnectionError, rx.TimeoutError) as exc:
                raise unavailable(self.url, exc) from None
        await self._drive(self._core.setup(self._initial))
        if self._pipe is not None:  # releases are written at once from the first on
            await self._scripts.preload_async(self._core.release_script)
            await self._pipe.open()

    def _keep_alive(self) -> None:
        """Start (or restart, on another event loop) the heartbeat task: from the first
        acquire on, this process holds leases."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.ensure_future(
                keeper.keep_alive_async(weakref.ref(self), self._core.heartbeat_every)
            )

    def _forked(self) -> None:
        """In a forked child: a holder of its own; no task of the parent's loop runs here."""
        self._core.new_holder()
        self._keeper = None

    async def _acquire(
        self,
        request_ids: list[str],
        tokens: list[str] | None = None,
        fields: Sequence[Mapping[str, Any]] | None = None,
        *,
        args: Sequence[tuple[str, ...]] | None = None,
        ticket: str | None = None,
        exclude: tuple[str, ...] = (),
    ) -> list[Grant]:
        """Every acquire script call goes through here. It runs in a task of its own, shielded:
        cancelling the caller (``asyncio.wait_for`` while Redis is slow) leaves the call to
        finish on its connection, and the leases it granted are then released, never left
        counted. (Cancelled mid-reply, redis-py would drop the connection while the script
        may still run, and a release sent meanwhile on another connection could arrive first.)"""
        tokens = tokens or new_tokens(len(request_ids))
        op = self._core.acquire(
            request_ids, tokens, fields, args=args, ticket=ticket, exclude=exclude
        )
        call = asyncio.ensure_future(self._run(op))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(functools.partial(self._abandoned, request_ids, tokens))
            raise

    def _abandoned(
        self, request_ids: list[str], tokens: list[str], call: asyncio.Future[list[Grant]]
    ) -> None:
        """An acquire whose caller was cancelled has finished: release what it granted. If it
        failed on the way (the connection dropped), the script may have run all the same:
        release by token, which is a no-op for a lease that was never granted."""
        if call.cancelled():
            return
        error = call.exception()
        if error is None:
            for grant in call.result():
                self._post(grant.server_id, grant.request_id, grant.token)
        elif isinstance(error, RedisUnavailable):
            for rid, token in zip(request_ids, tokens, strict=True):
                self._post("", rid, token)

    async def _admit(self, op: Admission) -> list[Grant]:
        """Drive :func:`~redis_router.core.admit`: run each step, throw its error back in
        (a cancel included: a wait in the queue is left, then the cancel goes on)."""
        return await run_steps_async(op, self._step)

    async def _step(self, step: Step) -> Any:
        if isinstance(step, Attempt):
            return await self._acquire(*step[:3], ticket=step.ticket, exclude=step.exclude)
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
        elif isinstance(step, Block):
            await self._block(step.key, step.timeout)
        else:
            return await self._exec(step)
        return None

    async def _block(self, key: str, timeout: float) -> None:
        """BLPOP for at most ``timeout`` s (see RedisLoadBalancer._block)."""
        try:
            await self._client.blpop(
                [key], timeout=round(min(timeout, health.BLOCK_MAX), 3) or 0.001
            )
        except (rx.ConnectionError, rx.TimeoutError):
            await asyncio.sleep(min(timeout, TRANSIENT_BACKOFF[0]))

    # -- coalesced acquires and releases ---------------------------------------------------

    async def _acquire_one(
        self,
        request_id: str,
        token: str | None,
        fields: Mapping[str, Any],
        exclude: tuple[str, ...] = (),
    ) -> Grant:
        self._bind()
        if self._acquires is None or exclude:  # an exclusion is the call's: sent by itself
            tokens = [token] if token is not None else None
            per = [fields] if fields else None
            return (await self._acquire([request_id], tokens, per, exclude=exclude))[0]
        # The policy's arguments are made (and checked) here: bad fields fail their own
        # caller, never the batch it would have joined.
        args = self._core.request_args(request_id, fields)
        return await self._acquires.submit((request_id, token, args))

    def _alone(self) -> bool:
        """Whether an acquire may be written at once (:class:`Coalescer`'s ``lone``): a
        session's next request, made while the release of its last one, written alone, is
        still unanswered, this process holding no other lease and no release waiting to be
        written before it. (Calls made after a quiet spell, as a burst of many sessions is,
        wait for the loop's next turn and go as one batch.)"""
        freeing = self._freeing
        return (
            freeing is not None and not freeing.done() and not (self._core.held or self._outgoing)
        )

    def _write_acquires(
        self, items: list[_AcquireItem], done: Callable[[Outcomes[Grant]], None]
    ) -> bool:
        """The coalescer's ``write``: write a batch of acquires on the pipe now and hand
        ``done`` their outcomes from where the reply is read. False (the batch goes by
        :meth:`_acquire_batch`) when the pipe is not open or releases sent the ordinary way
        are still in flight (they go first)."""
        pipe = self._pipe
        if pipe is None or not pipe.ready or self._tasks or not _succeeded(self._setup):
            return False
        filled = _with_tokens(items)
        op = self._acquire_op(filled)
        # Releases still in _outgoing were posted after these acquires (those posted before
        # were written by their own callback, scheduled first): they go after, in order.
        call = next(op)
        handle = functools.partial(self._acquires_answered, op, call, filled, done)
        if not pipe.write_then(call, handle):
            op.close()
            return False
        return True

    def _acquires_answered(
        self,
        op: Op[list[Grant]],
        call: Call,
        items: list[_Filled],
        done: Callable[[Outcomes[Grant]], None],
        reply: Any,
    ) -> None:
        """A written batch's raw reply (see :meth:`_write_acquires`)."""
        if isinstance(reply, BaseException):
            assert self._pipe is not None  # only the pipe's calls are answered here
            error = self._pipe.failure(reply)
            if error is None:  # the call did not run, or may not have: the ordinary way
                self._later(self._acquires_again(op, call, items, done))
                return
            op.close()
            self._acquires_refused(items, done, error)
            return
        try:
            op.send(reply)
            raise RuntimeError("an acquire made a second call")  # pragma: no cover
        except StopIteration as stop:
            done(list(stop.value))
        except NoServersAvailable as exc:
            self._acquires_refused(items, done, exc)
        except Exception as exc:
            done(exc)
        finally:
            op.close()

    async def _acquires_again(
        self,
        op: Op[list[Grant]],
        call: Call,
        items: list[_Filled],
        done: Callable[[Outcomes[Grant]], None],
    ) -> None:
        try:
            reply = await self._exec(call)
        except Exception as exc:
            op.close()
            done(exc)
            return
        self._acquires_answered(op, call, items, done, reply)

    def _acquires_refused(
        self,
        items: list[_Filled],
        done: Callable[[Outcomes[Grant]], None],
        error: BaseException,
    ) -> None:
        """A batch refused whole: each request is tried by itself (:meth:`_one_by_one`)."""
        if len(items) == 1 or not isinstance(error, NoServersAvailable):
            done(error)
            return

        async def each() -> None:
            done(await self._one_by_one(items))

        self._later(each())

    async def _acquire_batch(self, items: list[_AcquireItem]) -> list[Grant | BaseException]:
        if self._tasks:  # releases sent the ordinary way (the pipe was not open) go first
            await asyncio.wait(set(self._tasks))
        filled = _with_tokens(items)
        try:
            # The flusher's own task: its callers' cancellations never reach it (the
            # coalescer releases what a cancelled caller was granted), so it needs no shield.
            return list(await self._run(self._acquire_op(filled), True))
        except NoServersAvailable:
            if len(items) == 1:
                raise
        return await self._one_by_one(filled)

    def _acquire_op(self, filled: list[_Filled]) -> Op[list[Grant]]:
        """One acquire call for a batch whose tokens are made."""
        return self._core.acquire(
            [rid for rid, _, _ in filled],
            [token for _, token, _ in filled],
            args=[a for _, _, a in filled],
        )

    async def _one_by_one(self, items: list[_Filled]) -> list[Grant | BaseException]:
        """A batch is refused whole when one request has nowhere to go; alone, a request
        sticky to a draining replica is still served, so each is tried by itself. Every
        outcome reaches its own caller: a grant is never lost to a later item's error."""
        outcomes: list[Grant | BaseException] = []
        for rid, token, a in items:
            try:
                outcomes.append((await self._acquire([rid], [token], args=[a]))[0])
            except RedisRouterError as exc:
                outcomes.append(exc)
        return outcomes

    def _release_orphan(self, _item: _AcquireItem, grant: Grant) -> None:
        """A caller was cancelled after its acquire was sent: end the lease it never got."""
        self._post(grant.server_id, grant.request_id, grant.token)

    def _post(
        self,
        server_id: str,
        request_id: str | None,
        token: str | None = None,
        failed: bool = False,
    ) -> AsyncReleased:
        """Queue a release now and let it be answered in the background; after close() a
        no-op whose result is False, as for the sync balancer."""
        if self._core.closed:
            return self._post_done(False)
        self._bind()
        future: asyncio.Future[bool]
        if self._pipe is not None and _succeeded(self._setup):
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            first = not self._outgoing
            self._outgoing.append(((server_id, request_id, token, failed), future))
            self._posted.add(future)  # until _settled(), where its outcome is taken
            if first:
                # Alone (this lease the only one held, no acquire waiting to be written
                # before it): written now, in the caller's step. Else on the next turn,
                # with every release posted until then.
                acquires = self._acquires
                if len(self._core.held) <= 1 and not (acquires is not None and acquires.queued):
                    self._freeing = future
                    self._write_releases()
                else:
                    loop.call_soon(self._write_releases)
            return AsyncReleased(future)
        if self._releases is None:
            future = asyncio.ensure_future(
                self._run(self._core.release(server_id, request_id, token, failed))
            )
        else:
            future = self._releases.put((server_id, request_id, token, failed))
        self._posted.add(future)
        future.add_done_callback(self._answered)
        return AsyncReleased(future)

    def _write_releases(self) -> None:
        """Write the releases posted since the last turn, in one call per MAX_BATCH; what the
        pipe cannot write now goes the ordinary way, in order."""
        outgoing, self._outgoing = self._outgoing, []
        for at in range(0, len(outgoing), MAX_BATCH):
            chunk = outgoing[at : at + MAX_BATCH]
            futures = [future for _, future in chunk]
            op = self._release_many([item for item, _ in chunk])
            try:
                call = next(op)  # the ledger's part: the leases are `releasing` from now
            except BaseException as exc:
                op.close()
                _settle_all(futures, None, exc)
                self._settled(futures)
                continue
            pipe = self._pipe
            handle = functools.partial(self._release_answered, op, call, futures)
            last = self._last_ordinary
            if (
                pipe is None
                or (last is not None and not last.done())  # releases before it go first
                or not pipe.write_then(call, handle)
            ):
                self._release_later(op, call, futures)

    def _release_answered(
        self, op: Op[list[bool]], call: Call, futures: list[asyncio.Future[bool]], reply: Any
    ) -> None:
        if isinstance(reply, BaseException):
            if isinstance(reply, rx.TimeoutError):
                # Redis silent for a socket timeout: failed (reconciliation ends the lease
                # once Redis is back), not resent to wait as long again.
                op.close()
                _settle_all(futures, None, self._refused(reply))
                self._settled(futures)
                return
            # A broken connection, or an error reply: sent again the ordinary way (the
            # release's operation ids make a second copy end nothing more).
            self._release_later(op, call, futures)
            return
        _released(op, reply, futures)
        self._settled(futures)

    def _release_later(
        self, op: Op[list[bool]], call: Call, futures: list[asyncio.Future[bool]]
    ) -> None:
        """Send a release the ordinary way once every release sent that way before it has
        been answered. The client's pooled connections keep no order between them, and the
        releases of one process must reach Redis in the order they were made, as on the pipe:
        of two releases of one lease (by token, then by replica), the first ends it, and when
        the pipe's connection breaks with both unanswered, both are sent again this way."""
        before = self._last_ordinary

        async def in_turn() -> None:
            if before is not None and not before.done():
                await asyncio.wait({before})
            await self._release_ordinary(op, call, futures)

        self._last_ordinary = self._later(in_turn())

    async def _release_ordinary(
        self, op: Op[list[bool]], call: Call, futures: list[asyncio.Future[bool]]
    ) -> None:
        try:
            if not _succeeded(self._setup):
                await self._ensure_setup()
            reply = await self._exec(call)
        except Exception as exc:
            op.close()
            _settle_all(futures, None, exc)
            self._settled(futures)
            return
        _released(op, reply, futures)
        self._settled(futures)

    def _later(self, work: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _post_done(self, result: bool) -> AsyncReleased:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return AsyncReleased(future)

    def _settled(self, futures: list[asyncio.Future[bool]]) -> None:
        """Releases written on the pipe were answered: :meth:`_answered` for each, there and
        then rather than by a callback on the next loop turn."""
        for future in futures:
            self._answered(future)

    def _answered(self, future: asyncio.Future[bool]) -> None:
        """A posted release was answered. One that failed (Redis unreachable) is left to the
        keeper's reconciliation, which ends the lease once Redis is back; its error is
        taken here so that asyncio does not report it as never retrieved."""
        self._posted.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.debug("a release nobody awaited failed: %s", future.exception())

    def _release_many(self, items: list[_ReleaseItem]) -> Op[list[bool]]:
        """One release call for queued releases (health marks only when one failed)."""
        releases = [(sid, rid, token) for sid, rid, token, _ in items]
        failed = [bad for *_, bad in items] if any(bad for *_, bad in items) else None
        return self._core.release_many(releases, failed)

    async def _release_batch(self, items: list[_ReleaseItem]) -> list[bool | BaseException]:
        return list(await self._run(self._release_many(items), True))

    # -- routing ---------------------------------------------------------------------------

    async def acquire_server(
        self,
        request_id: str,
        *,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> tuple[str, Any]:
        """Route a request (see RedisLoadBalancer.acquire_server). Returns (id, handle)."""
        rid = validation.request_id(request_id)
        excl = self._core.check_acquire(fields, exclude)
        g = await self._acquire_waiting(rid, None, fields, wait, excl)
        return g.server_id, g.handle

    async def acquire_many(
        self, request_ids: list[str], *, wait: float | None = None, **fields: Any
    ) -> list[tuple[str, Any]]:
        """Route many requests in one round trip (see RedisLoadBalancer.acquire_many)."""
        rids = validation.request_ids(request_ids)
        self._core.check_acquire(fields)
        per = fields_per_request(len(rids), fields)
        budget = None if wait is None else health.wait_seconds(wait)
        started = time.monotonic()
        try:
            grants = await self._acquire(rids, None, per)
        except NoCapacity as refused:  # reclaim, wait: core.admit decides
            grants = await self._admit(admit(self._core, refused, rids, per, budget, started))
        return [(g.server_id, g.handle) for g in grants]

    async def acquire(
        self,
        request_id: str,
        *,
        token: str | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> AsyncLease:
        """Route a request and return its lease (``token``, ``wait``, ``exclude``: see
        RedisLoadBalancer.acquire)."""
        rid = validation.request_id(request_id)
        checked = validation.token(token) if token is not None else None
        excl = self._core.check_acquire(fields, exclude)
        return AsyncLease(self, await self._acquire_waiting(rid, checked, fields, wait, excl))

    async def _acquire_waiting(
        self,
        rid: str,
        token: str | None,
        fields: Mapping[str, Any],
        wait: float | None,
        exclude: tuple[str, ...] = (),
    ) -> Grant:
        budget = None if wait is None else health.wait_seconds(wait)
        started = time.monotonic()
        try:
            return await self._acquire_one(rid, token, fields, exclude)
        except NoCapacity as refused:  # reclaim, wait: core.admit decides
            tokens = [token] if token is not None else None
            op = admit(self._core, refused, [rid], [fields], budget, started, tokens, exclude)
            return (await self._admit(op))[0]

    @contextlib.asynccontextmanager
    async def lease(
        self,
        request_id: str,
        *,
        renew_every: float | None = None,
        wait: float | None = None,
        exclude: Collection[str] | None = None,
        **fields: Any,
    ) -> AsyncIterator[AsyncLease]:
        """``async with lb.lease(rid) as lease:`` releases exactly once, also on cancellation
        (a lease granted while the task was being cancelled is released, not leaked)."""
        if renew_every is not None:
            validation.seconds(renew_every, "renew_every", validation.MAX_LEASE_TTL)
        pending = asyncio.ensure_future(
            self.acquire(request_id, wait=wait, exclude=exclude, **fields)
        )
        try:
            held = await asyncio.shield(pending)
        except asyncio.CancelledError:
            pending.add_done_callback(_release_when_granted)
            raise
        stop = asyncio.Event()
        renewer = (
            asyncio.ensure_future(_renew_age(held, stop, renew_every)) if renew_every else None
        )
        try:
            yield held
        finally:
            try:
                if renewer is not None:
                    stop.set()
                    renewer.cancel()
                    await asyncio.wait({renewer})  # a cancel of this task still propagates
            finally:
                held.release()  # answered in the background

    def release_server(
        self,
        server_id: str,
        request_id: str | None = None,
        *,
        failed: bool = False,
        **fields: Any,
    ) -> AsyncReleased:
        """End the request's lease on that replica (without request_id: this process's own
        lease there, else the replica's oldest), without waiting for Redis: the release is
        queued at once, ahead of every later call of this balancer, and answered in the
        background. ``await`` what this returns for the result (True if a lease ended); the
        release goes out whether or not anyone awaits it, and close() waits for it.
        ``failed=True``: the request failed (see RedisLoadBalancer.release_server). After
        close(), a no-op whose result is False (see RedisLoadBalancer.close)."""
        sid, rid, bad = validation.release(server_id, request_id, failed)
        return self._post(sid, rid, None, bad)

    # A plain method whose result is awaited: helpers that run blocking methods in a thread
    # (redis_router.client.call) must call it on the event loop.
    release_server.returns_awaitable = True  # type: ignore[attr-defined]

    # -- the pool --------------------------------------------------------------------------

    async def add_servers(
        self, servers: Mapping[str, Any], *, capacity: Mapping[str, int] | None = None
    ) -> int:
        """See RedisLoadBalancer.add_servers."""
        return await self._call(self._core.add_servers(servers, capacity))

    async def remove_servers(self, server_ids: list[str]) -> int:
        return await self._call(self._core.remove_servers(server_ids))

    async def drain_servers(self, server_ids: list[str]) -> int:
        return await self._call(self._core.set_draining(server_ids, True))

    async def undrain_servers(self, server_ids: list[str]) -> int:
        return await self._call(self._core.set_draining(server_ids, False))

    async def get_all_servers(self) -> list[str]:
        return sorted(await self._call(self._core.counts()))

    async def get_inflight_count(self, server_id: str) -> int:
        """See RedisLoadBalancer.get_inflight_count."""
        return await self._call(self._core.inflight(server_id))

    async def get_total_inflight(self) -> int:
        return sum((await self._call(self._core.counts())).values())

    async def report_engine_load(self, loads: Mapping[str, EngineLoad]) -> int:
        """See RedisLoadBalancer.report_engine_load."""
        return await self._call(self._core.report_engine(loads))

    async def get_status(self) -> dict[str, Any]:
        return await self._call(self._core.status())

    async def request_owner(self, request_id: str) -> str | None:
        """See RedisLoadBalancer.request_owner."""
        return await self._call(self._core.request_owner(request_id))

    async def bump_weight_version(self, *, sticky: bool = False) -> dict[str, int]:
        """See RedisLoadBalancer.bump_weight_version."""
        return await self._call(self._core.bump_weight_version(sticky))

    async def end_session(self, *request_ids: str) -> int:
        """See RedisLoadBalancer.end_session."""
        return await self._call(self._core.end_sessions(list(request_ids)))

    async def clear_sticky_cache(self) -> dict[str, Any]:
        """See RedisLoadBalancer.clear_sticky_cache."""
        return await self._call(self._core.clear_sticky())

    async def reap(self) -> int:
        return await self._call(self._core.reap())

    async def destroy(self) -> int:
        return await self._call(self._core.destroy())

    # -- lifetime --------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the heartbeats, end unreleased leases at once, close the pool if
        this balancer made it. Afterwards calls fail as RedisLoadBalancer.close says."""
        try:
            self._bind()
        except RedisRouterError:  # a client passed in, whose loop closed: nothing can be sent
            self._keeper = None
            self._core.closed = True
            return
        if self._posted:  # releases not yet answered go first (bounded)
            await asyncio.wait(set(self._posted), timeout=KEEPER_STOP_TIMEOUT)
        stopping, self._keeper = self._keeper, None
        if stopping is not None:
            stopping.cancel()
            if stopping.get_loop() is asyncio.get_running_loop():
                # Bounded: a heartbeat stuck in a dead connection must not hold up close().
                await asyncio.wait({stopping}, timeout=KEEPER_STOP_TIMEOUT)
            try:
                await self._run(self._core.retire())
            except (RedisRouterError, rx.RedisError) as exc:
                keeper.report_close_failed(self._core, exc)
        self._core.closed = True
        if self._pipe is not None:
            await self._pipe.close()
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncRedisLoadBalancer:
        await self._ensure_setup()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _with_tokens(items: list[_AcquireItem]) -> list[_Filled]:
    """The items, each with its token: its earlier attempt's, or a new one."""
    if len(items) == 1:  # the common case, without loops
        rid, token, a = items[0]
        return [(rid, token if token is not None else new_token(), a)]
    fresh = iter(new_tokens(len(items)))
    return [(rid, token if token is not None else next(fresh), a) for rid, token, a in items]


def _succeeded(setup: asyncio.Future[None] | None) -> bool:
    """The settings were pinned (a failed or cancelled setup is tried again on the next call)."""
    return setup is not None and setup.done() and not setup.cancelled() and not setup.exception()


def _released(op: Op[list[bool]], reply: Any, futures: list[asyncio.Future[bool]]) -> None:
    """Hand a release call its reply and each release its outcome."""
    try:
        op.send(reply)
    except StopIteration as stop:
        _settle_all(futures, stop.value, None)
    except Exception as exc:
        _settle_all(futures, None, exc)
    finally:
        op.close()


def _settle_all(
    futures: list[asyncio.Future[bool]], results: list[bool] | None, error: BaseException | None
) -> None:
    for k, future in enumerate(futures):
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            assert results is not None
            future.set_result(results[k])


def _release_when_granted(task: asyncio.Future[AsyncLease]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().release()  # answered in the background


async def _renew_age(lease: AsyncLease, stop: asyncio.Event, every: float) -> None:
    """Renew every ``every`` seconds until ``stop``; checked after every await, since a cancel
    can be lost before Python 3.12 (see keeper.keep_alive_async)."""
    while not stop.is_set():
        await asyncio.sleep(every)
        if stop.is_set():
            return
        with contextlib.suppress(RedisUnavailable):  # try again next period
            if not await lease.renew():
                return
