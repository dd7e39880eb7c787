"""httpx transports that route each request through a balancer, in-process (no router hop):

    lb = AsyncRedisLoadBalancer(redis=url, name="rollout")
    client = openai.AsyncOpenAI(
        base_url="http://router/v1",  # any host: the path and query go to the granted replica
        api_key="...",
        http_client=httpx.AsyncClient(transport=AsyncRouterTransport(lb)),
    )

The rules are ``redis-router serve``'s (:mod:`redis_router.http.routing`): the session comes
from the ``X-Session-ID`` header (or a body field), else the request id from ``X-Request-Id``
or the body's ``rid``, else a fresh one; the prompt fills the policy's declared fields; a
malformed generation body is answered 400 without a lease. The lease is held until the
response is closed (httpx closes it once read; a stream when the ``with`` block ends), and
the release is queued then, not waited for (the balancer answers it in the background, ahead
of its later calls, and its ``close()`` waits for it); a 5xx or a broken body releases it as
failed; a connection error before the response is
reported as a failure and retried on another replica, up to ``retries``, each retry excluding
every replica that failed the request (``acquire(exclude=...)``; 502 once the retries are
spent or no other replica takes new sessions; a timeout is reported and raised as httpx
raises it, not retried). A full or empty pool
is answered 503 with ``Retry-After``, as the server does.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import httpx

from .. import dp
from ..core import run_steps, run_steps_async
from ..errors import (
    ConfigMismatch,
    NoServersAvailable,
    RedisUnavailable,
)
from .routing import (
    DEFAULT_SESSION_HEADER,
    NOT_ROUTED,
    BadRequest,
    Route,
    SessionRule,
    error_body,
    refusal,
    replica_url,
    route_request,
)

__all__ = ["AsyncRouterTransport", "RouterTransport"]


class _Rules:
    """What both transports share: the session rule, the retries, the declared fields."""

    def __init__(
        self, balancer: Any, retries: int, session_header: str, session_field: str | None
    ) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
            raise ValueError(f"retries must be an int in [0, 10], got {retries!r}")
        self.balancer, self.retries = balancer, retries
        self.rule = SessionRule(session_header, session_field)
        self.declared = tuple(balancer.require_acquire_fields())

    def route(self, request: httpx.Request, raw: bytes) -> tuple[Route, dict[str, Any]]:
        route = route_request(request.url.path, raw, request.headers, self.rule)
        return route, route.fields(self.declared)


def _retarget(
    request: httpx.Request, base: str, raw: bytes, handle: Any, route: Route
) -> httpx.Request:
    """The request, sent to the replica at ``base`` (its path and query kept); for a rank of
    a data-parallel replica (redis_router.dp), with vLLM's rank header and SGLang's rank
    field in a JSON body."""
    rank = dp.vllm_headers(handle)
    body = dp.rank_body(handle, route.body) if rank else None
    drop = {"host", *(k.lower() for k in rank)} | ({"content-length"} if body else set())
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in drop]
    headers += rank.items()
    url = httpx.URL(base + request.url.raw_path.decode("ascii"))
    return httpx.Request(
        request.method,
        url,
        headers=headers,
        content=body or raw,
        extensions=request.extensions,
    )


def _answer(status: int, message: str, kind: str, **extra: Any) -> httpx.Response:
    headers = {"Content-Type": "application/json", **extra.pop("headers", {})}
    body = json.dumps(error_body(message, kind, status, extra.get("param"))).encode()
    return httpx.Response(status, headers=headers, content=body)


def _unavailable(exc: Exception) -> httpx.Response:
    wait, kind = refusal(exc)
    return _answer(503, str(exc), kind, headers={"Retry-After": wait} if wait else {})


def _exhausted(attempts: int, why: str) -> httpx.Response:
    return _answer(
        502, f"no replica answered in {attempts} attempt(s); last: {why}", "upstream_error"
    )


class _Acquire(NamedTuple):
    """Acquire a lease for the request, every replica in ``exclude`` set aside."""

    request_id: str
    exclude: set[str] | None
    fields: dict[str, Any]


class _Report(NamedTuple):
    """Report the lease's attempt as failed, and wait for that (it counts toward ejecting
    the replica before the next acquire)."""

    lease: Any


class _Send(NamedTuple):
    """Send the request through the inner transport."""

    request: httpx.Request


class _Forwarded(NamedTuple):
    """A replica's response, and the lease its body holds until it is closed."""

    response: httpx.Response
    lease: Any


_Step = _Acquire | _Report | _Send


