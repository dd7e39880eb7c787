"""The OpenAI-compatible front of ``redis-router serve``: an aiohttp app that forwards each
request to the replica the shared balancer grants.

Stateless: everything that routes (leases, sticky sessions, ejections, waiters, the prefix
index) is the balancer's, in Redis, so any number of these behind any L4 balancer route as
one. A request costs one acquire, one upstream request and one release; the release is sent
after the response's last byte, in the background, and at once when the client goes away.

Failure rules: an upstream connection error (or a broken answer) before any byte reached the
client reports a failure (``release(failed=True)``: passive ejection) and retries: under the
same request id when the failure ejected the replica (a session moves for good), else under
``<id>~r<k>``, acquired while the failed replica holds one lease more, so least-loaded
prefers the others; ``--upstream-timeout`` running out is reported too, and answered
504, not retried; an upstream 5xx is passed through and reported as a failure; a full pool
waits as the balancer's ``wait_timeout`` says, then is a 503 with ``Retry-After``; an empty
pool is a 503; a malformed request is a 400 and takes no lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from ..aio import AsyncLease, AsyncRedisLoadBalancer
from ..errors import (
    ConfigMismatch,
    NoCapacity,
    NoServersAvailable,
    RedisUnavailable,
    ReplicaEjected,
)
from .routing import (
    GENERATION_PATHS,
    REQUEST_ID_HEADER,
    RETRY_MARK,
    BadRequest,
    Route,
    SessionRule,
    error_body,
    parse_json,
    replica_url,
    retry_after,
    retry_ids,
    route_request,
)

# Headers that belong to one hop and are never forwarded (RFC 9110 7.6.1), plus those the
# HTTP stack sets itself.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
REPLICA_HEADER = "X-Replica-ID"
MAX_BODY = 64 * 1024 * 1024
# Seconds an idle upstream connection is kept: below uvicorn's 5 s keep-alive (vLLM, SGLang),
# so the front rarely sends on a connection the replica is closing.
KEEPALIVE_TIMEOUT = 4.0


@dataclass(frozen=True)
class ServeOptions:
    """How the front forwards: see ``redis-router serve --help``."""

    retries: int = 2
    session: SessionRule = field(default_factory=SessionRule)
    wait: float | None = None  # None: the balancer's wait_timeout
    connect_timeout: float = 5.0
    upstream_timeout: float | None = None  # None: a generation may take as long as it takes
    models_timeout: float = 2.0
    max_body: int = MAX_BODY
    # When set, POST and DELETE /workers need "Authorization: Bearer <token>".
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int):
            raise TypeError(f"retries must be an int, got {type(self.retries).__name__}")
        if not 0 <= self.retries <= 10:
            raise ValueError(f"retries must be in [0, 10], got {self.retries}")
        for name in ("connect_timeout", "models_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.upstream_timeout is not None and not self.upstream_timeout > 0:
            raise ValueError("upstream_timeout must be > 0 seconds or None")


class Front:
    """The request handlers of one serve instance, around one asyncio balancer."""

    def __init__(
        self, balancer: AsyncRedisLoadBalancer, options: ServeOptions, metrics: Any = None
    ) -> None:
        self.balancer, self.options, self.metrics = balancer, options, metrics
        self.declared = tuple(balancer.require_acquire_fields())
        self._client: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Future[Any]] = set()

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
            connector=connector, timeout=timeout, auto_decompress=False
        )

    async def _stop(self, _app: web.Application) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=5.0)
        if self._client is not None:
            await self._client.close()

    def _later(self, release: Awaitable[Any]) -> None:
        """Run a release without making the response wait for it; kept until done."""
        task = asyncio.ensure_future(release)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @property
    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None, "the app has not started"
        return self._client

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
                if failed is not None:  # reported first: an ejection it causes moves the id
                    avoid.add(failed.server_id)
                    reported, failed = failed, None
                    with contextlib.suppress(RedisUnavailable):  # the acquire will say so
                        await reported.fail()
                try:
                    lease = await self._acquire(route.request_id, k, fields, avoid)
                except (NoServersAvailable, RedisUnavailable) as exc:
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
                    upstream = await self._send(request.method, url + target, raw, headers)
                    if self.metrics is not None:
                        self.metrics.upstream.labels(path).observe(time.perf_counter() - started)
                    streaming = route.stream or _is_sse(upstream)
                    first = await (upstream.content.readany() if streaming else upstream.read())
                except aiohttp.ConnectionTimeoutError as exc:  # never reached: try another
                    failed, why = lease, f"replica {lease.server_id!r}: {_describe(exc)}"
                    continue
                except asyncio.TimeoutError:  # --upstream-timeout: it may be working on it
                    if upstream is not None:
                        upstream.close()
                    self._later(lease.fail())
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
                    failed, why = lease, f"replica {lease.server_id!r}: {_describe(exc)}"
                    continue
                except BaseException:
                    if upstream is not None:
                        upstream.close()
                    self._later(lease.release())
                    raise
                return lease, upstream, first, streaming
        finally:
            if failed is not None:
                self._later(failed.fail())
        attempts = self.options.retries + 1
        return self.error(
            path,
            502,
            f"no replica answered in {attempts} attempt(s); last: {why}",
            "upstream_error",
        )

    async def _acquire(
        self, request_id: str, attempt: int, fields: Mapping[str, Any], avoid: set[str]
    ) -> AsyncLease:
        """The lease of one attempt. A retry whose id is still sticky to a replica that failed
        (not ejected) runs under ``<id>~r<attempt>``, acquired while that replica holds one
        lease more, so that least-loaded prefers the others."""
        lease = await self.balancer.acquire(request_id, wait=self.options.wait, **fields)
        if lease.server_id not in avoid:
            return lease
        try:
            retry = f"{request_id}{RETRY_MARK}{attempt}"
            return await self.balancer.acquire(retry, wait=self.options.wait, **fields)
        finally:
            self._later(lease.release())

    async def _send(
        self, method: str, url: str, raw: bytes, headers: CIMultiDict[str]
    ) -> aiohttp.ClientResponse:
        """One upstream request; sent once more at once when a pooled connection turns out
        to have been closed by the replica (its keep-alive ran out), which is no failure."""
        try:
            return await self.client.request(method, url, data=raw or None, headers=headers)
        except aiohttp.ServerDisconnectedError:
            return await self.client.request(method, url, data=raw or None, headers=headers)

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
            self._later(lease.fail() if failed else lease.release())

    # -- the rest of the API ---------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """The union of the replicas' /v1/models (each asked at once, within a timeout)."""
        try:
            status = await self.balancer.get_status()
        except RedisUnavailable as exc:
            return self._unavailable(request.path, exc)
        urls = [
            u for r in status["replicas"].values() if (u := replica_url(r["metadata"])) is not None
        ]
        timeout = aiohttp.ClientTimeout(total=self.options.models_timeout)
        answers = await asyncio.gather(
            *(self._models_of(u, timeout) for u in urls), return_exceptions=True
        )
        seen: dict[str, Any] = {}
        for got in answers:
            if isinstance(got, list):
                for model in got:
                    if isinstance(model, dict) and isinstance(model.get("id"), str):
                        seen.setdefault(model["id"], model)
        if urls and not any(isinstance(a, list) for a in answers):
            return self.error(request.path, 502, "no replica answered /v1/models", "upstream_error")
        self._count(request.path, 200)
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def _models_of(self, url: str, timeout: aiohttp.ClientTimeout) -> list[Any]:
        async with self.client.get(url + "/v1/models", timeout=timeout) as resp:
            resp.raise_for_status()
            data = (await resp.json(content_type=None)).get("data")
        return data if isinstance(data, list) else []

    async def health(self, request: web.Request) -> web.Response:
        """200 while Redis answers (the replicas' health is the balancer's ejection)."""
        try:
            replicas = await self.balancer.get_all_servers()
        except RedisUnavailable as exc:
            return self._unavailable(request.path, exc)
        body = {"status": "ok", "balancer": self.balancer.name, "replicas": len(replicas)}
        return web.json_response(body)

    async def metrics_page(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return self.error(request.path, 404, "metrics are off", "not_found_error")
        return web.Response(body=self.metrics.render(), headers={"Content-Type": _prom_type()})

    async def abort(self, request: web.Request) -> web.Response:
        """SGLang's abort, sent only to the replica serving the request (never fanned out)."""
        path = request.path
        try:
            raw = await request.read()
            body = parse_json(raw)
            rid = request.headers.get(REQUEST_ID_HEADER, body.get("rid"))
            if not isinstance(rid, str) or not rid:
                raise BadRequest(
                    f"name the request to abort: body {{'rid': ...}} or header "
                    f"{REQUEST_ID_HEADER} (a non-empty string)",
                    "rid",
                )
            session = request.headers.get(self.options.session.header)
            field_ = self.options.session.body_field
            if session is None and field_ is not None and isinstance(body.get(field_), str):
                session = body[field_]
            ids = retry_ids(session or rid, self.options.retries)
            owner = None
            for candidate in ids:
                owner = await self.balancer.request_owner(candidate)
                if owner is not None:
                    break
        except BadRequest as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param=exc.param)
        except (TypeError, ValueError) as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param="rid")
        except RedisUnavailable as exc:
            return self._unavailable(path, exc)
        if owner is None:
            return self.error(
                path, 404, f"no replica is serving request {rid!r} now", "not_found_error"
            )
        url = await self._url_of(owner)
        if url is None:
            return self.error(path, 502, f"replica {owner!r} has no url", "upstream_error")
        try:
            async with self.client.post(
                url + "/abort_request", data=raw, headers=forward_headers(request.headers)
            ) as resp:
                answer = await resp.read()
                headers = pass_headers(resp.headers)
                headers[REPLICA_HEADER] = owner
                self._count(path, resp.status)
                return web.Response(status=resp.status, body=answer, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return self.error(path, 502, f"replica {owner!r}: {_describe(exc)}", "upstream_error")

    async def _url_of(self, server_id: str) -> str | None:
        status = await self.balancer.get_status()
        replica = status["replicas"].get(server_id)
        return None if replica is None else replica_url(replica["metadata"])

    async def workers(self, request: web.Request) -> web.Response:
        try:
            status = await self.balancer.get_status()
        except RedisUnavailable as exc:
            return self._unavailable(request.path, exc)
        rows = [
            {
                "id": sid,
                "url": replica_url(r["metadata"]),
                "inflight": r["inflight"],
                "draining": r["draining"],
                "capacity": r.get("capacity"),
                "ejected_until": r.get("ejected_until"),
            }
            for sid, r in sorted(status["replicas"].items())
        ]
        return web.json_response({"workers": rows})

    async def add_worker(self, request: web.Request) -> web.Response:
        """Register a replica (``redis-router servers add``): body {"id", "url", "capacity"?}."""
        path = request.path
        if not self._admitted(request):
            return self._refused(path)
        try:
            body = parse_json(await request.read())
            sid, url, capacity = _worker(body)
            meta = {"url": url}
            caps = None if capacity is None else {sid: capacity}
            added = await self.balancer.add_servers({sid: meta}, capacity=caps)
        except BadRequest as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param=exc.param)
        except (TypeError, ValueError) as exc:
            return self.error(path, 400, str(exc), "invalid_request_error")
        except RedisUnavailable as exc:
            return self._unavailable(path, exc)
        self._count(path, 200)
        return web.json_response(
            {"id": sid, "url": url, "capacity": capacity, "added": bool(added)}
        )

    async def remove_worker(self, request: web.Request) -> web.Response:
        """Remove a replica now, or with ``?drain=1`` drain it (``redis-router servers``)."""
        path, sid = request.path, request.match_info["id"]
        if not self._admitted(request):
            return self._refused(path)
        drain = request.query.get("drain", "0").lower() in ("1", "true", "yes")
        try:
            if sid not in await self.balancer.get_all_servers():
                return self.error(path, 404, f"no replica {sid!r} in the pool", "not_found_error")
            if drain:
                await self.balancer.drain_servers([sid])
            else:
                await self.balancer.remove_servers([sid])
        except (TypeError, ValueError) as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param="id")
        except RedisUnavailable as exc:
            return self._unavailable(path, exc)
        self._count("/workers", 200)
        return web.json_response({"id": sid, "draining" if drain else "removed": True})

    def _admitted(self, request: web.Request) -> bool:
        token = self.options.admin_token
        if token is None:
            return True
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    def _refused(self, path: str) -> web.Response:
        return self.error(
            path,
            401,
            "changing the pool needs the admin token: Authorization: Bearer <token>",
            "authentication_error",
        )

    async def not_found(self, request: web.Request) -> web.Response:
        return self.error(
            request.path, 404, f"no route {request.method} {request.path}", "not_found_error"
        )

    # -- answers ---------------------------------------------------------------------------

    def error(
        self,
        path: str,
        status: int,
        message: str,
        kind: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> web.Response:
        if self.metrics is not None:
            self.metrics.errors.labels(_endpoint(path), kind).inc()
        return web.json_response(
            error_body(message, kind, status, param), status=status, headers=headers
        )

    def _unavailable(self, path: str, exc: Exception) -> web.Response:
        """503: an empty or full pool, an ejected sticky replica, or Redis out of reach."""
        if isinstance(exc, ReplicaEjected):
            wait, kind = retry_after(exc.seconds_left), "replica_ejected"
        elif isinstance(exc, NoCapacity):
            wait, kind = "1", "no_capacity"
        elif isinstance(exc, NoServersAvailable):
            wait, kind = "1", "no_servers_available"
        else:
            wait, kind = "1", "redis_unavailable"
        return self.error(path, 503, str(exc), kind, headers={"Retry-After": wait})

    def _count(self, path: str, status: int) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(_endpoint(path), str(status)).inc()


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The client's headers for the replica, without hop-by-hop ones."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in HOP_HEADERS:
            out.add(k, v)
    return out


def pass_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The replica's response headers for the client, without hop-by-hop ones."""
    return forward_headers(headers)


def _is_sse(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == "text/event-stream"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _endpoint(path: str) -> str:
    """A metrics label with a bounded number of values."""
    if path in GENERATION_PATHS or path in ("/v1/models", "/abort_request", "/workers"):
        return path
    return "/workers" if path.startswith("/workers/") else "other"


def _prom_type() -> str:
    from .metrics import CONTENT_TYPE

    return CONTENT_TYPE


def _worker(body: Mapping[str, Any]) -> tuple[str, str, int | None]:
    unknown = sorted(set(body) - {"id", "url", "capacity"})
    if unknown:
        raise BadRequest(f"unknown key(s) {unknown}; a worker is {{'id', 'url', 'capacity'?}}")
    sid, url, capacity = body.get("id"), body.get("url"), body.get("capacity")
    if not isinstance(sid, str) or not sid:
        raise BadRequest("'id' must be a non-empty string (the replica id)", "id")
    if not isinstance(url, str) or replica_url(url) is None:
        raise BadRequest("'url' must be an http:// or https:// URL (the replica's root)", "url")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
        raise BadRequest("'capacity' must be an integer or null", "capacity")
    return sid, url.rstrip("/"), capacity


@contextlib.asynccontextmanager
async def running(front: Front, host: str, port: int, *, shutdown_timeout: float = 10.0) -> Any:
    """Serve ``front`` on host:port until the block ends; yields the bound (host, port)."""
    runner = web.AppRunner(
        front.app(), handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        yield bound[0], bound[1]
    finally:
        await runner.cleanup()
