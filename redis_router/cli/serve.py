"""`redis-router serve`: an OpenAI-compatible HTTP front on the shared balancer.

Any number of these may run on one Redis and balancer name (behind any L4 load balancer):
they keep no state of their own, so they route as one balancer, the same one library
workers, `redis-router status` and the exporter see. Balancer options come from flags or a
router YAML (``--router-config``, the plugins' format); a flag wins over the file. See
docs/http.md. Needs the http extra (from a checkout: ``pip install -e '.[http]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

from ..connection import redact, resolve_url
from . import serve_processes
from .common import CliError
from .serve_processes import METRICS_DIR_ENV

DEFAULT_PORT = 8000
MAX_PROCESSES = 64
# When set, registering and removing replicas over HTTP (/workers) needs this bearer token
# (an environment variable, not a flag, so that it never shows in a process list).
ADMIN_TOKEN_ENV = "REDIS_ROUTER_ADMIN_TOKEN"
# Balancer options a flag may set: (flag dest, option name, type, help).
BALANCER_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("sticky_ttl", float, "seconds a session stays pinned after its last turn (pinned)"),
    ("lease_ttl", float, "seconds after which a dead serve process's leases are reclaimed"),
    (
        "affinity_margin",
        int,
        "re-pin a sticky turn when its replica exceeds the least loaded "
        "by this many requests (pinned)",
    ),
    ("affinity_ratio", float, "... or by this ratio (pinned)"),
    ("group_cap", int, "members of a group in a row on one replica (pinned)"),
    ("group_by", str, "separator deriving a group from the request id (pinned)"),
    ("eject_after", int, "failed requests in a row that eject a replica (pinned; off by default)"),
    ("eject_for", float, "seconds of the first ejection (pinned)"),
    ("eject_max", float, "longest ejection in seconds (pinned)"),
    ("max_ejected", float, "share of the pool that may be ejected at once (pinned)"),
    ("ejected_sticky", str, "move|wait: where an ejected replica's sessions go (pinned)"),
    ("wait_timeout", float, "seconds a request waits for a place in a full pool, then 503"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Set ${ADMIN_TOKEN_ENV} to require 'Authorization: Bearer <token>' on POST and "
        "DELETE /workers (otherwise anyone who reaches the port may change the pool)."
    )
    parser.description = (
        "Serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /generate, "
        "/v1/models, /health, /metrics, /abort_request, /workers) and forward each request to "
        "the replica the balancer grants (its metadata's url). Stateless: run any number."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port ({DEFAULT_PORT}); 0 picks one"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="serving processes sharing the port (1): an aiohttp process serves from one "
        "core; together they are one instance, as one process is",
    )
    parser.add_argument(
        "--router-config",
        metavar="YAML",
        help="a router YAML (plugins/*.yaml): its router_class picks the policy, its other "
        "keys are balancer and policy options; flags override them",
    )
    parser.add_argument("--policy", help="routing policy: least_loaded, least_tokens, prefix_cache")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a policy option (VALUE read as JSON, else a string), e.g. block_size=16",
    )
    parser.add_argument(
        "--full-determinism", action="store_true", help="rendezvous hashing for new sessions"
    )
    for dest, kind, text in BALANCER_FLAGS:
        parser.add_argument(
            "--" + dest.replace("_", "-"), dest=dest, type=kind, default=None, help=text
        )
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="attempts on another replica after a connection error before any byte (2)",
    )
    parser.add_argument(
        "--session-header",
        default="X-Session-ID",
        help="header naming a request's session (X-Session-ID)",
    )
    parser.add_argument(
        "--session-field",
        default=None,
        metavar="KEY",
        help="body key naming the session when the header is absent, e.g. user or session_id",
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=5.0, help="seconds to connect to a replica (5)"
    )
    parser.add_argument(
        "--upstream-timeout",
        type=float,
        default=None,
        help="seconds a whole upstream request may take (default: no limit)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take to send a request's headers, from its first byte; "
        "then its connection is closed (10)",
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=float,
        default=75.0,
        help="seconds a client connection may wait idle between requests (75)",
    )
    parser.add_argument(
        "--max-idle-connections",
        type=int,
        default=1024,
        metavar="N",
        help="client connections that may wait idle at once per serving process; past that "
        "the oldest idle one is closed (1024)",
    )


def balancer_options(args: argparse.Namespace) -> tuple[str, str, Any, dict[str, Any]]:
    """(Redis URL, balancer name, policy, router_kwargs) from the YAML and the flags."""
    from ..aio import AsyncRedisLoadBalancer
    from ..balancer import RedisLoadBalancer
    from ..loader import load_router_config, resolve_config_path, resolve_router_class

    config: dict[str, Any] = {}
    policy: Any = None
    if args.router_config:
        path = resolve_config_path(args.router_config)
        config = load_router_config(path)
        spec = config.pop("router_class", None)
        if spec is not None:
            cls = resolve_router_class(str(spec), source=str(path))
            if not issubclass(cls, (RedisLoadBalancer, AsyncRedisLoadBalancer)):
                raise CliError(
                    f"{path}: router_class {spec!r} is not a redis-router balancer; serve "
                    "routes through redis-router's balancers and their policies (give "
                    "--policy or a YAML whose router_class is one of them)"
                )
            policy = cls.default_policy
    url = args.redis or config.pop("redis", None) or resolve_url(None)
    config.pop("redis", None)
    yaml_name = config.pop("name", None)
    name = args.name if args.name != "default" or yaml_name is None else str(yaml_name)
    for dest, _, _ in BALANCER_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            config[dest] = value
    if args.full_determinism:
        config["full_determinism"] = True
    if args.policy:
        policy = args.policy
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--option must be KEY=VALUE, got {item!r}")
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    return str(url), name, policy, config


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.processes <= MAX_PROCESSES:
        raise CliError(f"--processes must be in [1, {MAX_PROCESSES}], got {args.processes}")
    if args.processes > 1 and not os.environ.get(METRICS_DIR_ENV):
        # Before prometheus_client is imported: its samples then live in files every process
        # writes and /metrics sums, so a scrape sees the instance, not one of its processes.
        metrics_dir = tempfile.mkdtemp(prefix="redis-router-serve-metrics-")
        os.environ[METRICS_DIR_ENV] = metrics_dir
        try:
            return _run(args)
        finally:
            del os.environ[METRICS_DIR_ENV]
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        from ..http.routing import SessionRule
        from ..http.server import ServeOptions
    except ImportError as exc:
        raise CliError(
            f"serve needs the http extra ({exc}): pip install aiohttp httpx prometheus_client"
        ) from None
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    options = ServeOptions(
        retries=args.retries,
        session=SessionRule(args.session_header, args.session_field),
        connect_timeout=args.connect_timeout,
        upstream_timeout=args.upstream_timeout,
        header_timeout=args.header_timeout,
        keepalive_timeout=args.keepalive_timeout,
        max_idle_connections=args.max_idle_connections,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
    )
    url, name, policy, config = balancer_options(args)
    if args.processes == 1:
        _loop(_serve(args, url, name, policy, config, options, None, _announce))
        return 0
    return serve_processes.run(
        args.host,
        args.port,
        args.processes,
        lambda sock, announce: _loop(
            _serve(args, url, name, policy, config, options, sock, announce)
        ),
        url,
    )


def _announce(line: str) -> None:
    print(line, flush=True)


def _loop(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def _sharded(url: str, name: str) -> bool:
    """Whether ``name`` is a sharded pool's (its directory has a layout)."""
    from redis.exceptions import RedisError

    from ..connection import connect
    from ..errors import RedisRouterError
    from .common import sharded_layout

    try:
        client = connect(url)
        try:
            return bool(sharded_layout(client, name))
        finally:
            client.close()
    except (RedisError, RedisRouterError):  # unreachable: the balancer says so, as usual
        return False


