"""Coalescing: concurrent calls of one asyncio balancer share round trips.

A rollout worker runs many sessions in one event loop. Sent one by one, their acquires and
releases each pay a round trip and redis-py's per-command cost, and the process, not Redis,
becomes the bottleneck. A :class:`Coalescer` sends a call on the event loop's next turn,
together with every call made before then; calls made while that batch is in flight go in the
next one (acquire.lua and release.lua take many requests, with the result of running them one
after another in arrival order). Nothing waits for a timer, a lone call costs one loop turn,
and under load one round trip serves every session that is ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

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
    ) -> None:
        self._send, self._orphan = send, orphan
        self._queue: list[tuple[Item, asyncio.Future[Result]]] = []
        self._flusher: asyncio.Future[None] | None = None

    async def submit(self, item: Item) -> Result:
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch = [(i, f) for i, f in self._queue[:MAX_BATCH] if not f.cancelled()]
                del self._queue[:MAX_BATCH]
                if batch:
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
        for (item, fut), outcome in zip(batch, outcomes, strict=True):
            if fut.cancelled():
                if self._orphan is not None and not isinstance(outcome, BaseException):
                    self._orphan(item, outcome)
            elif isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)
