"""Coalescing: concurrent calls of one asyncio balancer share round trips.

A rollout worker runs many sessions in one event loop. Sent one by one, their acquires and
releases each pay a round trip and redis-py's per-command cost, and the process, not Redis,
becomes the bottleneck. A :class:`Coalescer` sends a call on the event loop's next turn,
together with every call made before then; calls made while that batch is in flight go in the
next one (acquire.lua and release.lua take many requests, with the result of running them one
after another in arrival order). Nothing waits for a timer, a lone call costs one loop turn,
and under load one round trip serves every session that is ready.

Given a ``write`` (the asyncio balancer's ordered connection, redis_router.direct), a batch is
written by a plain callback rather than a task, its outcomes are handed back from where its
reply is read, and the next batch is written there and then: no task step stands between a
call, its round trip and its caller.

A call made while its process looks alone (``lone()``: for the balancer, a session's next
request, right after the release of its last one, with no other lease held) is written at
once, in its caller's own step, without the loop turn a batch waits for: a worker with one
session pays no coalescing. Only one such call is in flight at a time, and it does not hold
back the batch after it: calls made in the same turn go out on the next one, as they would
have, one script call more.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

# ``write(items, done)`` writes one batch now and returns True, having arranged for ``done``
# to be called once with one outcome per item (or an exception for all of them); or returns
# False, and ``done`` is never called: the batch goes by ``send`` instead.
Outcomes = list[Result | BaseException] | BaseException

# Calls per script call: well under the batch limit, and short enough that one batch never
# holds the server for long.
MAX_BATCH = 256


class Coalescer(Generic[Item, Result]):
    """Runs ``send(items)`` for queued items, one batch at a time, in arrival order.

    ``send`` returns one outcome per item: its result, or an exception for that item alone.
    An exception raised by ``send`` fails the whole batch. A caller cancelled before its batch
    is sent is left out; one cancelled after gets its result passed to ``orphan`` (an
    acquire's lease is released there, never leaked).
    """

    def __init__(
        self,
        send: Callable[[list[Item]], Awaitable[list[Result | BaseException]]],
        orphan: Callable[[Item, Result], None] | None = None,
        write: Callable[[list[Item], Callable[[Outcomes[Result]], None]], bool] | None = None,
        lone: Callable[[], bool] | None = None,
    ) -> None:
        self._send, self._orphan, self._write = send, orphan, write
        self._lone = lone
        self._queue: list[tuple[Item, asyncio.Future[Result]]] = []
        self._flusher: asyncio.Future[None] | None = None
        # A batch written by ``write`` is in flight, or its write is scheduled.
        self._writing = False
        # A call written at once (``lone``) is in flight.
        self._alone = False

    @property
    def queued(self) -> bool:
        """Whether calls wait to be written (a later call that must follow them waits too)."""
        return bool(self._queue)

    async def submit(self, item: Item) -> Result:
        """``item``'s outcome. A caller cancelled after its outcome was set (the reply came
        in the same loop turn as the cancel) gets its CancelledError, and its result goes to
        ``orphan``, as one cancelled while waiting does."""
        fut = self.put(item)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                if self._orphan is not None:
                    self._orphan(item, fut.result())
            else:
                fut.cancel()  # still queued or in flight: _settle hands it to orphan
            raise

    def put(self, item: Item) -> asyncio.Future[Result]:
        """Queue ``item`` now (in arrival order with every other call) and return the future
        of its outcome, for a caller that need not wait for it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Result] = loop.create_future()
        if (
            self._lone is not None
            and not (self._alone or self._writing or self._queue or self._flusher)
            and self._lone()
            and self._write_alone(item, fut)
        ):
            return fut
        self._queue.append((item, fut))
        if self._flusher is None and not self._writing:
            if self._write is not None:
                self._writing = True
                loop.call_soon(self._write_next)
            else:
                self._flusher = asyncio.ensure_future(self._flush())
        return fut

    def _write_alone(self, item: Item, fut: asyncio.Future[Result]) -> bool:
        """Write one call now, outside the batches; False when ``write`` cannot."""
        assert self._write is not None
        one = [(item, fut)]
        try:
            if not self._write([item], functools.partial(self._written_alone, one)):
                return False
        except Exception as exc:  # the call's own failure: its caller gets it
            self._settle(one, [exc])
            return True
        self._alone = True
        return True

    def _written_alone(
        self, one: list[tuple[Item, asyncio.Future[Result]]], outcomes: Outcomes[Result]
    ) -> None:
        self._alone = False
        self._settle(one, [outcomes] if isinstance(outcomes, BaseException) else outcomes)

    def _write_next(self) -> None:
        """Write the next batch with ``write``; when it cannot, the task flusher sends it."""
        assert self._write is not None
        batch = self._take()
        if not batch:
            self._writing = False
            return
        done = functools.partial(self._written, batch)
        try:
            if self._write([item for item, _ in batch], done):
                return
        except Exception as exc:  # the batch's own failure: its callers get it
            self._written(batch, exc)
            return
        self._writing = False
        self._queue[:0] = batch  # first in line again, for the flusher
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())

    def _written(
        self, batch: list[tuple[Item, asyncio.Future[Result]]], outcomes: Outcomes[Result]
    ) -> None:
        if isinstance(outcomes, BaseException):
            outcomes = [outcomes] * len(batch)
        self._settle(batch, outcomes)
        self._writing = False
        if self._queue and self._flusher is None:  # the calls made meanwhile: now
            self._writing = True
            self._write_next()

    def _take(self) -> list[tuple[Item, asyncio.Future[Result]]]:
        """The next batch of callers still waiting (empty when none is left)."""
        while self._queue:
            batch = [(i, f) for i, f in self._queue[:MAX_BATCH] if not f.cancelled()]
            del self._queue[:MAX_BATCH]
            if batch:
                return batch
        return []

    async def _flush(self) -> None:
        try:
            while batch := self._take():
                await self._run(batch)
        finally:
            self._flusher = None
            for _, fut in self._queue:  # only when the flusher itself was cancelled
                fut.cancel()
            self._queue.clear()

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            outcomes = await self._send([item for item, _ in batch])
        except asyncio.CancelledError:
            for _, fut in batch:
                fut.cancel()
            raise
        except Exception as exc:
            outcomes = [exc] * len(batch)
        self._settle(batch, outcomes)

    def _settle(
        self,
        batch: list[tuple[Item, asyncio.Future[Result]]],
        outcomes: list[Result | BaseException],
    ) -> None:
        for (item, fut), outcome in zip(batch, outcomes, strict=True):
            if fut.cancelled():
                if self._orphan is not None and not isinstance(outcome, BaseException):
                    self._orphan(item, outcome)
            elif isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)
