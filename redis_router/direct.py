"""An asyncio balancer's ordered connection: its acquires and releases, written at once.

A release need not wait for its reply, and a later call of the same process must still reach
Redis after it (the place it freed is there for the next acquire). Two connections do not
order their writes with each other, even on loopback (a process that moves to another CPU
between two writes may see the second arrive first), so the balancer writes its coalesced
acquires and its releases on one connection of its own, in the order they are made, and one
reader task takes the replies in that order. That connection also skips what redis-py's
client does per command (pool checkout and return, retry wrapper, bookkeeping), which costs an
asyncio worker more than the script itself.

With hiredis installed, the replies are not read by a task either: once the connection is open
and authenticated (by redis-py, TLS and all), its transport is handed to a protocol that feeds
each chunk the event loop receives to hiredis's reader and settles the waiting calls there and
then. A reply then wakes its caller on the next turn of the loop, where a reader task costs
a turn of its own and redis-py's stream, timeout and parser layers (a no-op script's round trip:
~40-70 us this way, against ~160-190 us through redis-py's asyncio client, on this machine).
A call unanswered for the client's socket timeout breaks the connection, as a read would.

A script's own refusal (NOCAPACITY, ...) is raised as the ordinary path raises it. A reply
proving the call did not run (a missing script, READONLY after a failover), a broken
connection or a timeout sends the call again the ordinary way, through the client, which
loads what is missing and retries: every call is safe to resend (an acquire carries its lease
tokens, a release its operation ids). A broken connection, or a server that is the wrong one
for now (READONLY), costs the pipe its connection; the next write opens another.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis import exceptions as rx

from .connection import transient
from .core import Call
from .invoke import unsent

hiredis: Any = None
with contextlib.suppress(ImportError):  # the [hiredis] extra; without it a task reads
    import hiredis as _hiredis

    hiredis = _hiredis

log = logging.getLogger("redis_router")

# What waits for a written call's reply: a future, or a function called with it.
_Waiter = asyncio.Future[Any] | Callable[[Any], None]


class Pipe:
    """Script calls written in order on one connection; replies read in order by one task.

    ``command(call)`` is the command to write (None: send it the ordinary way);
    ``ordinary(call)`` sends a call through the client; ``refused(exc)`` is what to raise for
    an error reply of the script's own (or a broken connection, when ``resends`` is False:
    the client was made without retries, and a call whose connection broke is not sent
    again)."""

    def __init__(
        self,
        pool: Any,
        command: Callable[[Call], tuple[Any, ...] | None],
        ordinary: Callable[[Call], Awaitable[Any]],
        refused: Callable[[Exception], Exception],
        resends: bool = True,
    ) -> None:
        self._pool, self._command = pool, command
        self._ordinary, self._refused = ordinary, refused
        self._resends = resends
        self._conn: Any = None
        self._pending: collections.deque[_Waiter] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self._reader: asyncio.Future[None] | None = None
        self._opening: asyncio.Future[None] | None = None
        self._replies: _Replies | None = None  # the connection's protocol, with hiredis
        self._closed = False

    # -- writing ---------------------------------------------------------------------------

    def write(self, call: Call) -> asyncio.Future[Any] | None:
        """Write the call now; the future of its raw reply (an error reply, or a broken
        connection, as its exception), or None when the pipe cannot write now (not open,
        broken, closed, or no direct command): send it the ordinary way then."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        return future if self._write(call, future) else None

    def write_then(self, call: Call, handle: Callable[[Any], None]) -> bool:
        """Write the call now and have ``handle`` called with its raw reply (as :meth:`write`'s
        future would hold it) as soon as it is read, by whatever reads it: no task or future
        stands between the reply and its use. False, and ``handle`` is never called, when the
        pipe cannot write now."""
        return self._write(call, handle)

    def _write(self, call: Call, waiter: _Waiter) -> bool:
        conn = self._conn
        if conn is None:
            self._open_soon()
            return False
        command = self._command(call)
        if command is None:
            return False
        try:
            conn.write_now(conn.pack_command(*command))
        except Exception:  # perhaps written: a resend is safe either way
            self._broken(rx.ConnectionError("the balancer's connection failed"))
            return False
        self._pending.append(waiter)
        if self._replies is not None:
            self._replies.written()
        else:
            wake = self._wake
            if wake is not None and not wake.done():
                wake.set_result(None)
        return True

    @property
    def ready(self) -> bool:
        """Whether a write now goes on the pipe's connection (else it opens one meanwhile)."""
        return self._conn is not None and not self._closed

    @property
    def resends(self) -> bool:
        """Whether a call whose connection broke is sent again the ordinary way."""
        return self._resends

    async def send(self, call: Call) -> Any:
        """The call's reply (written in order; sent the ordinary way when it cannot be)."""
        future = self.write(call)
        if future is None:
            return await self._ordinary(call)
        try:
            return await future
        except Exception as exc:
            error = self.failure(exc)
            if error is exc:
                raise
            if error is not None:
                raise error from None
        return await self._ordinary(call)

    def failure(self, exc: BaseException) -> BaseException | None:
        """What a call whose raw reply is ``exc`` raises; None when it did not run, or may
        not have, and goes again the ordinary way (every call is safe to resend)."""
        if isinstance(exc, rx.ResponseError):
            return None if unsent(exc) else self._refused(exc)  # else the script's refusal
        if isinstance(exc, rx.TimeoutError):
            # Redis was silent a whole socket timeout: a resend would wait as long again.
            return self._refused(exc)
        if isinstance(exc, (rx.RedisError, OSError)):
            if self._resends:
                return None
            # a client made without retries sees the failure
            return self._refused(rx.ConnectionError(str(exc)))
        return exc

    @property
    def unanswered(self) -> int:
        """Calls written whose reply has not been read."""
        return len(self._pending)

    # -- the connection and its reader -----------------------------------------------------

    def _open_soon(self) -> None:
        if self._closed or (self._opening is not None and not self._opening.done()):
            return
        self._opening = asyncio.ensure_future(self.open())

    async def open(self) -> None:
        """Take the connection (no error: while Redis is unreachable, calls go the ordinary
        way, which says so, and a later write tries again)."""
        if self._conn is not None or self._closed:
            return
        try:
            conn = await _connection(self._pool)
        except Exception:
            return
        if _ended(conn):
            # The server closed it while it sat in the pool and its stream has taken the end:
            # that transport no longer reads, so a protocol put in its place would never hear
            # of it, and calls written there would wait a whole socket timeout. Open it again.
            try:
                await conn.disconnect()
                await conn.connect()
            except Exception:
                await _discard(self._pool, conn)
                return
        if not callable(getattr(conn, "write_now", None)) or self._closed or self._conn:
            # A connection class without a synchronous write (a client passed in, whose pool
            # the balancer did not make): calls keep the ordinary path.
            self._closed = self._closed or self._conn is None
            with contextlib.suppress(Exception):
                await self._pool.release(conn)
            return
        self._conn = conn
        self._replies = _Replies.install(self, conn)
        if self._replies is None:
            self._reader = asyncio.ensure_future(self._read(conn))

    async def _read(self, conn: Any) -> None:
        pending = self._pending
        while self._conn is conn:
            if not pending:
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
                continue
            try:
                reply: Any = await conn.read_response()
            except rx.ResponseError as exc:
                reply = exc
                if transient(exc):  # READONLY: the later calls go the ordinary way too
                    self._settle(pending.popleft(), reply)
                    self._broken(exc)
                    return
            except asyncio.CancelledError:
                self._broken(rx.ConnectionError("the balancer's reader was stopped"))
                raise
            except Exception as exc:
                self._broken(exc)
                return
            self._settle(pending.popleft(), reply)

    def _replied(self, conn: Any, reply: Any) -> None:
        """A reply read for ``conn`` by its protocol (in the order the calls were written)."""
        if self._conn is not conn:
            return
        if not self._pending:  # a reply nothing asked for: the stream is not what we think
            self._broken(rx.ConnectionError("a reply came that no call was waiting for"))
            return
        self._settle(self._pending.popleft(), reply)
        if isinstance(reply, rx.ResponseError) and transient(reply):
            self._broken(reply)  # READONLY: the later calls go the ordinary way too

    def _lost(self, conn: Any, exc: BaseException) -> None:
        if self._conn is conn:
            self._broken(exc)

    @staticmethod
    def _settle(waiter: _Waiter, reply: Any) -> None:
        if not isinstance(waiter, asyncio.Future):
            try:
                waiter(reply)
            except Exception:  # a handler's own failure must not stop the replies after it
                log.exception("redis-router: handling a reply failed")
            return
        if waiter.done():
            return
        if isinstance(reply, BaseException):
            waiter.set_exception(reply)
        else:
            waiter.set_result(reply)

    def _broken(self, exc: BaseException) -> None:
        """Fail every unanswered call (its owner sends it again the ordinary way) and drop
        the connection; the next write opens a new one."""
        conn, self._conn = self._conn, None
        self._replies = None
        pending, self._pending = self._pending, collections.deque()
        for future in pending:
            self._settle(future, exc)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)  # a reader waiting for work sees its connection is gone
        if conn is not None:
            task = asyncio.ensure_future(_discard(self._pool, conn))
            _discarding.add(task)
            task.add_done_callback(_discarding.discard)

    async def close(self) -> None:
        """Stop the reader (callers have had their replies) and give the connection back."""
        self._closed = True
        conn = self._conn
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        if conn is not None and self._conn is conn:  # not broken meanwhile
            self._conn = None
            if self._replies is not None:  # its transport is ours now: closed, not reused
                self._replies = None
                await _discard(self._pool, conn)
                return
            with contextlib.suppress(Exception):
                await self._pool.release(conn)


