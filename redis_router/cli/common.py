"""What every `redis-router` subcommand shares: the balancer as the CLI drives it, one-line
errors, and the status snapshot that the table, the JSON and the exporter all read."""

from __future__ import annotations

import argparse
import dataclasses
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from redis import exceptions as rx

from .. import dp, health, validation
from ..connection import (
    config_error,
    connect,
    redact,
    resolve_url,
    send_failure,
    shown_metadata,
    unavailable,
)
from ..core import OPTION_DEFAULTS, BalancerCore, Call, Op, T, build_core
from ..errors import RedisConfigError, RedisUnavailable
from ..invoke import Sender
from ..policy import LeastLoaded
from ..scoring import EngineScoring


class CliError(Exception):
    """A failure the user can act on: printed as one line, exit status 1."""


class CliConfigError(CliError):
    """A configuration error (Redis refused the credentials, the host does not resolve):
    printed as one line, exit status :data:`EX_CONFIG`."""


# sysexits.h's EX_CONFIG: a configuration error, so a script or supervisor can tell it from
# an outage (exit status 1) and not retry it.
EX_CONFIG = 78


class Terminated(KeyboardInterrupt):
    """SIGTERM (systemd, Kubernetes, ``kill``), raised where Ctrl-C raises KeyboardInterrupt, so a
    long-running command stops the same clean way on either."""


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread; the previous
    handler comes back afterwards (``cli.main`` may run inside another program, such as pytest)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


class Handlers(NamedTuple):
    """A subcommand's two functions, for a module that holds several subcommands (a module
    that holds one has them at its top level): see ``redis_router.cli.COMMANDS``."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def url_of(args: Any) -> str:
    """The Redis URL the user chose: --redis, else $REDIS_URL, else localhost."""
    return resolve_url(getattr(args, "redis", None))


def config_key(name: str) -> str:
    return f"rr:{{{name}}}:config"


def servers_key(name: str) -> str:
    return f"rr:{{{name}}}:servers"


def unreachable(url: str, exc: Exception) -> CliError:
    """The CliError for a failure to reach Redis: a CliConfigError when no retry can help."""
    wrong = config_error(redact(url), exc)
    if wrong is not None:
        return CliConfigError(str(wrong))
    return CliError(f"cannot reach Redis at {redact(url)}: {one_line(str(exc))}")


def one_line(text: str) -> str:
    return " ".join(text.split())


def natural_key(text: str) -> list[Any]:
    """Sort r2 before r10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def known_balancers(client: Any, limit: int = 10) -> list[str]:
    """Names of balancers on this server (for a hint when --name matches none)."""
    names: set[str] = set()
    try:
        for key in client.scan_iter(match="rr:{*}:*", count=1000):
            m = re.fullmatch(r"rr:\{(.+)\}:(config|servers)", key)
            if m:
                names.add(m.group(1))
            if len(names) >= limit:
                break
    except rx.RedisError:
        return []
    return sorted(names)


class Balancer:
    """One balancer as the CLI sees it: BalancerCore's operations sent as plain script calls.

    Not a RedisLoadBalancer: a tool must not pin settings for the workers, start heartbeats or
    register a holder, so a command that only reads (status, exporter) writes nothing. The
    sticky_ttl is read from Redis on every status (a balancer may be destroyed and recreated).
    """

    def __init__(self, client: Any, name: str, url: str) -> None:
        self.client, self.name, self.url = client, validation.name(name), redact(url)
        self._scripts = Sender(client)
        self._cores: dict[float | None, BalancerCore] = {}

    def pinned_sticky_ttl(self) -> float | None:
        """The sticky_ttl the balancer's first acquire pinned in Redis, None if none yet."""
        raw = self._read(self.client.hget, config_key(self.name), "sticky_ttl_ms")
        return None if raw is None else int(raw) / 1000

    def exists(self) -> bool:
        """True once replicas were registered or a worker acquired."""
        return (
            int(self._read(self.client.exists, config_key(self.name), servers_key(self.name))) > 0
        )

    def _read(self, command: Any, *args: Any) -> Any:
        try:
            return command(*args)
        except (rx.ConnectionError, rx.TimeoutError) as exc:
            raise unavailable(self.url, exc) from None

    def core(self, sticky_ttl: float | None = None) -> BalancerCore:
        """A core with this sticky_ttl (it sizes the sticky buckets that status searches);
        the library's default while none is pinned, when no sticky session exists either."""
        if sticky_ttl not in self._cores:
            options = dict(OPTION_DEFAULTS, name=self.name)
            if sticky_ttl is not None:
                options["sticky_ttl"] = sticky_ttl
            self._cores[sticky_ttl] = build_core(LeastLoaded, None, {}, **options)[0]
        return self._cores[sticky_ttl]

    def run(self, op: Op[T], core: BalancerCore | None = None) -> T:
        """Drive one core operation to its result."""
        core = core or self.core()
        try:
            call = next(op)
            while True:
                call = op.send(self._send(core, call))
        except StopIteration as stop:
            result: T = stop.value
            return result

    def _send(self, core: BalancerCore, call: Call) -> Any:
        try:
            return self._scripts.send(call.script, core.prefix, call.args)
        except (rx.ConnectionError, rx.TimeoutError, rx.ResponseError) as exc:
            error = send_failure(exc, self.url, core.script_error, True)
            raise error or exc from None

    def status(self) -> dict[str, Any]:
        """get_status() of the balancer, with ``sticky_ttl`` None while none is pinned."""
        ttl = self.pinned_sticky_ttl()
        core = self.core(ttl)
        raw = self.run(core.status(), core)
        raw["sticky_ttl"] = ttl
        return raw


