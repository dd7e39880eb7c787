"""The OpenAI-compatible front of ``redis-router serve``: an aiohttp app that forwards each
request to the replica the shared balancer grants.

Stateless: everything that routes (leases, sticky sessions, ejections, waiters, the prefix
index) is the balancer's, in Redis, so any number of these behind any L4 balancer route as
one. A request costs one acquire, one upstream request and one release; the release is sent
after the response's last byte, in the background, and at once when the client goes away,
whenever it does (its acquire waiting or in flight included).

Failure rules: an upstream connection error (or a broken answer) before any byte reached the
client reports a failure (``release(failed=True)``: passive ejection) and retries under the
same request id, excluding every replica that failed it (``acquire(exclude=...)``, atomic in
the acquire: a session moves to the replica that answers), and is answered 502 once the
retries are spent or no other replica takes new sessions; ``--upstream-timeout`` running out
is reported too, and answered 504, not retried; an upstream 5xx is passed through and
reported as a failure; a full pool waits as the balancer's ``wait_timeout`` says, then is a
503 with ``Retry-After``; an empty pool is a 503; a malformed request is a 400 and takes no
lease.

Client connections are bounded (:class:`Connections`): a request's headers must arrive in
time, and idle connections are few enough and short-lived enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from aiohttp.payload import BytesPayload
from multidict import CIMultiDict

from .. import dp
from ..aio import AsyncLease
from ..errors import ConfigMismatch, NoServersAvailable, RedisUnavailable
from .handlers import (
    REPLICA_HEADER,
    Handlers,
    ServeOptions,
    describe_error,
    forward_headers,
    pass_headers,
    to_replica,
)
from .routing import (
    GENERATION_PATHS,
    NOT_ROUTED,
    BadRequest,
    Route,
    replica_url,
    route_request,
)

__all__ = ["Front", "ServeOptions", "running"]

# Seconds an idle upstream connection is kept: below uvicorn's 5 s keep-alive (vLLM, SGLang),
# so the front rarely sends on a connection the replica is closing.
KEEPALIVE_TIMEOUT = 4.0
# The upstream client passes requests and answers through: no decompression, no headers of
# its own (a replica compresses only for a client that asked), and no cookie jar (a replica's
# Set-Cookie goes to its client, never into later requests of other clients).
SKIP_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")


class Front(Handlers):
    """A serve instance's app: generation here, the rest in :class:`Handlers`."""

    # -- lifetime --------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.options.max_body)
        for path in GENERATION_PATHS:
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_get("/workers", self.workers)
        app.router.add_post("/workers", self.add_worker)
        app.router.add_delete("/workers/{id}", self.remove_worker)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        o = self.options
        timeout = aiohttp.ClientTimeout(
            total=o.upstream_timeout, sock_connect=o.connect_timeout, connect=o.connect_timeout
        )
        # No pool limit (the balancer bounds each replica), raw bytes passed through as sent.
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_TIMEOUT
        )
        self._client = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=SKIP_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def _stop(self, _app: web.Application) -> None:
        if self._client is not None:
            await self._client.close()

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        m = self.metrics
        if m is not None:
            m.inflight.inc()
        try:
            resp = await self._generate(request)
        finally:
            if m is not None:
                m.inflight.dec()
        self._count(request.path, resp.status)
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            raw = await request.read()
            route = route_request(path, raw, request.headers, self.options.session)
            fields = route.fields(self.declared)
        except BadRequest as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param=exc.param)
        except web.HTTPRequestEntityTooLarge:
            return self.error(
                path,
                413,
                f"the body exceeds {self.options.max_body} bytes",
                "invalid_request_error",
            )
        got = await self._connect(request, route, fields, raw)
        if isinstance(got, web.Response):
            return got
        lease, upstream, first, streaming = got
        return await self._respond(request, lease, upstream, first, streaming)

    async def _connect(
        self, request: web.Request, route: Route, fields: Mapping[str, Any], raw: bytes
    ) -> web.Response | tuple[AsyncLease, aiohttp.ClientResponse, bytes, bool]:
        """Acquire and send until a replica answers (headers, and the first bytes of the body)
        or the retries are spent. Nothing has reached the client yet."""
        path, headers = request.path, forward_headers(request.headers)
        target = request.rel_url.path_qs
        failed: AsyncLease | None = None
        avoid: set[str] = set()  # replicas that failed this request
        why = "no attempt"
        try:
            for k in range(self.options.retries + 1):
                if failed is not None:  # reported first: it counts toward ejecting it
                    avoid.add(failed.server_id)
                    reported, failed = failed, None
                    with contextlib.suppress(RedisUnavailable):  # the acquire will say so
                        await reported.fail()
                try:
                    lease = await self.balancer.acquire(
                        route.request_id, wait=self.options.wait, exclude=avoid or None, **fields
                    )
                except NOT_ROUTED as exc:
                    if avoid and type(exc) is NoServersAvailable:  # each one left failed it
                        why += "; no other replica takes new sessions"
                        break
                    return self._unavailable(path, exc)
                except ConfigMismatch as exc:  # settings pinned anew since this one started
                    return self.error(path, 500, str(exc), "config_mismatch")
                except (TypeError, ValueError) as exc:  # the policy refused a field's value
                    return self.error(path, 400, str(exc), "invalid_request_error")
                if k and self.metrics is not None:
                    self.metrics.retries.labels(path).inc()
                url = replica_url(lease.handle)
                if url is None:
                    failed, why = lease, f"replica {lease.server_id!r} has no url in its metadata"
                    continue
                started = time.perf_counter()
                upstream: aiohttp.ClientResponse | None = None
                try:
                    sent, to = _to_rank(lease.handle, route, raw, to_replica(headers, url))
                    upstream = await self._send(request.method, url + target, sent, to)
                    if self.metrics is not None:
                        self.metrics.upstream_seconds(path, time.perf_counter() - started)
                    streaming = route.stream or _is_sse(upstream)
                    first = await (upstream.content.readany() if streaming else upstream.read())
                except aiohttp.ConnectionTimeoutError as exc:  # never reached: try another
                    failed, why = lease, f"replica {lease.server_id!r}: {describe_error(exc, url)}"
                    continue
                except asyncio.TimeoutError:  # --upstream-timeout: it may be working on it
                    if upstream is not None:
                        upstream.close()
                    lease.fail()  # queued now, answered in the background
                    return self.error(
                        path,
                        504,
                        f"replica {lease.server_id!r} did not answer within "
                        f"{self.options.upstream_timeout}s",
                        "upstream_timeout",
                    )
                except aiohttp.ClientError as exc:
                    if upstream is not None:
                        upstream.close()
                    failed, why = lease, f"replica {lease.server_id!r}: {describe_error(exc, url)}"
                    continue
                except BaseException:
                    if upstream is not None:
                        upstream.close()
                    lease.release()  # queued now, answered in the background
                    raise
                return lease, upstream, first, streaming
        finally:
            if failed is not None:
                failed.fail()  # queued now, answered in the background
        attempts = len(avoid) + (failed is not None)
        return self.error(
            path,
            502,
            f"no replica answered in {attempts} attempt(s); last: {why}",
            "upstream_error",
        )

    async def _send(
        self, method: str, url: str, raw: bytes, headers: CIMultiDict[str]
    ) -> aiohttp.ClientResponse:
        """One upstream request; sent once more at once when a pooled connection turns out
        to have been closed by the replica (its keep-alive ran out), which is no failure."""
        try:
            return await self.client.request(method, url, data=_payload(raw), headers=headers)
        except aiohttp.ServerDisconnectedError:
            return await self.client.request(method, url, data=_payload(raw), headers=headers)

    async def _respond(
        self,
        request: web.Request,
        lease: AsyncLease,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        streaming: bool,
    ) -> web.StreamResponse:
        """Pass the answer on; the lease ends after its last byte (failed on a 5xx or a
        replica that broke off), at once if the client goes away."""
        failed, complete = upstream.status >= 500, False
        headers = pass_headers(upstream.headers)
        headers[REPLICA_HEADER] = lease.server_id
        try:
            if not streaming:
                resp = web.Response(status=upstream.status, body=first, headers=headers)
                await resp.prepare(request)
                await resp.write_eof()
                complete = True
                return resp
            stream = web.StreamResponse(status=upstream.status, headers=headers)
            await stream.prepare(request)
            if first:
                await stream.write(first)
            try:
                async for chunk in upstream.content.iter_any():
                    await stream.write(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                failed = True  # the replica broke off mid-answer: the client sees it cut short
                if request.transport is not None:
                    request.transport.close()
                return stream
            await stream.write_eof()
            complete = True
            return stream
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self._count(request.path, 499)  # the client went away; aiohttp ends the connection
            raise
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()  # the replica sees the disconnect and stops generating
            # Queued now, answered in the background (the balancer's close() waits for it).
            lease.fail() if failed else lease.release()

    # -- the rest of the API ---------------------------------------------------------------


def _to_rank(
    handle: Any, route: Route, raw: bytes, headers: CIMultiDict[str]
) -> tuple[bytes, CIMultiDict[str]]:
    """The body and headers sent to a lease's replica: for a rank of a data-parallel replica
    (redis_router.dp), vLLM's rank header added and SGLang's rank field set in a JSON body."""
    rank = dp.vllm_headers(handle)
    if not rank:
        return raw, headers
    headers = headers.copy()
    headers.update(rank)
    return dp.rank_body(handle, route.body) or raw, headers


def _is_sse(resp: aiohttp.ClientResponse) -> bool:
    """The response is server-sent events (its media type, read without parsing the rest)."""
    kind = resp.headers.get(hdrs.CONTENT_TYPE)
    return kind is not None and kind[:17].lower() == "text/event-stream"


def _payload(raw: bytes) -> BytesPayload | None:
    """The body as it came (given as a payload: aiohttp's lookup by type is skipped)."""
    return BytesPayload(raw) if raw else None


class Connections:
    """Bounds on the client connections of one serve process, as gateways bound theirs: a
    request's headers must arrive within ``header_timeout`` of its first byte (a client that
    sends half a request line is closed then, not held), and at most ``max_idle`` connections
    wait idle (open, with no request in progress) at once: past that, the oldest idle one is
    closed. A connection idle longer than the keep-alive timeout is closed by aiohttp.

    The protocol factory of the listening socket: each connection's aiohttp protocol is
    wrapped in a :class:`_Watched`, told by :meth:`middleware` when a request starts and ends.
    """

    def __init__(self, header_timeout: float, max_idle: int) -> None:
        self.header_timeout, self.max_idle = header_timeout, max_idle
        self.server: web.Server | None = None  # the runner's, once it is set up
        self.idle: dict[_Watched, None] = {}  # in the order they went idle: oldest first

    def __call__(self) -> _Watched:
        assert self.server is not None
        return _Watched(self, self.server())

    def went_idle(self, conn: _Watched) -> None:
        self.idle.pop(conn, None)
        self.idle[conn] = None
        while len(self.idle) > self.max_idle:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            oldest.inner.force_close()  # what aiohttp does when keep-alive runs out

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        conn = transport.get_protocol() if transport is not None else None
        if not isinstance(conn, _Watched):
            return await handler(request)  # type: ignore[no-any-return]
        conn.started()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        finally:
            conn.ended()


class _Watched(asyncio.Protocol):
    """One client connection: aiohttp's protocol, with its header timer and idle state."""

    __slots__ = ("busy", "inner", "limits", "timer")

    def __init__(self, limits: Connections, inner: web.RequestHandler) -> None:
        self.limits, self.inner = limits, inner
        self.busy = False  # a request is in progress (its headers were read)
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        self.limits.went_idle(self)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self.timer is None:  # the first byte of a request's headers
            self.limits.idle.pop(self, None)
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.limits.header_timeout, self._headers_late)
        self.inner.data_received(data)

    def _headers_late(self) -> None:
        self.timer = None
        if not self.busy:
            self.inner.force_close()

    def started(self) -> None:
        self.busy = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.limits.idle.pop(self, None)

    def ended(self) -> None:
        self.busy = False
        self.limits.went_idle(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.limits.idle.pop(self, None)
        self.inner.connection_lost(exc)

    def eof_received(self) -> None:
        self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _Site(web.BaseSite):
    """A site that listens on host:port or on a given socket, with :class:`Connections` as
    its protocol factory."""

    def __init__(
        self,
        runner: web.AppRunner,
        connections: Connections,
        host: str,
        port: int,
        sock: socket.socket | None,
    ) -> None:
        super().__init__(runner)
        self._connections, self._host, self._port, self._sock = connections, host, port, sock

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        if self._sock is None:
            self._server = await loop.create_server(
                self._connections, self._host, self._port, backlog=self._backlog
            )
        else:
            self._server = await loop.create_server(
                self._connections, sock=self._sock, backlog=self._backlog
            )


@contextlib.asynccontextmanager
async def running(
    front: Front,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    shutdown_timeout: float = 10.0,
) -> Any:
    """Serve ``front`` on host:port (or on ``sock``, a socket already bound and listening)
    until the block ends; yields the bound (host, port)."""
    o = front.options
    app = front.app()
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=o.keepalive_timeout,
    )
    connections = Connections(o.header_timeout, o.max_idle_connections)
    app.middlewares.append(connections.middleware)
    await runner.setup()
    try:
        connections.server = runner.server
        site = _Site(runner, connections, host, port, sock)
        await site.start()
        bound = runner.addresses[0]
        yield bound[0], bound[1]
    finally:
        await runner.cleanup()
