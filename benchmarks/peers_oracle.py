"""The peers benchmark's oracle: the least an aiohttp front can do per request.

``python -m benchmarks.peers_oracle --port P URL...`` serves every POST by sending its body to
the next replica of a Python list (round robin) and answering with the replica's status, body
and content type: no Redis, no routing, no parsing of the body, no headers copied. It is built
from the same parts as ``redis-router serve`` (aiohttp's server with ``handler_cancellation``
and no access log; one ``ClientSession`` with an unbounded pool, the same keep-alive, no
decompression, no headers of its own and no cookie jar; uvloop when installed, else asyncio's
loop) and started and measured as it is, so its rows bound what any front on this HTTP stack
can reach on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
from collections.abc import Sequence

import aiohttp
from aiohttp import web

# As redis_router.http.server's upstream client.
KEEPALIVE_TIMEOUT = 4.0
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")


def app(upstreams: Sequence[str]) -> web.Application:
    urls = itertools.cycle([u.rstrip("/") for u in upstreams])
    state: dict[str, aiohttp.ClientSession] = {}

    async def start(_app: web.Application) -> None:
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


async def serve(host: str, port: int, upstreams: Sequence[str]) -> None:
    runner = web.AppRunner(app(upstreams), handler_cancellation=True, access_log=None)
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
    p.add_argument("upstreams", nargs="+", metavar="URL")
    args = p.parse_args(argv)
    coro = serve(args.host, args.port, args.upstreams)
    try:  # the loop redis-router serve picks
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
