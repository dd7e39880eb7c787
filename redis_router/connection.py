"""Turn a URL into a redis-py client, sync or asyncio, and describe it without its password.

Schemes, as the ``limits`` library spells them: ``redis://``, ``rediss://``, ``unix://``,
``redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db]`` and
``redis+cluster://[:password@]host:port[,host:port...]``.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import time
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis import exceptions as rx

from .errors import RedisUnavailable
from .packing import pack_in_c

DEFAULT_URL = "redis://localhost:6379/0"
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")

# Fail fast during an outage (a refused connection fails at once; a silent host within 2 s)
# and retry a dropped connection briefly: a retried acquire carries the same lease token, so
# it is never counted twice.
CLIENT_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}
RETRIES = 2
# Replies after which the script provably wrote nothing, so resending it is safe: the server
# became a replica in a failover (READONLY; inside a script, Redis 6.2 wraps it in "ERR Error
# running script ... -READONLY"), is loading its data, or lost its master or cluster quorum.
_TRANSIENT = re.compile(r"^(LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b|\bREADONLY\b")
# Resends after a transient reply, with their pauses (s): about half a second in all, so a
# call still fails fast, with RedisUnavailable, when the condition outlasts a failover's switch.
TRANSIENT_BACKOFF = (0.05, 0.1, 0.2, 0.2)

# A Sentinel-managed client asks Sentinel for the master at most this often (s), before a call.
# Without it a connection stays on a demoted master until Sentinel reconfigures that server as
# a replica, which takes up to ~10 s after a failover, and the writes it takes meanwhile are lost.
SENTINEL_RECHECK = 1.0
_last_check: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

_PASSWORD = re.compile(r"(?<=://)([^@/]*)@")


def redact(url: str) -> str:
    """The URL with any user:password part replaced, safe for errors, logs and status."""

    def hide(m: re.Match[str]) -> str:
        userinfo = m.group(1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        return f"{user}:***@" if (user or ":" in userinfo) else "***@"

    return _PASSWORD.sub(hide, url)


def resolve_url(url: str | None) -> str:
    return url or os.environ.get("REDIS_URL") or DEFAULT_URL


def describe(client: Any) -> str:
    """A password-free URL-like description of a ready client (for error messages)."""
    nodes = getattr(client, "startup_nodes", None) or getattr(client, "nodes_manager", None)
    if nodes is not None and hasattr(client, "get_nodes"):
        try:
            hosts = ",".join(f"{n.host}:{n.port}" for n in client.get_nodes())
        except Exception:  # pragma: no cover - defensive: description only
            hosts = "?"
        return f"redis+cluster://{hosts}"
    pool = getattr(client, "connection_pool", None)
    kw = getattr(pool, "connection_kwargs", {}) or {}
    service = getattr(pool, "service_name", None)
    if service:
        return f"redis+sentinel://{service}"
    if "path" in kw:
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def transient(exc: Exception) -> bool:
    """True for an error reply after which nothing was written and a resend may succeed."""
    return bool(_TRANSIENT.search(str(exc)))


def send_failure(
    exc: Exception, url: str, script_error: Callable[[Exception], Exception], final: bool
) -> Exception | None:
    """What a failed script call means, for the sync and async balancers alike: the exception
    to raise, or None when nothing was written and the call should be resent after a pause
    (``final``: no pause is left)."""
    if isinstance(exc, (rx.ConnectionError, rx.TimeoutError)):
        return RedisUnavailable(unavailable_message(url, exc))
    if not transient(exc):
        return script_error(exc)
    if final:
        return RedisUnavailable(unavailable_message(url, exc))
    return None


def unavailable_message(url: str, exc: Exception) -> str:
    """The RedisUnavailable message: what failed and what to do, with the URL's password hidden."""
    detail = redact(str(exc))
    if transient(exc):
        return (
            f"Redis at {url} is not accepting writes ({detail.splitlines()[0][:200]}): a failover "
            "or restart is in progress, or the URL names a replica; retry shortly, and use "
            "redis+sentinel:// or redis+cluster:// so that clients follow the new master"
        )
    return f"cannot reach Redis at {url}: {detail}; calls work again once it is back"