async def _serve(
    args: argparse.Namespace,
    url: str,
    name: str,
    policy: Any,
    config: dict[str, Any],
    options: Any,
    sock: socket.socket | None,
    announce: Callable[[str], None],
) -> None:
    from ..aio import AsyncRedisLoadBalancer
    from ..aio_sharded import AsyncShardedLoadBalancer
    from ..http.server import Front, running

    try:
        from ..http.metrics import Metrics

        metrics: Any = Metrics()
    except ImportError:  # prometheus_client absent: /metrics answers 404
        metrics = None
    lb: Any
    if _sharded(url, name):  # a sharded pool's name: serve the pool (docs/sharding.md)
        lb = AsyncShardedLoadBalancer(redis=url, name=name, policy=policy, router_kwargs=config)
    else:
        lb = AsyncRedisLoadBalancer(redis=url, name=name, policy=policy, router_kwargs=config)
    async with lb:  # checks the pinned settings before serving anything
        front = Front(lb, options, metrics)
        async with running(front, args.host, args.port, sock=sock) as (host, port):
            announce(
                f"redis-router serve: balancer {name!r} at {redact(lb.url)}, policy "
                f"{lb.policy.name}, on http://{host}:{port}"
            )
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
    if sock is None:  # else the parent says it, once
        print("redis-router serve: stopped", file=sys.stderr, flush=True)
