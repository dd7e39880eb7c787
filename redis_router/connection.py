"""Turn a URL into a redis-py client, sync or asyncio, and describe it without its password.

Schemes, as the ``limits`` library spells them: ``redis://``, ``rediss://``, ``unix://``,
``redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db]`` and
``redis+cluster://[:password@]host:port[,host:port...]``.

A URL is shown only through :func:`redact`, which splits it as redis-py does (urllib), so no
password, query credential or part of one reaches an error, a log line or status output.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, parse_qs, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis import exceptions as rx
from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFoundError
from redis.sentinel import MasterNotFoundError

from .errors import (
    CredentialsRefused,
    PoolExhausted,
    RedisConfigError,
    RedisOutOfMemory,
    RedisUnavailable,
    UnknownRedisHost,
)
from .packing import pack_in_c

DEFAULT_URL = "redis://localhost:6379/0"
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")

# Fail fast during an outage (a refused connection fails at once; a silent host within 2 s)
# and retry a dropped connection briefly: a retried acquire carries the same lease token, so
# it is never counted twice.
CLIENT_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 2.0, "socket_timeout": 5.0}
RETRIES = 2
# Connections a balancer's client keeps at most (its ``max_connections`` option), and the
# seconds a call waits for one of them to be free before it raises PoolExhausted. Concurrent
# calls beyond the size wait their turn, as in redis-py's BlockingConnectionPool, rather than
# fail as if Redis were down.
DEFAULT_MAX_CONNECTIONS = 100
POOL_WAIT = 5.0
# Replies after which the script provably wrote nothing, so resending it is safe: the server
# became a replica in a failover (READONLY; inside a script, Redis 6.2 wraps it in "ERR Error
# running script ... -READONLY"), is loading its data, or lost its master or cluster quorum.
_TRANSIENT = re.compile(r"^(LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b|\bREADONLY\b")
# Redis refused a write over maxmemory: "OOM command not allowed ...", or inside a script on
# Redis 6.2 "ERR Error running script ... -OOM command not allowed ...".
_OOM = re.compile(r"(?:^|-)OOM\b")
# Resends after a transient reply, with their pauses (s): about half a second in all, so a
# call still fails fast, with RedisUnavailable, when the condition outlasts a failover's switch.
TRANSIENT_BACKOFF = (0.05, 0.1, 0.2, 0.2)

# A Sentinel-managed client asks Sentinel for the master at most this often (s), before a call.
# Without it a connection stays on a demoted master until Sentinel reconfigures that server as
# a replica, which takes up to ~10 s after a failover, and the writes it takes meanwhile are lost.
SENTINEL_RECHECK = 1.0
_last_check: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

# Query keys whose values are credentials (redis-py passes every query key to the client as
# a keyword: ?password=, and this module's ?sentinel_password=); hidden by redact(). Any key
# naming a password, secret, token or auth is taken for one, to be safe.
_SECRET_KEY = re.compile(r"pass|secret|token|auth", re.IGNORECASE)
HIDDEN = "***"


def redact(url: str) -> str:
    """The URL without its credentials, safe for errors, logs, repr and status output.

    Split as redis-py splits it (``urllib.parse.urlsplit``, as ``redis.connection.parse_url``
    does): the user info is the netloc up to its last ``@``, so a password holding ``@`` or
    ``:`` is hidden whole, and shown as ``user:***@``. In the query, the value of the first
    credential key (``password``, ``sentinel_password``, any key naming a password, secret,
    token or auth) and everything after it are hidden, since a raw ``&`` may continue it;
    a fragment is hidden. A raw ``/``, ``?`` or ``#`` in a password ends the netloc early
    (redis-py misreads such a URL too): when an ``@`` is left after the netloc, everything up
    to the last one is hidden. A URL that does not split at all is shown as its scheme."""
    if "://" not in url:  # no scheme (a malformed URL): split it as if it had one
        return redact("redis://" + url).removeprefix("redis://")
    scheme = url.partition("://")[0]
    head = f"{scheme}://"
    try:
        parts = urlsplit(url)
    except ValueError:
        return f"{head}{HIDDEN}"
    tail = _redact_query(parts.path, parts.query if "?" in url else None)
    if _runs_past_netloc(parts, url):
        # Shown: what follows its last @ (host, path), unless the URL also names a query
        # credential, which that @ may belong to.
        rest = tail + "#" + parts.fragment if parts.fragment else tail
        host = "" if _SECRET_KEY.search(url) else rest.rpartition("@")[2]
        return f"{head}{HIDDEN}@{host}"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    shown = ""
    if at:
        user, colon, _ = userinfo.partition(":")
        shown = f"{user}:{HIDDEN}@" if colon else f"{HIDDEN}@"
    fragment = f"#{HIDDEN}" if parts.fragment or url.endswith("#") else ""
    return f"{head}{shown}{hostport}{tail}{fragment}"


def _runs_past_netloc(parts: SplitResult, url: str) -> bool:
    """An @ is left after the netloc, outside the query's credential values: the user info
    holds a raw / ? or # and urllib (so redis-py) cut it short, taking part of it for the
    host, port or path."""
    tail = _redact_query(parts.path, parts.query if "?" in url else None)
    return "@" in tail or "@" in parts.fragment


def _redact_query(path: str, query: str | None) -> str:
    """Path and query, the query hidden from the value of its first credential key on."""
    if query is None:
        return path
    pairs = query.split("&")
    for i, pair in enumerate(pairs):
        key, equals, _ = pair.partition("=")
        if equals and _SECRET_KEY.search(unquote(key)):
            return f"{path}?{'&'.join([*pairs[:i], key + '=' + HIDDEN])}"
    return f"{path}?{query}"


# A URL's user info inside free text (an error message that quotes a URL): up to the last
# "@" before white space. Only for text; a URL itself is parsed by redact().
_USERINFO_IN_TEXT = re.compile(r"(?<=://)\S*@")


def hide_userinfo(text: str) -> str:
    """``text`` with the user info of any URL it quotes hidden."""
    return _USERINFO_IN_TEXT.sub(HIDDEN + "@", text)


def secrets(url: str) -> list[str]:
    """Every credential the URL holds, as written and decoded (for scrubbing text a redacted
    URL cannot protect, such as a message that quotes part of a URL): its password, user
    info up to the last ``@``, and the query's credential values; longest first."""
    found: set[str] = set()
    _, sep, rest = url.partition("://")
    rest = rest if sep else url
    if "@" in rest:
        userinfo = rest.rpartition("@")[0]
        found.update((userinfo, userinfo.partition(":")[2]))
    try:
        parts = urlsplit(url)
        lone_user = parts.username if parts.password is None else None  # redis://secret@host
        found.update((parts.password or "", lone_user or ""))
        for key, values in parse_qs(parts.query).items():
            if _SECRET_KEY.search(key):
                found.update(values)
    except ValueError:
        pass
    found |= {unquote(s) for s in found}
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` with every credential of ``url`` replaced (see :func:`secrets`)."""
    for secret in secrets(url):
        text = text.replace(secret, HIDDEN)
    return text


def shown_metadata(value: Any) -> Any:
    """A replica's metadata as status output shows it: every URL in it (a replica's own, e.g.
    ``http://user:password@host:8000``) redacted; the balancer keeps the value as stored, since
    the worker and ``serve`` need its credentials to reach the replica."""
    if isinstance(value, str):
        return redact(value) if "://" in value else value
    if isinstance(value, dict):
        return {k: shown_metadata(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_metadata(v) for v in value]
    return value


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
    if isinstance(exc, rx.ConnectionError) and str(exc) == "Too many connections":
        return pool_exhausted(0, None)  # a Cluster's or Sentinel's pool, which does not wait
    if isinstance(
        exc, (rx.ConnectionError, rx.TimeoutError, rx.AuthenticationWrongNumberOfArgsError)
    ):
        return unavailable(url, exc)
    if out_of_memory(exc):
        return out_of_memory_error(url, exc)
    if not transient(exc):
        return script_error(exc)
    if final:
        return RedisUnavailable(unavailable_message(url, exc))
    return None


def final_failure(
    exc: Exception, url: str, script_error: Callable[[Exception], Exception]
) -> Exception:
    """What a failed call raises when it is not sent again (send_failure with no pause left)."""
    error = send_failure(exc, url, script_error, True)
    assert error is not None  # final: never "send again"
    return error


def out_of_memory(exc: Exception) -> bool:
    """True for Redis's refusal of a write over ``maxmemory`` (``OOM ...``; inside a script,
    Redis 6.2 wraps it in ``ERR Error running script ... -OOM ...``)."""
    return isinstance(exc, rx.OutOfMemoryError) or bool(_OOM.search(str(exc)))


def out_of_memory_error(url: str, exc: Exception) -> RedisOutOfMemory:
    """The RedisOutOfMemory for a refused script: what happened and what to do."""
    reply = hide_userinfo(str(exc)).splitlines()[0][:200] if str(exc) else ""
    return RedisOutOfMemory(
        f"Redis at {url} is out of memory and refuses writes ({reply}): the call changed "
        "nothing and may be retried once memory is freed. Free memory or raise maxmemory "
        "(CONFIG SET maxmemory), and keep maxmemory-policy noeviction (an evicting policy "
        "would drop leases and corrupt counts)",
        reply,
    )


# getaddrinfo's "no such host" (not EAI_AGAIN, a DNS server that did not answer: an outage).
_NO_SUCH_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
# The same in an error rebuilt from text, which lost its cause (glibc's and macOS's words).
_NO_SUCH_HOST_TEXT = re.compile(
    r"Name or service not known|nodename nor servname provided|No address associated with host"
)
# Redis's replies when it requires a password the client did not give: NOAUTH (redis-py
# strips the prefix), and HELLO's words for it.
_NO_PASSWORD = re.compile(r"NOAUTH|[Aa]uthentication required|already authenticated")


def unavailable(url: str, exc: Exception) -> RedisUnavailable | RedisConfigError:
    """What a failure to reach Redis raises: RedisUnavailable (an outage: calls work again
    once Redis is back), or a RedisConfigError when no retry can help: Redis refused the
    credentials (CredentialsRefused), or the host name does not resolve (UnknownRedisHost).
    ``url`` is already redacted."""
    return config_error(url, exc) or RedisUnavailable(unavailable_message(url, exc))


def config_error(url: str, exc: BaseException) -> RedisConfigError | None:
    """The RedisConfigError that ``exc`` (or an error it was raised from) means, if any."""
    seen: BaseException | None = exc
    for _ in range(8):  # the error, its cause, theirs: a few links at most
        if seen is None:
            break
        if isinstance(seen, (rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError)):
            return CredentialsRefused(_credentials_message(url, seen))
        if isinstance(seen, socket.gaierror) and seen.errno in _NO_SUCH_HOST:
            return UnknownRedisHost(_unknown_host_message(url, exc))
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, rx.ConnectionError) and _NO_SUCH_HOST_TEXT.search(str(exc)):
        return UnknownRedisHost(_unknown_host_message(url, exc))
    return None


def _credentials_message(url: str, exc: BaseException) -> str:
    # Redis's own words, up to the first comma (HELLO's go on about its syntax)
    reply = hide_userinfo(str(exc)).splitlines()[0].split(",")[0][:120].rstrip(". ") or "refused"
    if isinstance(exc, rx.AuthenticationWrongNumberOfArgsError):
        why = "it takes a password only (a server before Redis 6 has no users): drop the user name"
    elif _NO_PASSWORD.search(str(exc)):
        why = "it requires a password and the URL gives none"
    else:
        why = "the password is wrong, or the user does not exist or is disabled"
    return (
        f"Redis at {url} refused the credentials: {why} (Redis: {reply}); retrying will not "
        "help. Check the user name and password in the URL (redis://USER:PASSWORD@host:port/db, "
        "percent-encoded, or ?username=...&password=...) and the server's requirepass or ACL "
        "user (ACL LIST: the user must exist, be on, and have that password)"
    )


def _unknown_host_message(url: str, exc: BaseException) -> str:
    detail = hide_userinfo(str(exc)).splitlines()[0][:200].rstrip(". ")
    return (
        f"the host of Redis at {url} does not resolve ({detail}); retrying will not help. "
        "Check the host name in the URL (its spelling; a name known only inside a container "
        "or cluster network)"
    )


def unavailable_message(url: str, exc: Exception) -> str:
    """The RedisUnavailable message: what failed and what to do, with the URL's password hidden."""
    detail = hide_userinfo(str(exc))
    if isinstance(exc, (MasterNotFoundError, AsyncMasterNotFoundError)):  # "...: <reprs> - why"
        head, _, more = detail.partition(" : ")
        why = more.rpartition(" - ")[2] if " - " in more else ""
        detail = f"{head} (no Sentinel reachable knows it{': ' + why if why else ''})"
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


def direct_pool(client: Any) -> Any | None:
    """The pool a balancer may take a connection of its own from, to write script calls
    there directly (redis_router.outbox, redis_router.direct): a plain client's. None for a
    Cluster client (it has no single pool) and a Sentinel-managed one (its master is checked
    before calls, which a held connection would skip)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or hasattr(pool, "get_master_address"):
        return None
    return pool


def resends(client: Any) -> bool:
    """Whether the client resends a command after a dropped connection (its Retry allows
    one): a call the balancer wrote on a connection of its own, which broke, is sent again
    the ordinary way only then, so a client made without retries sees the failure, as it
    would have."""
    get_retry = getattr(client, "get_retry", None)
    retry = get_retry() if callable(get_retry) else None
    if retry is None:
        return False
    get_retries = getattr(retry, "get_retries", None)
    retries = get_retries() if callable(get_retries) else getattr(retry, "_retries", 1)
    return bool(retries)


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
    """Resend after a dropped connection (refused, reset: it fails at once), never after a
    timeout: a silent Redis would make every copy wait a whole socket timeout more, so one
    call on it fails after one timeout (docs/operations.md, "A silent Redis")."""
    from redis.backoff import ExponentialBackoff

    retry = _redis_module(".retry", asyncio).Retry
    return retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES, supported_errors=_RESENT)


_RESENT = (rx.ConnectionError,)


def _no_retry(asyncio: bool) -> Any:
    """No retry, for the Sentinel clients: the master's client retries the whole call (which
    asks the Sentinels again), so a retry per Sentinel only multiplies the wait."""
    from redis.backoff import NoBackoff

    return _redis_module(".retry", asyncio).Retry(NoBackoff(), 0)


def _hosts(netloc: str, default_port: int) -> list[tuple[str, int]]:
    out = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        out.append((host or "localhost", int(port) if port else default_port))
    return out


def connect(url: str, *, asyncio: bool = False, max_connections: int | None = None) -> Any:
    """Build a client for ``url``; raises ValueError naming the scheme if it is unknown, or
    saying what cannot be parsed (never with the URL's credentials). ``max_connections``:
    its pool's size (see :func:`pool_size`)."""
    size = pool_size(max_connections)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"redis URL {redact(url)!r} has an unsupported scheme; use one of "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    try:
        misread = _runs_past_netloc(urlsplit(url), url)
    except ValueError:
        misread = True
    if misread:  # redis-py would connect elsewhere, and echo part of the password in errors
        raise ValueError(
            f"redis URL {redact(url)!r} cannot be parsed: an '@' follows the host, so a user "
            "name or password holds a raw / ? or #; percent-encode them (%2F %3F %23, and "
            "%40 for @)"
        )
    try:
        return _connect(url, scheme, asyncio, size)
    except _UrlError:
        raise
    except ValueError:  # urllib's or redis-py's message may quote part of a password
        raise ValueError(
            f"redis URL {redact(url)!r} cannot be parsed: its host:port or db is not valid; "
            "a user name or password must percent-encode any of @ : / ? # % (%40 for @, "
            "%2F for /)"
        ) from None


def _query_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without its ``?password=`` / ``?username=``, and those values decoded once.
    redis-py before 8.1 decodes query values twice, so a password holding ``%40`` as such
    reached the server as ``@``."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    credentials: dict[str, str] = {}
    for key, value in pairs:  # the first non-empty value, as redis-py takes it
        if key in ("username", "password") and value:
            credentials.setdefault(key, value)
    if not credentials:
        return url, {}
    rest = urlencode([(k, v) for k, v in pairs if k not in credentials])
    return urlunsplit(parts._replace(query=rest)), credentials


class _UrlError(ValueError):
    """A URL refused by this module, whose message is already free of credentials."""


def _connect(url: str, scheme: str, asyncio: bool, size: int) -> Any:
    opts = dict(CLIENT_OPTIONS, decode_responses=True, retry=_retry(asyncio))
    if scheme in ("redis", "rediss", "unix"):
        url, credentials = _query_credentials(url)
        pool = _waiting_pool(asyncio).from_url(
            url, max_connections=size, timeout=POOL_WAIT, **opts, **credentials
        )
        client = _redis_module("", asyncio).Redis.from_pool(pool)
        return _packing(client, asyncio)
    opts["max_connections"] = size  # sized; a Cluster's or Sentinel's pool does not wait

    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    password = unquote(parts.password) if parts.password else None
    username = unquote(parts.username) if parts.username else None
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if scheme == "redis+cluster":
        cluster = _redis_module(".cluster", asyncio)
        nodes = [cluster.ClusterNode(h, p) for h, p in _hosts(netloc, 6379)]
        opts.pop("retry")  # RedisCluster retries by itself (MOVED, failover)
        try:  # the sync client reaches a node here, the asyncio one at its first command
            return cluster.RedisCluster(
                startup_nodes=nodes, password=password, username=username, **opts
            )
        except (rx.RedisClusterException, rx.ConnectionError, rx.TimeoutError) as exc:
            raise unavailable(redact(url), exc) from None
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise _UrlError(
            f"redis URL {redact(url)!r} names no service: use "
            "redis+sentinel://host:port[,host:port...]/service_name"
        )
    sentinel_kw = {}
    if "sentinel_password" in query:
        sentinel_kw["password"] = query["sentinel_password"]
    sentinel_mod = _redis_module(".sentinel", asyncio)
    # redis-py's Sentinel clients retry a refused connection for ~15 s by default; these fail
    # as fast as a redis:// client does (an unreachable Sentinel is an outage like any other).
    sentinel_opts = dict(CLIENT_OPTIONS, retry=_no_retry(asyncio))
    sentinel = sentinel_mod.Sentinel(
        _hosts(netloc, 26379),
        sentinel_kwargs=dict(sentinel_opts, **sentinel_kw),
        **CLIENT_OPTIONS,
    )
    db = int(path[1]) if len(path) > 1 else 0
    master = sentinel.master_for(path[0], password=password, username=username, db=db, **opts)
    return _packing(master, asyncio)


def pool_size(max_connections: Any) -> int:
    """The pool size for a balancer's ``max_connections`` (None: the default), checked."""
    if max_connections is None:
        return DEFAULT_MAX_CONNECTIONS
    if isinstance(max_connections, bool) or not isinstance(max_connections, int):
        raise TypeError(f"max_connections must be an int, got {type(max_connections).__name__}")
    if max_connections < 2:
        raise ValueError(
            f"max_connections must be at least 2 (one connection is kept for the balancer's "
            f"ordered writes), got {max_connections}"
        )
    return max_connections


def pool_exhausted(size: int, waited: float | None) -> PoolExhausted:
    """The error for a call that found no free connection in its pool."""
    within = f" within {waited:g}s" if waited else ""
    now = f"now {size}, " if size else ""
    return PoolExhausted(
        f"all {size or 'the'} connections of the balancer's pool were busy and none was free"
        f"{within}: this process makes more concurrent calls than its pool holds, or Redis "
        f"is slow to answer; Redis was not reported down. Raise the balancer's "
        f"max_connections ({now}default {DEFAULT_MAX_CONNECTIONS}), or make fewer "
        "calls at once",
        size,
    )


@functools.cache
def _waiting_pool(asyncio: bool) -> Any:
    """redis-py's BlockingConnectionPool (sync or asyncio), raising PoolExhausted when its
    wait runs out (redis-py says ConnectionError, which would read as an outage)."""
    base: Any = _redis_module(".connection", asyncio).BlockingConnectionPool

    def exhausted(pool: Any, exc: rx.ConnectionError) -> Exception:
        if "No connection available" in str(exc):
            return pool_exhausted(pool.max_connections, pool.timeout)
        return exc

    if asyncio:

        async def get_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await base.get_connection(self, *args, **kwargs)
            except rx.ConnectionError as exc:
                raise exhausted(self, exc) from None

        get: Any = get_async
    else:

        def get_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return base.get_connection(self, *args, **kwargs)
            except rx.ConnectionError as exc:
                raise exhausted(self, exc) from None

        get = get_sync
    return type("WaitingConnectionPool", (base,), {"get_connection": get, "__module__": __name__})


def _packing(client: Any, asyncio: bool) -> Any:
    """A client whose connections pack script calls with hiredis directly (see packing.py)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        pack_in_c(pool, asyncio=asyncio)
    return client


def client_for(
    redis: Any, *, asyncio: bool, max_connections: int | None = None
) -> tuple[Any, str, bool]:
    """(client, password-free description, whether we own it) for the balancer's ``redis=``;
    ``max_connections``: the size of the pool of a client made from a URL."""
    if redis is None or isinstance(redis, str):
        url = resolve_url(redis)
        return connect(url, asyncio=asyncio, max_connections=max_connections), redact(url), True
    if max_connections is not None:
        pool_size(max_connections)
        raise ValueError(
            "max_connections sizes the pool of a client the balancer makes from a URL; a "
            "redis client passed in keeps its own pool (size it where it is made)"
        )
    if not callable(getattr(redis, "evalsha", None)):
        raise TypeError(
            "redis must be a URL string or a redis-py client "
            f"({'redis.asyncio' if asyncio else 'redis'}.Redis, RedisCluster, or a Sentinel "
            f"master), got {type(redis).__name__}"
        )
    return redis, describe(redis), False