def pool_metadata(balancer: Balancer) -> dict[str, Any]:
    """Every replica's metadata as readers see it (a plain URL string is {"url": it};
    validation.metadata), read in one HGETALL."""
    raw = balancer.client.hgetall(servers_key(balancer.name))
    return {
        (sid.decode() if isinstance(sid, bytes) else sid): validation.stored_metadata(meta)
        for sid, meta in raw.items()
    }


def missing_balancer(balancer: Balancer) -> CliError:
    others = known_balancers(balancer.client)
    hint = f"balancers there: {', '.join(others)}" if others else "it holds no balancer"
    name = balancer.name
    return CliError(
        f"no balancer named {name!r} at {balancer.url} (keys {config_key(name)} and "
        f"{servers_key(name)} not found; {hint}); check --name"
    )


@contextmanager
def open_balancer(args: Any, *, create: bool = False) -> Iterator[Balancer]:
    """Yield the ``--name`` balancer. Raises CliError when Redis is unreachable, or when the
    balancer does not exist and ``create`` is False (only `servers add` may create one)."""
    url = url_of(args)
    client = connect(url)
    try:
        balancer = Balancer(client, args.name, url)
        try:
            if not create and not balancer.exists():
                raise missing_balancer(balancer)
            yield balancer
        except (rx.ConnectionError, rx.TimeoutError) as exc:
            raise unreachable(url, exc) from None
        except RedisUnavailable as exc:
            raise CliError(str(exc)) from None
        except RedisConfigError as exc:
            raise CliConfigError(str(exc)) from None
    finally:
        client.close()


def state_of(replica: dict[str, Any]) -> str:
    """active, full (its capacity reached), failing (its last request or probe failed,
    ejection on or off), ejected (failing: no acquire until its time is up), draining, or
    drained (= draining with nothing in flight: safe to remove)."""
    if replica.get("ejected_until"):
        return "ejected"
    if not replica["draining"]:
        if replica.get("failing"):
            return "failing"
        return "full" if replica.get("full") else "active"
    return "drained" if replica["inflight"] == 0 else "draining"


# Health and admission fields of a replica (None or 0 when unused), shown as they are.
HEALTH_FIELDS = (
    "capacity",
    "full",
    "ejected_until",
    "ejected_for",
    "ejected_why",
    "failing",
    "failures_in_a_row",
    "failures",
    "ejections_in_a_row",
    "last_error",
    "last_error_at",
    "last_error_age",
)

REPLICA_FIELDS = (
    "inflight",
    "live_leases",
    "sticky_sessions",
    "acquires",
    "sticky_hits",
    "reclaimed",
    "repins",
)


def snapshot(balancer: Balancer) -> dict[str, Any]:
    """The balancer's state as the CLI shows it (table, --json).

    Only shared state: get_status() also describes the calling process (lease_ttl,
    full_determinism, registered handles), which for this tool would be meaningless."""
    raw = balancer.status()
    replicas: dict[str, dict[str, Any]] = {}
    for sid in sorted(raw["replicas"], key=natural_key):
        r = raw["replicas"][sid]
        replicas[sid] = {"state": state_of(r), "draining": r["draining"]}
        replicas[sid].update({f: r[f] for f in REPLICA_FIELDS})
        replicas[sid].update({f: r[f] for f in HEALTH_FIELDS})
        replicas[sid]["metadata"] = shown_metadata(r["metadata"])
        if r.get("engine") is not None:  # the engine's own figures (redis-router load)
            replicas[sid]["engine"] = r["engine"]
    states = [r["state"] for r in replicas.values()]
    totals: dict[str, Any] = {
        "replicas": len(replicas),
        "active": states.count("active"),
        "draining": states.count("draining"),
        "drained": states.count("drained"),
        "ejected": states.count("ejected"),
        "full": states.count("full"),
        "failing": states.count("failing"),
    }
    totals.update({f: sum(r[f] for r in replicas.values()) for f in REPLICA_FIELDS})
    # Sessions whose sticky entry is alive, including those of removed replicas (their next
    # turn is re-balanced), so it may exceed the per-replica sum.
    totals["sticky_sessions"] = raw["sticky_sessions"]
    snap = {
        "balancer": raw["name"],
        "redis": balancer.url,
        "sticky_ttl": raw["sticky_ttl"],
        "replicas": replicas,
        "totals": totals,
    }
    pinned = balancer.client.hget(config_key(balancer.name), "ejection")
    snap["ejection"] = health.describe(
        pinned.decode() if isinstance(pinned, bytes) else pinned or ""
    )
    # Engine-aware scoring as pinned (None: off): redis_router.scoring.
    engine = balancer.client.hget(config_key(balancer.name), "engine")
    scoring = EngineScoring.parse(engine.decode() if isinstance(engine, bytes) else engine or "")
    snap["engine_scoring"] = dataclasses.asdict(scoring) if scoring else None
    snap["waiting"] = raw["waiting"]
    # data-parallel replicas: their ranks' ids and sums (redis_router.dp)
    snap["dp_replicas"] = dp.grouped(replicas)
    if raw.get("holders") is not None:  # worker processes: live, dead, leases awaiting reclaim
        snap["holders"] = raw["holders"]
    return snap