class _Replies(asyncio.Protocol):
    """The pipe's connection's protocol once redis-py has opened it: hiredis parses what
    arrives and each reply settles its call at once (no reader task). Flow control and the
    end of the connection are passed on to redis-py's own protocol, so its writer and its
    disconnect() work as before."""

    def __init__(self, pipe: Pipe, conn: Any, old: Any, reader: Any, timeout: float | None):
        self._pipe, self._conn, self._old, self._reader = pipe, conn, old, reader
        self._timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        # Since when (monotonic) the oldest unanswered call has waited with nothing heard:
        # its write, or the latest bytes to arrive after it.
        self._since = 0.0

    @classmethod
    def install(cls, pipe: Pipe, conn: Any) -> _Replies | None:
        """Take over ``conn``'s transport; None (the pipe reads with a task) without hiredis
        or a transport that cannot change its protocol."""
        writer = getattr(conn, "_writer", None)
        transport = getattr(writer, "transport", None)
        parser: Any = getattr(conn, "_parser", None)
        if hiredis is None or transport is None or not hasattr(transport, "set_protocol"):
            return None
        if not callable(getattr(parser, "parse_error", None)):
            return None
        options: dict[str, Any] = {"replyError": parser.parse_error}
        encoder: Any = getattr(conn, "encoder", None)
        if getattr(encoder, "decode_responses", False):
            options.update(encoding=encoder.encoding, errors=encoder.encoding_errors)
        try:
            reader = hiredis.Reader(protocolError=rx.InvalidResponse, **options)
        except TypeError:  # an older hiredis without these keywords
            return None
        replies = cls(pipe, conn, transport.get_protocol(), reader, conn.socket_timeout)
        transport.set_protocol(replies)
        return replies

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        self._since = time.monotonic()
        while True:
            try:
                reply = reader.gets()
            except Exception as exc:  # a protocol error: the stream cannot be trusted
                self._pipe._lost(self._conn, rx.ConnectionError(str(exc)))
                return
            if reply is False:
                return
            self._pipe._replied(self._conn, reply)

    def written(self) -> None:
        """A call was written: make sure someone notices if no reply comes within the
        socket timeout (counted from its write, or from the last bytes heard after it)."""
        if len(self._pipe._pending) == 1:  # nothing was waiting: the wait starts now
            self._since = time.monotonic()
        if self._timer is None and self._timeout:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._timeout, self._look)

    def _look(self) -> None:
        self._timer = None
        pipe = self._pipe
        if pipe._conn is not self._conn or not pipe._pending or not self._timeout:
            return
        left = self._since + self._timeout - time.monotonic()
        if left <= 0:  # nothing arrived for a whole timeout with calls waiting
            pipe._lost(self._conn, rx.TimeoutError("Timeout reading from socket"))
            return
        self._timer = asyncio.get_running_loop().call_later(left, self._look)

    def eof_received(self) -> bool | None:
        return False  # let the transport close: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._pipe._lost(self._conn, rx.ConnectionError(f"Connection closed by server. {exc}"))
        self._old.connection_lost(exc)

    def pause_writing(self) -> None:
        self._old.pause_writing()

    def resume_writing(self) -> None:
        self._old.resume_writing()


async def _connection(pool: Any) -> Any:
    """A connection of the pool's for the pipe (redis-py before 6 names a command)."""
    try:
        conn = await pool.get_connection()
    except TypeError:
        conn = await pool.get_connection("EVALSHA")
    return conn


def _ended(conn: Any) -> bool:
    """Whether ``conn``'s stream has ended (or failed, or holds bytes no call asked for)."""
    reader, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
    if reader is None or writer is None:
        return False  # not connected: its first command connects it
    return bool(
        writer.transport.is_closing()
        or reader.at_eof()
        or reader.exception() is not None
        or getattr(reader, "_buffer", None)
    )


_discarding: set[asyncio.Future[None]] = set()  # closes in progress, referenced until done


async def _discard(pool: Any, conn: Any) -> None:
    """Close a connection whose state is unknown and give it back, closed."""
    with contextlib.suppress(Exception):
        await conn.disconnect(nowait=True)
    with contextlib.suppress(Exception):
        await pool.release(conn)
