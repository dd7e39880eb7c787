"""Releases off the critical path of a sync balancer.

A release's caller does not need its reply to go on: the replica is free for the next request
as soon as the release is in Redis's hands. An :class:`Outbox` writes a release at once, on a
connection of the balancer's own, and reads its reply later: when a later call of the balancer
goes out (it is written on the same connection, behind the releases, so Redis runs them in the
order the process made them, and one round trip answers all), when someone asks for the
result, or, at the latest, from a background thread ``BOUND`` seconds after it was written.
Until its reply is read the lease is in the balancer's ``releasing`` set (``reconcile()``
leaves it alone), and at ``close()`` or process exit every reply is read first.

Anything other than a plain reply sends the call again the ordinary way (redis-py's client,
which loads a missing script and retries a dropped connection): a resent release carries its
operation id and a resent acquire its lease token, so a second copy changes nothing.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from redis import exceptions as rx

from .connection import transient
from .core import Call, Op
from .errors import PoolExhausted, RedisUnavailable

log = logging.getLogger("redis_router")

T = TypeVar("T")
# Seconds a written call may wait for its reply to be read when the process makes no other
# call: the background reader's period.
BOUND = 0.002
# Seconds after the latest written call during which the reader keeps looking every BOUND by
# itself; after that it sleeps until a post wakes it, IDLE seconds at most.
LINGER = 0.01
IDLE = 1.0
# Seconds close() and process exit wait for the replies of written calls.
DRAIN_TIMEOUT = 5.0
# Seconds the reader waits at most for a late reply's bytes before it looks again.
POLL = 0.05

_ERRORS = (rx.RedisError, OSError)


class Released(Generic[T]):
    """The outcome of a call whose reply is read later: ``result()`` waits for it (bounded by
    the client's socket timeout); ``bool(released)`` is ``result()``'s truth, so ``if
    lb.release_server(...)`` reads as before."""

    __slots__ = ("_done", "_error", "_outbox", "_value")

    def __init__(self, outbox: Outbox | None = None) -> None:
        self._outbox = outbox
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    @classmethod
    def of(cls, value: T) -> Released[T]:
        """An outcome already known."""
        out: Released[T] = cls()
        out._settle(value, None)
        return out

    def _settle(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error, self._done = value, error, True
        self._outbox = None

    def done(self) -> bool:
        """Whether the reply has been read (or the call failed)."""
        return self._done

    def result(self) -> T:
        """The call's result, read now if it has not been; raises what the call raised."""
        outbox = self._outbox
        if not self._done and outbox is not None:
            outbox.wait_for(self)
        if self._error is not None:
            raise self._error
        value: T = self._value
        return value

    def exception(self) -> BaseException | None:
        """What the call raised (waiting for it as ``result()``), or None."""
        try:
            self.result()
        except BaseException as exc:
            return exc
        return None

    def __bool__(self) -> bool:
        return bool(self.result())

    def __repr__(self) -> str:
        state = f"result={self._value!r}" if self._done and self._error is None else "pending"
        if self._error is not None:
            state = f"error={type(self._error).__name__}"
        return f"Released({state})"


class _Written:
    """A call written on the outbox's connection whose reply has not been read."""

    __slots__ = ("call", "op", "out", "sent")

    def __init__(self, op: Op[Any], call: Call, out: Released[Any], sent: float) -> None:
        self.op, self.call, self.out, self.sent = op, call, out, sent


class Outbox:
    """A sync balancer's ordered connection: releases written at once, replies read later.

    ``command(call)`` is the command to write for a call (None: send it the ordinary way,
    e.g. before the first call has chosen FCALL or EVALSHA); ``resend(call)`` sends a call
    the ordinary way, with every retry, and returns its reply or raises."""

    def __init__(
        self,
        pool: Any,
        command: Callable[[Call], tuple[Any, ...] | None],
        resend: Callable[[Call], Any],
    ) -> None:
        self._pool = pool
        self._command, self._resend = command, resend
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._written: collections.deque[_Written] = collections.deque()
        # Calls to send again the ordinary way (a broken connection, a missing script), by the
        # background reader outside the lock: no caller waits behind another's resend.
        self._again: collections.deque[_Written] = collections.deque()
        self._conn: Any = None
        self._reader: threading.Thread | None = None
        self._idle = True
        self._last_write = 0.0  # when the latest call was written (monotonic)
        self._failed: BaseException | None = None  # why the connection last broke reading
        self._closed = False
        _open.add(self)

    # -- the caller's side -----------------------------------------------------------------

    def post(self, op: Op[T]) -> Released[T]:
        """Run ``op`` (one script call) without waiting for its reply: it is written now, in
        order after every earlier call of this outbox. What ``op`` does before its call (a
        release's ledger bookkeeping) is done before this returns."""
        out: Released[T] = Released(self)
        try:
            call = next(op)
        except StopIteration as stop:  # nothing to send
            out._settle(stop.value, None)
            return out
        except BaseException as exc:
            out._settle(None, exc)
            op.close()
            return out
        with self._lock:
            if not self._write(op, call, out):
                if self._closed:
                    sync = True
                else:  # the background sends it the ordinary way: the caller never waits
                    sync = False
                    self._again.append(_Written(op, call, out, time.monotonic()))
            else:
                sync = False
            if not sync:
                self._nudge()
        if sync:  # closed: sent now, the ordinary way
            self._finish(op, call, out, None)
        return out

    def call(self, call: Call) -> tuple[bool, Any]:
        """Send a call behind the calls still unanswered and wait for its reply: (True, reply),
        where an error reply, or the error of a connection that broke once the call may have
        been written, is the reply (returned, not raised); or (False, None) when none is
        unanswered: the caller sends it the ordinary way."""
        if not self._written:
            return False, None
        with self._lock:
            return self._call(call)

    def _call(self, call: Call) -> tuple[bool, Any]:
        if not self._written:
            return False, None
        command = self._command(call)
        conn = self._conn
        if command is None or conn is None:
            self._drain()
            return False, None
        try:
            conn.send_packed_command(conn.pack_command(*command), check_health=False)
        except _ERRORS as exc:
            self._broken()
            return True, exc
        self._drain()  # the earlier calls' replies come first
        if self._conn is not conn:  # the connection broke while reading them
            if isinstance(self._failed, rx.TimeoutError):
                return True, self._failed  # Redis is silent: not resent (see _exec)
            return True, rx.ConnectionError("the balancer's connection broke")
        try:
            return True, conn.read_response()
        except rx.ResponseError as exc:
            if transient(exc):  # READONLY after a failover: a new connection next time
                self._broken()
            return True, exc
        except _ERRORS as exc:
            self._broken()
            return True, exc

    def wait_for(self, out: Released[Any]) -> None:
        """Read replies until ``out`` has its own (or wait while another thread sends it
        again the ordinary way)."""
        while not out.done():
            with self._lock:
                while not out.done() and self._written:
                    self._read_one()
            self._send_again()
            if not out.done():
                time.sleep(0.0005)

    def drain(self) -> None:
        """Read the reply of every written call."""
        with self._lock:
            self._drain()
        self._send_again()

    def _drain(self) -> None:
        while self._written:
            self._read_one()

    @property
    def unanswered(self) -> int:
        """Calls written whose reply has not been read yet."""
        return len(self._written)

    def close(self) -> None:
        """Read every reply (bounded), stop the reader and give the connection back."""
        with self._lock:
            self._closed = True
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while self._written and time.monotonic() < deadline:
                self._read_one()
            if self._written:
                self._broken()
            self._wake.notify()
            conn, self._conn = self._conn, None
        self._send_again()
        if conn is not None:
            with contextlib.suppress(Exception):
                self._pool.release(conn)
        _open.discard(self)

    def forked(self) -> None:
        """In a forked child: the parent's connection, calls and reader are not this
        process's (the parent reads its own replies)."""
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._written, self._again = collections.deque(), collections.deque()
        self._conn, self._reader, self._idle = None, None, True

    # -- writing and reading ---------------------------------------------------------------

    def _write(self, op: Op[Any], call: Call, out: Released[Any]) -> bool:
        if self._closed:
            return False
        command = self._command(call)
        if command is None:
            return False
        try:
            conn = self._conn
            if conn is None:
                conn = self._conn = _connection(self._pool)
            conn.send_packed_command(conn.pack_command(*command), check_health=False)
        except PoolExhausted:  # sent the ordinary way, which waits its turn too
            return False
        except _ERRORS:
            # Perhaps written: the resend (same operation id) is safe either way.
            self._broken()
            return False
        self._last_write = now = time.monotonic()
        self._written.append(_Written(op, call, out, now))
        return True

    def _read_one(self) -> None:
        w = self._written[0]
        try:
            reply = self._conn.read_response()
        except rx.ResponseError as exc:
            # NOSCRIPT, a script's refusal, ...: sent again the ordinary way, which loads what
            # is missing and raises what is refused. After READONLY (a failover) or LOADING
            # the server is the wrong one for now: the later calls go the ordinary way too,
            # and the next write takes a new connection.
            self._again.append(self._written.popleft())
            if transient(exc):
                self._broken()
            else:
                self._nudge()
            return
        except _ERRORS as exc:
            self._failed = exc
            self._broken()
            return
        self._written.popleft()
        self._finish(w.op, w.call, w.out, (reply,))

    def _finish(
        self, op: Op[Any], call: Call, out: Released[Any], reply: tuple[Any] | None
    ) -> None:
        """Hand ``op`` its reply (None: send the call again the ordinary way) and settle."""
        try:
            value = reply[0] if reply is not None else self._resend(call)
            op.send(value)
            raise RuntimeError("a posted operation made a second call")  # pragma: no cover
        except StopIteration as stop:
            out._settle(stop.value, None)
        except BaseException as exc:
            out._settle(None, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            op.close()

    def _broken(self) -> None:
        """The connection failed: drop it; every unanswered call is sent again the ordinary
        way (each is safe to resend), by whoever holds the lock once it lets go of it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()
            with contextlib.suppress(Exception):
                self._pool.release(conn)
        self._again.extend(self._written)
        self._written = collections.deque()
        self._nudge()

    def _nudge(self) -> None:
        """Have the background reader look (the lock is held)."""
        if self._idle or self._again:
            self._idle = False
            self._start_reader()
            self._wake.notify()

    def _send_again(self) -> RedisUnavailable | None:
        """Send the calls set aside the ordinary way, outside the lock, in order. Once one
        fails for want of Redis, the rest fail with it at once (a release that failed so is
        ended by the keeper's reconciliation once Redis is back, as before); that error is
        returned."""
        failed: RedisUnavailable | None = None
        while self._again:
            with self._lock:
                if not self._again:
                    break
                w = self._again.popleft()
            if failed is not None:
                w.out._settle(None, failed)
                w.op.close()
                continue
            self._finish(w.op, w.call, w.out, None)
            if isinstance(w.out._error, RedisUnavailable):
                failed = w.out._error
        return failed

    # -- the background reader -------------------------------------------------------------

    def _start_reader(self) -> None:
        if self._reader is None or not self._reader.is_alive():
            self._reader = threading.Thread(
                target=_read_later,
                args=(weakref.ref(self),),
                name="redis-router-outbox",
                daemon=True,
            )
            self._reader.start()

    def _reader_step(self) -> bool:
        """One wake of the reader; False when it should stop. It reads only replies that have
        arrived and waits for the rest outside the lock: a caller posting a release never
        waits while Redis takes its time (a pause, a slow script) over an earlier one."""
        sock, waiting = None, False
        with self._lock:
            if self._closed:
                return False
            if not self._again:  # else: sent below, outside the lock, at once
                if not self._written:
                    # While calls come (one within LINGER), look again every BOUND unasked,
                    # so a post never has to wake this thread (a thread switch per post
                    # measured ~8 % of a sync pair); quiet for LINGER, sleep until a post
                    # wakes it. A process whose requests take seconds so pays a few wakes
                    # per release, not one every BOUND while it waits for them.
                    if time.monotonic() - self._last_write < LINGER:
                        self._wake.wait(BOUND)
                        return not self._closed
                    self._idle = True
                    self._wake.wait(IDLE)
                    return not self._closed
                age = time.monotonic() - self._written[0].sent
                if age < BOUND:
                    self._wake.wait(BOUND - age)
                    return True
            try:
                self._read_arrived()
            except Exception:  # never let the reader die: the next wake reads again
                log.exception("redis-router: reading release replies failed")
            waiting = bool(self._written)
            if waiting and self._conn is not None:
                sock = getattr(self._conn, "_sock", None)
        self._send_again()
        if waiting:
            _wait_readable(sock, POLL)
        return True

    def _read_arrived(self) -> None:
        """Read the replies already here; a call unanswered for longer than the client's
        socket timeout breaks the connection (and is sent again the ordinary way), as a
        blocking read would have."""
        while self._written and self._conn is not None:
            conn = self._conn
            try:
                ready = conn.can_read(timeout=0)
            except _ERRORS:
                self._broken()
                return
            if not ready:
                timeout = getattr(conn, "socket_timeout", None)
                if timeout and time.monotonic() - self._written[0].sent > timeout + BOUND:
                    self._broken()
                return
            self._read_one()


def _wait_readable(sock: Any, timeout: float) -> None:
    """Wait until ``sock`` has bytes to read, ``timeout`` seconds at most (poll: no limit on
    the descriptor's number, as select has). Without a socket, or one closed meanwhile, a
    short sleep: the next wake looks again."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.poll(timeout * 1000)
    except (OSError, ValueError, TypeError, AttributeError):
        time.sleep(BOUND)


def _connection(pool: Any) -> Any:
    """A connection of the pool's own for the outbox (redis-py before 6 names a command)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("EVALSHA")


def _read_later(ref: weakref.ref[Outbox]) -> None:
    while True:
        outbox = ref()
        if outbox is None or not outbox._reader_step():
            return
        del outbox


# Outboxes with calls that may be unanswered: their replies are read before the process exits.
_open: weakref.WeakSet[Outbox] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    for outbox in list(_open):
        with contextlib.suppress(Exception):
            outbox.close()
