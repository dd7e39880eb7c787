"""What every `redis-router` subcommand shares: opening the balancer without disturbing it,
one-line errors, and the status snapshot the table, the JSON and the exporter all read."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis import exceptions as rx

from . import validation
from .balancer import RedisLoadBalancer
from .connection import connect, redact, resolve_url
from .errors import ConfigMismatch, RedisUnavailable

# The library's own default; used only when a command creates the balancer (`servers add`).
DEFAULT_STICKY_TTL = 3600.0


class CliError(Exception):
    """A failure the user can act on: printed as one line, exit status 1."""


def url_of(args: Any) -> str:
    """The Redis URL the user chose: --redis, else $REDIS_URL, else localhost."""
    return resolve_url(getattr(args, "redis", None))


def config_key(name: str) -> str:
    return f"rr:{{{name}}}:config"


def unreachable(url: str, exc: Exception) -> CliError:
    return CliError(f"cannot reach Redis at {redact(url)}: {one_line(str(exc))}")


def one_line(text: str) -> str:
    return " ".join(text.split())


def pinned_sticky_ttl(client: Any, name: str) -> float | None:
    """The sticky_ttl the balancer's first process pinned in Redis (None: no such balancer).

    Constructing a balancer pins its sticky_ttl if none is pinned yet, so a tool that
    constructed one with the default would impose it on workers started later."""
    raw = client.hget(config_key(name), "sticky_ttl_ms")
    return None if raw is None else int(raw) / 1000


def known_balancers(client: Any, limit: int = 10) -> list[str]:
    """Names of balancers on this server (for a hint when --name matches none)."""
    names: set[str] = set()
    try:
        for key in client.scan_iter(match="rr:{*}:config", count=1000):
            m = re.fullmatch(r"rr:\{(.+)\}:config", key)
            if m:
                names.add(m.group(1))
            if len(names) >= limit:
                break
    except rx.RedisError:
        return []
    return sorted(names)


def missing_balancer(client: Any, name: str, url: str) -> CliError:
    others = known_balancers(client)
    hint = f"balancers there: {', '.join(others)}" if others else "it holds no balancer"
    return CliError(
        f"no balancer named {name!r} at {redact(url)} (key {config_key(name)} not found; "
        f"{hint}); check --name"
    )


@contextmanager
def open_balancer(args: Any, *, create_sticky_ttl: float | None = None) -> Iterator[Any]:
    """Yield a RedisLoadBalancer for ``--name`` built with the sticky_ttl pinned in Redis.

    Raises CliError when Redis is unreachable, or when the balancer does not exist and
    ``create_sticky_ttl`` is None (only a command that registers replicas may create it).
    """
    url = url_of(args)
    name = validation.name(args.name)
    client = connect(url)
    try:
        for _attempt in range(3):
            try:
                ttl = pinned_sticky_ttl(client, name)
                if ttl is None:
                    if create_sticky_ttl is None:
                        raise missing_balancer(client, name, url)
                    ttl = create_sticky_ttl
                lb = RedisLoadBalancer(redis=client, name=name, sticky_ttl=ttl)
            except (rx.ConnectionError, rx.TimeoutError) as exc:
                raise unreachable(url, exc) from None
            except RedisUnavailable as exc:
                raise CliError(str(exc)) from None
            except ConfigMismatch:
                continue  # another process pinned a different value just now: read it again
            lb.url = redact(url)
            yield lb
            return
        raise CliError(f"balancer {name!r}: its sticky_ttl keeps changing; try again")
    finally:
        client.close()


def natural_key(text: str) -> list[Any]:
    """Sort r2 before r10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def state_of(replica: dict[str, Any]) -> str:
    """active, draining, or drained (= draining with nothing in flight: safe to remove)."""
    if not replica["draining"]:
        return "active"
    return "drained" if replica["inflight"] == 0 else "draining"


REPLICA_FIELDS = (
    "inflight",
    "live_leases",
    "sticky_sessions",
    "acquires",
    "sticky_hits",
    "reclaimed",
)


def snapshot(lb: Any) -> dict[str, Any]:
    """The balancer's state as the CLI shows it (table, --json).

    Only shared state: get_status() also describes the calling process (lease_ttl,
    full_determinism, registered handles), which for this tool would be meaningless."""
    raw = lb.get_status()
    replicas: dict[str, dict[str, Any]] = {}
    for sid in sorted(raw["replicas"], key=natural_key):
        r = raw["replicas"][sid]
        replicas[sid] = {"state": state_of(r), "draining": r["draining"]}
        replicas[sid].update({f: r[f] for f in REPLICA_FIELDS})
        replicas[sid]["metadata"] = r["metadata"]
    states = [r["state"] for r in replicas.values()]
    totals: dict[str, Any] = {
        "replicas": len(replicas),
        "active": states.count("active"),
        "draining": states.count("draining"),
        "drained": states.count("drained"),
    }
    totals.update({f: sum(r[f] for r in replicas.values()) for f in REPLICA_FIELDS})
    # Sessions whose sticky entry is alive, including those of removed replicas (their next
    # turn is re-balanced), so it may exceed the per-replica sum.
    totals["sticky_sessions"] = raw["sticky_sessions"]
    return {
        "balancer": raw["name"],
        "redis": lb.url,
        "sticky_ttl": raw["sticky_ttl"],
        "replicas": replicas,
        "totals": totals,
    }
