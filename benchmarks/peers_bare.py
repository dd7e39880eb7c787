"""The peers benchmark's bare-client oracles: the library's own scripts, and two no-op ones,
sent by the least a Python client can be.

A request the library routes costs, above a direct one: two script round trips (the acquire
waited for, the release written and left to be answered), the scripts' own Redis time, and
the library's Python around them (checking ids, making tokens and grants, keeping the lease
ledger, coalescing). These oracles keep the first two and drop the last: one connection opened
at start-up, each command made by joining tuples and packed by hiredis, each reply fed to
hiredis where it is received (an asyncio protocol resolving one future per reply; a blocking
socket for the sync rows), no checks, no objects, no retries. So, in one run:

- *the library's scripts, bare client* minus *two no-op calls, bare client* is what the
  scripts' own work adds (Redis running them, and their longer arguments and replies);
- the library's row minus *the library's scripts, bare client* is what the library's Python
  adds;
- *two no-op calls, bare client* is the least any client adds that makes an acquire round
  trip and posts a release, whatever its scripts do.

The scripts are the balancer's own (the same Functions, the same arguments its core makes for
a request without fields, under its holder, whose keeper keeps it alive), taken from one
acquire the core prepares and does not send. The no-op library returns at once; its calls
carry the acquire's and the release's arguments.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import socket
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis

# The oracles' row labels (the latency and the CPU measures).
BARE = "oracle: the library's scripts, bare client"
BARE_NOOP = "oracle: two no-op script calls, bare client"
BARE_ASYNC = f"{BARE}, asyncio"
BARE_NOOP_ASYNC = f"{BARE_NOOP}, asyncio"

# A Functions library whose one function returns at once, as an acquire's reply is shaped.
NOOP = "rr_bench_noop"
NOOP_LIBRARY = (
    f"#!lua name={NOOP}\n"
    f"redis.register_function{{function_name='{NOOP}', flags={{}}, "
    "callback=function(keys, args) return {'s0', false, 0} end}\n"
)


class Commands:
    """The commands a bare client sends for one routed request, as the balancer makes them."""

    def __init__(self, core: Any, noop: bool) -> None:
        op = core.acquire([uuid.uuid4().hex])
        call = next(op)  # prepared, not sent
        op.close()
        self.prefix = core.prefix
        # The settings every acquire sends, then the request's own: id, token, random, group.
        self.head = call.args[:-4]
        self.acquire_fn = NOOP if noop else call.script.function
        self.release_fn = NOOP if noop else core.release_script.function

    def acquire(self, request_id: str, token: str) -> tuple[Any, ...]:
        rand = str(random.getrandbits(48))
        return ("FCALL", self.acquire_fn, 1, self.prefix, *self.head, request_id, token, rand, "")

    def release(self, server_id: str, request_id: str, token: str) -> tuple[Any, ...]:
        op = os.urandom(9).hex()
        return ("FCALL", self.release_fn, 1, self.prefix, server_id, request_id, token, op)


def _address(url: str) -> tuple[str, int, list[tuple[Any, ...]]]:
    """Host, port and the commands to send first (AUTH) of a ``redis://`` URL."""
    parts = urlsplit(url)
    first: list[tuple[Any, ...]] = []
    if parts.password:
        user = unquote(parts.username or "default")
        first.append(("AUTH", user, unquote(parts.password)))
    return parts.hostname or "127.0.0.1", parts.port or 6379, first


def _reply(reply: Any) -> Any:
    if isinstance(reply, Exception):
        raise reply
    return reply


class AsyncBare(asyncio.Protocol):
    """One connection: ``call`` writes a command and resolves on its reply, ``post`` writes
    one whose reply is read and dropped. Redis answers in order."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._waiting: collections.deque[asyncio.Future[Any] | None] = collections.deque()
        self._transport: asyncio.Transport | None = None

    @classmethod
    async def open(cls, url: str) -> AsyncBare:
        host, port, first = _address(url)
        _, bare = await asyncio.get_running_loop().create_connection(cls, host, port)
        for command in first:
            _reply(await bare.call(command))
        return bare

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            fut = self._waiting.popleft()
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(exc or ConnectionError("Redis closed the connection"))

    def call(self, command: tuple[Any, ...]) -> asyncio.Future[Any]:
        assert self._transport is not None
        fut = asyncio.get_running_loop().create_future()
        self._transport.write(hiredis.pack_command(command))
        self._waiting.append(fut)
        return fut

    def post(self, command: tuple[Any, ...]) -> None:
        assert self._transport is not None
        self._transport.write(hiredis.pack_command(command))
        self._waiting.append(None)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class SyncBare:
    """One blocking socket: ``call`` sends a command and returns its reply, after reading the
    replies of the commands ``post`` sent before it (Redis answers in order)."""

    def __init__(self, url: str) -> None:
        host, port, first = _address(url)
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = hiredis.Reader()
        self._posted = 0
        for command in first:
            _reply(self.call(command))

    def call(self, command: tuple[Any, ...]) -> Any:
        self._sock.sendall(hiredis.pack_command(command))
        reader, want = self._reader, self._posted + 1
        self._posted = 0
        while True:
            reply = reader.gets()
            if reply is False:
                data = self._sock.recv(65536)
                if not data:
                    raise ConnectionError("Redis closed the connection")
                reader.feed(data)
                continue
            want -= 1
            if want == 0:
                return reply

    def post(self, command: tuple[Any, ...]) -> None:
        self._sock.sendall(hiredis.pack_command(command))
        self._posted += 1

    def close(self) -> None:
        self._sock.close()


def load_noop(client: Any) -> None:
    """Load the no-op library on a sync redis-py client's server (replacing an earlier one)."""
    client.function_load(NOOP_LIBRARY, replace=True)


def new_token() -> str:
    return os.urandom(8).hex()


def server_id(reply: Any) -> str:
    """The replica of an acquire's reply (the first of id, metadata, how)."""
    sid = _reply(reply)[0]
    return sid.decode() if isinstance(sid, bytes) else str(sid)
