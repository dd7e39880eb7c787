"""What a serve instance answers besides generation: the pool (``/workers``), aborts, models,
health and metrics, and the error answers every endpoint shares (OpenAI's error shape)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict

from .. import dp
from ..aio import AsyncRedisLoadBalancer
from ..connection import hide_userinfo, redact, scrub
from .routing import (
    GENERATION_PATHS,
    NOT_ROUTED,
    REQUEST_ID_HEADER,
    BadRequest,
    SessionRule,
    error_body,
    parse_json,
    refusal,
    replica_url,
    retry_ids,
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
# Client connections (see ServeOptions): as gateways bound theirs (haproxy's http-request
# timeout, Go's ReadHeaderTimeout; nginx keeps idle clients 75 s, aiohttp's default too).
HEADER_TIMEOUT = 10.0
KEEPALIVE_TIMEOUT = 75.0
MAX_IDLE_CONNECTIONS = 1024


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
    # Client connections: seconds from a request's first byte to the end of its headers,
    # seconds a kept-alive connection may wait idle, and how many may wait idle at once.
    header_timeout: float = HEADER_TIMEOUT
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    max_idle_connections: int = MAX_IDLE_CONNECTIONS
    # When set, POST and DELETE /workers need "Authorization: Bearer <token>".
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int):
            raise TypeError(f"retries must be an int, got {type(self.retries).__name__}")
        if not 0 <= self.retries <= 10:
            raise ValueError(f"retries must be in [0, 10], got {self.retries}")
        for name in ("connect_timeout", "models_timeout", "header_timeout", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.upstream_timeout is not None and not self.upstream_timeout > 0:
            raise ValueError("upstream_timeout must be > 0 seconds or None")
        n = self.max_idle_connections
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_idle_connections must be an int >= 1, got {n!r}")


class Handlers:
    """The endpoints of one serve instance other than generation, and what all share."""

    def __init__(
        self, balancer: AsyncRedisLoadBalancer, options: ServeOptions, metrics: Any = None
    ) -> None:
        self.balancer, self.options, self.metrics = balancer, options, metrics
        self.declared = tuple(balancer.require_acquire_fields())
        self._client: aiohttp.ClientSession | None = None

    @property
    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None, "the app has not started"
        return self._client

    # -- the pool, aborts, models, health ---------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """The union of the replicas' /v1/models (each asked at once, within a timeout)."""
        try:
            status = await self.balancer.get_status()
        except NOT_ROUTED as exc:
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
        except NOT_ROUTED as exc:
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
        except NOT_ROUTED as exc:
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
                url + "/abort_request",
                data=raw,
                headers=to_replica(forward_headers(request.headers), url),
            ) as resp:
                answer = await resp.read()
                headers = pass_headers(resp.headers)
                headers[REPLICA_HEADER] = owner
                self._count(path, resp.status)
                return web.Response(status=resp.status, body=answer, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return self.error(
                path, 502, f"replica {owner!r}: {describe_error(exc, url)}", "upstream_error"
            )

    async def _url_of(self, server_id: str) -> str | None:
        status = await self.balancer.get_status()
        replica = status["replicas"].get(server_id)
        return None if replica is None else replica_url(replica["metadata"])

    async def workers(self, request: web.Request) -> web.Response:
        try:
            status = await self.balancer.get_status()
        except NOT_ROUTED as exc:
            return self._unavailable(request.path, exc)
        rows = [
            {
                "id": sid,
                "url": shown_url(replica_url(r["metadata"])),
                "inflight": r["inflight"],
                "draining": r["draining"],
                "capacity": r.get("capacity"),
                "ejected_until": r.get("ejected_until"),
            }
            for sid, r in sorted(status["replicas"].items())
        ]
        return web.json_response({"workers": rows})

    async def add_worker(self, request: web.Request) -> web.Response:
        """Register a replica (``redis-router servers add``): body {"id", "url", "capacity"?,
        "dp_size"?}."""
        path = request.path
        if not self._admitted(request):
            return self._refused(path)
        try:
            body = parse_json(await request.read())
            sid, url, capacity, dp_size = _worker(body)
            meta: dict[str, Any] = {"url": url}
            if dp_size is not None:  # one pool member per rank (redis_router.dp)
                meta[dp.DP_SIZE] = dp_size
            caps = None if capacity is None else {sid: capacity}
            added = await self.balancer.add_servers({sid: meta}, capacity=caps)
        except BadRequest as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param=exc.param)
        except (TypeError, ValueError) as exc:
            return self.error(path, 400, str(exc), "invalid_request_error")
        except NOT_ROUTED as exc:
            return self._unavailable(path, exc)
        self._count(path, 200)
        return web.json_response(
            {
                "id": sid,
                "url": redact(url),
                "capacity": capacity,
                "dp_size": dp_size,
                "added": bool(added),
            }
        )

    async def remove_worker(self, request: web.Request) -> web.Response:
        """Remove a replica now, or with ``?drain=1`` drain it (``redis-router servers``)."""
        path, sid = request.path, request.match_info["id"]
        if not self._admitted(request):
            return self._refused(path)
        drain = request.query.get("drain", "0").lower() in ("1", "true", "yes")
        try:
            pool = await self.balancer.get_all_servers()
            if sid not in pool and all(dp.replica_of(u)[0] != sid for u in pool):
                return self.error(path, 404, f"no replica {sid!r} in the pool", "not_found_error")
            if drain:
                await self.balancer.drain_servers([sid])
            else:
                await self.balancer.remove_servers([sid])
        except (TypeError, ValueError) as exc:
            return self.error(path, 400, str(exc), "invalid_request_error", param="id")
        except NOT_ROUTED as exc:
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
        """404, or 405 with ``Allow`` for a path served under other methods."""
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource is not request.match_info.route.resource:  # not this catch-all
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            return self.error(
                request.path,
                405,
                f"{request.method} is not allowed on {request.path}; allowed: "
                f"{', '.join(sorted(allowed))}",
                "method_not_allowed_error",
                headers={"Allow": ", ".join(sorted(allowed))},
            )
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
        wait, kind = refusal(exc)
        return self.error(
            path, 503, str(exc), kind, headers={"Retry-After": wait} if wait else None
        )

    def _count(self, path: str, status: int) -> None:
        if self.metrics is not None:
            self.metrics.answered(_endpoint(path), status)


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The client's headers for the replica, without hop-by-hop ones."""
    return CIMultiDict([(k, v) for k, v in headers.items() if k.lower() not in HOP_HEADERS])