def _forward(
    rules: _Rules, request: httpx.Request, raw: bytes
) -> Generator[_Step, Any, httpx.Response | _Forwarded]:
    """One request's routing, I/O-free: each step is run by the transport's driver (blocking
    or asyncio) and its reply sent back, or its error thrown back in. Returns the answer, or
    the replica's response with its lease."""
    try:
        route, fields = rules.route(request, raw)
    except BadRequest as exc:
        return _answer(400, str(exc), "invalid_request_error", param=exc.param)
    failed: Any = None
    avoid: set[str] = set()
    why = "no attempt"
    try:
        for _ in range(rules.retries + 1):
            if failed is not None:  # reported first: it counts toward ejecting it
                avoid.add(failed.server_id)
                reported, failed = failed, None
                with contextlib.suppress(RedisUnavailable):
                    yield _Report(reported)
            try:
                lease = yield _Acquire(route.request_id, set(avoid) or None, fields)
            except NOT_ROUTED as exc:
                if avoid and type(exc) is NoServersAvailable:  # each one left failed it
                    why += "; no other replica takes new sessions"
                    break
                return _unavailable(exc)
            except ConfigMismatch as exc:
                return _answer(500, str(exc), "config_mismatch")
            except (TypeError, ValueError) as exc:
                return _answer(400, str(exc), "invalid_request_error")
            base = replica_url(lease.handle)
            if base is None:
                failed, why = lease, f"replica {lease.server_id!r} has no url in its metadata"
                continue
            try:
                resp = yield _Send(_retarget(request, base, raw, lease.handle, route))
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached
                failed, why = lease, f"replica {lease.server_id!r}: {exc!r}"
                continue
            except httpx.TimeoutException:  # it may be working on it: no retry
                lease.fail()  # queued now, answered in the background
                raise
            except httpx.TransportError as exc:
                failed, why = lease, f"replica {lease.server_id!r}: {exc!r}"
                continue
            except BaseException:  # a cancelled or interrupted caller
                lease.release()  # queued now, answered in the background
                raise
            return _Forwarded(resp, lease)
    finally:
        if failed is not None:
            failed.fail()  # queued now, answered in the background
    return _exhausted(len(avoid) + (failed is not None), why)


def _response(
    outcome: httpx.Response | _Forwarded, leased: type[_Leased | _AsyncLeased]
) -> httpx.Response:
    """The response to give the caller: an answer as it is; a replica's, with a body whose
    lease ends when it is closed (failed for a 5xx or a body that broke off)."""
    if isinstance(outcome, httpx.Response):
        return outcome
    resp, lease = outcome
    return httpx.Response(
        resp.status_code,
        headers=resp.headers,
        stream=leased(resp.stream, lease, resp.status_code >= 500),
        extensions=resp.extensions,
    )


Inner = TypeVar("Inner", httpx.BaseTransport, httpx.AsyncBaseTransport)


class _Routed(Generic[Inner]):
    """What both transports are made of: a balancer of their flavour, the routing rules and
    the transport that sends to the replicas."""

    _asyncio: ClassVar[bool]

    def __init__(
        self,
        balancer: Any,
        *,
        retries: int = 2,
        session_header: str = DEFAULT_SESSION_HEADER,
        session_field: str | None = None,
        transport: Inner | None = None,
    ) -> None:
        acquire = getattr(balancer, "acquire", None)
        if acquire is None or inspect.iscoroutinefunction(acquire) != self._asyncio:
            mine, twin, instead = (
                ("an asyncio balancer (AsyncRedisLoadBalancer)", "RouterTransport", "a sync one")
                if self._asyncio
                else (
                    "a sync balancer (RedisLoadBalancer)",
                    "AsyncRouterTransport",
                    "an asyncio one",
                )
            )
            raise TypeError(
                f"{type(self).__name__} needs {mine}, got {type(balancer).__name__}; use {twin} "
                f"for {instead}"
            )
        self._rules = _Rules(balancer, retries, session_header, session_field)
        self._inner: Inner = transport or self._default_inner()

    def _default_inner(self) -> Inner:
        raise NotImplementedError


class AsyncRouterTransport(_Routed[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport):
    """Route an ``httpx.AsyncClient``'s requests through an asyncio balancer
    (:class:`~redis_router.AsyncRedisLoadBalancer` or a router built on it)."""

    _asyncio = True

    def _default_inner(self) -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        forwarded = await run_steps_async(_forward(self._rules, request, raw), self._run)
        return _response(forwarded, _AsyncLeased)

    async def _run(self, step: _Step) -> Any:
        if isinstance(step, _Acquire):
            return await self._rules.balancer.acquire(
                step.request_id, exclude=step.exclude, **step.fields
            )
        if isinstance(step, _Report):
            return await step.lease.fail()
        return await self._inner.handle_async_request(step.request)

    async def aclose(self) -> None:
        """Close the inner transport (the balancer is the caller's to close)."""
        await self._inner.aclose()


class RouterTransport(_Routed[httpx.BaseTransport], httpx.BaseTransport):
    """Route an ``httpx.Client``'s requests through a sync balancer
    (:class:`~redis_router.RedisLoadBalancer` or a router built on it)."""

    _asyncio = False

    def _default_inner(self) -> httpx.BaseTransport:
        return httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        raw = request.read()
        return _response(run_steps(_forward(self._rules, request, raw), self._run), _Leased)

    def _run(self, step: _Step) -> Any:
        if isinstance(step, _Acquire):
            return self._rules.balancer.acquire(
                step.request_id, exclude=step.exclude, **step.fields
            )
        if isinstance(step, _Report):
            return step.lease.fail()
        return self._inner.handle_request(step.request)

    def close(self) -> None:
        self._inner.close()


class _AsyncLeased(httpx.AsyncByteStream):
    """A response body whose lease ends when it is closed (failed if the body broke off)."""

    def __init__(self, inner: Any, lease: Any, failed: bool) -> None:
        self._inner, self._lease, self._failed = inner, lease, failed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx.TransportError:
            self._failed = True
            raise

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            # Queued now, ahead of the balancer's later calls, and answered in the background:
            # closing a response does not wait for Redis (the balancer's close() does).
            self._lease.fail() if self._failed else self._lease.release()


class _Leased(httpx.SyncByteStream):
    """The sync twin of :class:`_AsyncLeased`."""

    def __init__(self, inner: Any, lease: Any, failed: bool) -> None:
        self._inner, self._lease, self._failed = inner, lease, failed

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._inner
        except httpx.TransportError:
            self._failed = True
            raise

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._lease.fail() if self._failed else self._lease.release()
