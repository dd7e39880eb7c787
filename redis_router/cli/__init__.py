"""`redis-router`: see and steer a balancer without writing Python.

Each subcommand has ``add_arguments(parser)`` and ``run(args) -> int``, at the top level of its
module or in a :class:`~redis_router.cli.common.Handlers` named in :data:`COMMANDS`
(``"module:name"``). Only the chosen one is imported, so ``redis-router --help`` stays fast and
a missing optional extra (matplotlib, prometheus_client) only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from redis import exceptions as rx

from ..connection import DEFAULT_URL, hide_userinfo, scrub
from ..errors import RedisConfigError, RedisRouterError, RedisUnavailable
from .common import (
    EX_CONFIG,
    CliConfigError,
    CliError,
    Terminated,
    one_line,
    stop_on_sigterm,
    unreachable,
    url_of,
)


class Command(NamedTuple):
    target: str  # "module" or "module:name"
    help: str
    without_redis: str | None = None  # what the command does when given no URL, if not localhost

    def load(self) -> Any:
        """The module (or its named object) with add_arguments and run."""
        module, _, name = self.target.partition(":")
        loaded = importlib.import_module(module)
        return getattr(loaded, name) if name else loaded


DISTRIBUTION = "llm-redis-router"  # pyproject.toml's [project] name
PRIVATE_SERVER = "a private server started for the run and removed afterwards"

# Adding a subcommand is one entry here plus its code. status and exporter only read.
COMMANDS: dict[str, Command] = {
    "status": Command("redis_router.cli.status", "show replicas, load, sessions and draining"),
    "servers": Command("redis_router.cli.pool:servers", "add, remove, drain or undrain replicas"),
    "sessions": Command("redis_router.cli.pool:sessions", "manage sticky sessions"),
    "reap": Command("redis_router.cli.pool:reap", "reclaim the leases of dead workers now"),
    "health": Command(
        "redis_router.cli.health", "probe the replicas' health URLs and eject failing ones"
    ),
    "load": Command(
        "redis_router.cli.load", "report the engines' own load (running, waiting, KV cache)"
    ),
    "owner": Command("redis_router.cli.locality:owner", "print the replica serving a request"),
    "bump-weight-version": Command(
        "redis_router.cli.locality:bump", "drop every cache-locality record after new weights"
    ),
    "demo": Command(
        "redis_router.tools.demo",
        "run simulated agent sessions, old vs new tie-break",
        without_redis=PRIVATE_SERVER,
    ),
    "exporter": Command("redis_router.cli.exporter", "serve Prometheus metrics over HTTP"),
    "kv-events": Command(
        "redis_router.cli.kv_events", "keep the exact KV-block index from the replicas' events"
    ),
    "serve": Command(
        "redis_router.cli.serve", "serve an OpenAI-compatible HTTP API routed by the balancer"
    ),
    "simulate": Command(
        "redis_router.tools.simulate",
        "compare routers on simulated replicas with KV caches",
        without_redis=PRIVATE_SERVER,
    ),
}


def _add_globals(
    parser: argparse.ArgumentParser, *, suppress: bool, without_redis: str | None = None
) -> None:
    """--redis and --name, accepted before or after the subcommand (after wins)."""
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=default,
        help=f"Redis URL (default: $REDIS_URL, else {without_redis or DEFAULT_URL}); redis://, "
        "rediss://, unix://, redis+sentinel://, redis+cluster://",
    )
    parser.add_argument(
        "--name",
        metavar="NAME",
        default=argparse.SUPPRESS if suppress else "default",
        help="balancer name, as given to RedisLoadBalancer(name=...) (default: default)",
    )


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in argv, found with the global options' arity in mind."""
    pre = argparse.ArgumentParser(add_help=False)
    _add_globals(pre, suppress=False)
    pre.add_argument("command", nargs="?")
    try:
        known, _ = pre.parse_known_args(argv)
    except SystemExit:
        return None
    return known.command if known.command in COMMANDS else None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The full parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="redis-router",
        description="See and steer a redis-router balancer, run the demo, export metrics.",
        epilog="Run `redis-router COMMAND --help` for a command's options.",
    )
    _add_globals(parser, suppress=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen_command(argv)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help[0].upper() + cmd.help[1:])
        _add_globals(p, suppress=True, without_redis=cmd.without_redis)
        if name == chosen:
            handlers = cmd.load()
            handlers.add_arguments(p)
            p.set_defaults(_run=handlers.run)
    return parser


def version() -> str:
    """The installed distribution's version (the package's own when run from a checkout)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def _fail(message: str, url: str, status: int = 1) -> int:
    """Print the error as one line, every credential of ``url`` replaced, should a message
    quote one (a URL in it is already redacted); a configuration error says so and exits
    EX_CONFIG."""
    kind = "configuration error: " if status == EX_CONFIG else ""
    print(f"redis-router: error: {kind}{scrub(one_line(message), url)}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    url = url_of(args)
    return exit_code(lambda: int(args._run(args) or 0), url)


def exit_code(run: Callable[[], int], url: str) -> int:
    """What ``run`` returns, or the exit code of the error it raised, the error printed as one
    line without credentials (errors of other kinds propagate)."""
    try:
        with stop_on_sigterm():  # long-running commands stop on SIGTERM as on Ctrl-C
            return run()
    except Terminated:  # a one-shot command stopped midway
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except (CliConfigError, RedisConfigError) as exc:  # no retry can help: exit EX_CONFIG
        return _fail(str(exc), url, EX_CONFIG)
    except CliError as exc:
        return _fail(str(exc), url)
    except RedisUnavailable as exc:  # its message already names the (redacted) URL
        return _fail(str(exc), url)
    except (rx.ConnectionError, rx.TimeoutError) as exc:
        error = unreachable(url, exc)
        return _fail(str(error), url, EX_CONFIG if isinstance(error, CliConfigError) else 1)
    except (RedisRouterError, rx.RedisError, ValueError, TypeError, OSError) as exc:
        return _fail(hide_userinfo(str(exc)), url)