def to_replica(headers: CIMultiDict[str], url: str) -> CIMultiDict[str]:
    """Forwarded headers (:func:`forward_headers`) for the replica at ``url``: without the
    client's ``Authorization`` when the URL carries the replica's own credentials, which go
    as its Authorization header instead."""
    if not has_userinfo(url):
        return headers
    out = headers.copy()
    out.popall(hdrs.AUTHORIZATION, None)
    return out


def has_userinfo(url: str) -> bool:
    """The URL names credentials (``http://user:password@host``)."""
    return "@" in url.partition("://")[2].partition("/")[0]


def shown_url(url: str | None) -> str | None:
    """A replica's URL as any answer shows it: without its credentials."""
    return None if url is None else redact(url)


def pass_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The replica's response headers for the client, without hop-by-hop ones."""
    return forward_headers(headers)


def describe_error(exc: BaseException, url: str | None = None) -> str:
    """An upstream error for an answer: its type and message, with the credentials of the
    replica's ``url`` (and of any URL it quotes) hidden."""
    text = hide_userinfo(str(exc) if url is None else scrub(str(exc), url))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _endpoint(path: str) -> str:
    """A metrics label with a bounded number of values."""
    if path in GENERATION_PATHS or path in ("/v1/models", "/abort_request", "/workers"):
        return path
    return "/workers" if path.startswith("/workers/") else "other"


def _prom_type() -> str:
    from .metrics import CONTENT_TYPE

    return CONTENT_TYPE


def _worker(body: Mapping[str, Any]) -> tuple[str, str, int | None, int | None]:
    """(id, url, capacity, dp_size) of a POST /workers body, checked."""
    unknown = sorted(set(body) - {"id", "url", "capacity", dp.DP_SIZE})
    if unknown:
        raise BadRequest(
            f"unknown key(s) {unknown}; a worker is {{'id', 'url', 'capacity'?, 'dp_size'?}}"
        )
    sid, url, capacity = body.get("id"), body.get("url"), body.get("capacity")
    if not isinstance(sid, str) or not sid:
        raise BadRequest("'id' must be a non-empty string (the replica id)", "id")
    if dp.replica_of(sid)[1] is not None:
        raise BadRequest(
            f"'id' must not end like a data-parallel rank's (#dp<k>, reserved), got {sid!r}",
            "id",
        )
    if not isinstance(url, str) or replica_url(url) is None:
        raise BadRequest("'url' must be an http:// or https:// URL (the replica's root)", "url")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
        raise BadRequest("'capacity' must be an integer or null", "capacity")
    try:  # the library's own check of a replica's metadata
        dp_size = dp.dp_size(body, sid)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc), dp.DP_SIZE) from None
    return sid, url.rstrip("/"), capacity, dp_size
