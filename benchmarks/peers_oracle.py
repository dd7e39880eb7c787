"""The peers benchmark's oracle: the least an aiohttp front can do per request.

``python -m benchmarks.peers_oracle --port P URL...`` serves every POST by sending its body to
the next replica of a Python list (round robin) and answering with the replica's status, body
and content type: no Redis, no routing, no parsing of the body, no headers copied. It is built
from the same parts as ``redis-router serve`` (aiohttp's server with ``handler_cancellation``
and no access log; one ``ClientSession`` with an unbounded pool, the same keep-alive, no
decompression, no headers of its own and no cookie jar; uvloop when installed, else asyncio's
loop) and started and measured as it is, so its rows bound what any front on this HTTP stack
can reach on this machine.

``--redis URL`` adds the least a front that asks Redis for each request's replica must add:
one round trip per request, a ``PING`` written on one connection opened at start-up and its
``+PONG`` matched where the event loop receives it (an asyncio protocol, no client library, no
task per reply; Redis answers in order). Its rows bound what a front on this HTTP stack with
one Redis call per request can reach.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import signal
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

# As redis_router.http.server's upstream client.
KEEPALIVE_TIMEOUT = 4.0
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")


class Pings(asyncio.Protocol):
    """One Redis connection on which each ``ping()`` writes PING and resolves on its reply."""

    def __init__(self) -> None:
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        head, end, self._tail = (self._tail + data).rpartition(b"\r\n")
        for _ in range(head.count(b"\r\n") + len(end) // 2):  # one "+PONG\r\n" each
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(ConnectionError("the Redis connection closed"))

    def ping(self) -> asyncio.Future[None]:
        assert self._transport is not None
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._transport.write(b"PING\r\n")
        return fut


async def connect_pings(url: str) -> Pings:
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    _, pings = await loop.create_connection(
        Pings, parts.hostname or "127.0.0.1", parts.port or 6379
    )
    return pings


def app(upstreams: Sequence[str], redis_url: str | None = None) -> web.Application:
    urls = itertools.cycle([u.rstrip("/") for u in upstreams])
    state: dict[str, aiohttp.ClientSession] = {}
    pings: list[Pings] = []

    async def start(_app: web.Application) -> None:
        if redis_url is not None:
            pings.append(await connect_pings(redis_url))
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_TIMEOUT
        )
        state["client"] = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=SKIP_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def stop(_app: web.Application) -> None:
        await state["client"].close()

    async def forward(request: web.Request) -> web.Response:
        raw = await request.read()
        if pings:
            await pings[0].ping()
        url = next(urls) + request.rel_url.path_qs
        async with state["client"].post(url, data=raw, headers=_JSON) as resp:
            body = await resp.read()
            return web.Response(status=resp.status, body=body, content_type=resp.content_type)

    a = web.Application()
    a.router.add_post("/{tail:.*}", forward)
    a.on_startup.append(start)
    a.on_cleanup.append(stop)
    return a


_JSON = {"Content-Type": "application/json"}


async def serve(
    host: str, port: int, upstreams: Sequence[str], redis_url: str | None = None
) -> None:
    runner = web.AppRunner(app(upstreams, redis_url), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        print(f"oracle on http://{host}:{port}, {len(upstreams)} upstreams", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers_oracle")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--redis", metavar="URL", help="one PING round trip per request (no auth)")
    p.add_argument("upstreams", nargs="+", metavar="URL")
    args = p.parse_args(argv)
    coro = serve(args.host, args.port, args.upstreams, args.redis)
    try:  # the loop redis-router serve picks
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