def stale_pools(client: Any) -> list[Any]:
    """The connection pools to empty after a transient reply, so the next connection asks
    Sentinel for the master again (a Cluster client follows its topology by itself)."""
    pool = getattr(client, "connection_pool", None)
    return [pool] if pool is not None and callable(getattr(pool, "disconnect", None)) else []


def sentinel_check_due(client: Any) -> Any | None:
    """The client's Sentinel pool when its master address is due for a recheck, else None.
    The caller runs ``pool.get_master_address()``, which drops idle connections on a change."""
    pool = getattr(client, "connection_pool", None)
    if not getattr(pool, "is_master", False) or not hasattr(pool, "get_master_address"):
        return None
    now = time.monotonic()
    if now - _last_check.get(pool, -math.inf) < SENTINEL_RECHECK:
        return None
    _last_check[pool] = now
    return pool


def _redis_module(name: str, asyncio: bool) -> Any:
    """redis-py's sync module ``redis<name>`` or its asyncio twin ``redis.asyncio<name>``
    (they mirror each other name for name)."""
    return importlib.import_module(("redis.asyncio" if asyncio else "redis") + name)


def _retry(asyncio: bool) -> Any:
    from redis.backoff import ExponentialBackoff

    retry = _redis_module(".retry", asyncio).Retry
    return retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)


def _hosts(netloc: str, default_port: int) -> list[tuple[str, int]]:
    out = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        out.append((host or "localhost", int(port) if port else default_port))
    return out


def connect(url: str, *, asyncio: bool = False) -> Any:
    """Build a client for ``url``; raises ValueError naming the scheme if it is unknown."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"redis URL {redact(url)!r} has an unsupported scheme; use one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    opts = dict(CLIENT_OPTIONS, decode_responses=True, retry=_retry(asyncio))
    if scheme in ("redis", "rediss", "unix"):
        return _packing(_redis_module("", asyncio).Redis.from_url(url, **opts), asyncio)

    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if scheme == "redis+cluster":
        cluster = _redis_module(".cluster", asyncio)
        nodes = [cluster.ClusterNode(h, p) for h, p in _hosts(netloc, 6379)]
        opts.pop("retry")  # RedisCluster retries by itself (MOVED, failover)
        return cluster.RedisCluster(
            startup_nodes=nodes, password=password, username=username, **opts
        )
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(
            f"redis URL {redact(url)!r} names no service: use "
            "redis+sentinel://host:port[,host:port...]/service_name"
        )
    sentinel_kw = {}
    if "sentinel_password" in query:
        sentinel_kw["password"] = query["sentinel_password"]
    sentinel = _redis_module(".sentinel", asyncio).Sentinel(
        _hosts(netloc, 26379),
        sentinel_kwargs=dict(CLIENT_OPTIONS, **sentinel_kw),
        **CLIENT_OPTIONS,
    )
    db = int(path[1]) if len(path) > 1 else 0
    master = sentinel.master_for(path[0], password=password, username=username, db=db, **opts)
    return _packing(master, asyncio)


def _packing(client: Any, asyncio: bool) -> Any:
    """An asyncio client whose connections pack commands in C (see packing.py); a sync
    client's already do."""
    if asyncio:
        pack_in_c(client.connection_pool)
    return client


def client_for(redis: Any, *, asyncio: bool) -> tuple[Any, str, bool]:
    """(client, password-free description, whether we own it) for the balancer's ``redis=``."""
    if redis is None or isinstance(redis, str):
        url = resolve_url(redis)
        return connect(url, asyncio=asyncio), redact(url), True
    if not callable(getattr(redis, "evalsha", None)):
        raise TypeError(
            "redis must be a URL string or a redis-py client "
            f"({'redis.asyncio' if asyncio else 'redis'}.Redis, RedisCluster, or a Sentinel "
            f"master), got {type(redis).__name__}"
        )
    return redis, describe(redis), False
