"""What every `redis-router` subcommand shares: the balancer as the CLI drives it, one-line
errors, and the status snapshot that the table, the JSON and the exporter all read."""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from ..shards import (
    Directory,
    by_home,
    capacities,
    merged_bump,
    merged_status,
    placement,
    split_servers,
)


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

    def pinned(self, field: str) -> str:
        """A setting the workers pinned ("" when none is)."""
        raw = self._read(self.client.hget, config_key(self.name), field)
        return raw.decode() if isinstance(raw, bytes) else raw or ""

    # What the pool commands do, here on one balancer (a sharded pool: on each replica's
    # home shard, see ShardedPool).

    def add_servers(self, servers: dict[str, Any], capacity: dict[str, int] | None) -> int:
        return self.run(self.core().add_servers(servers, capacity))

    def remove_servers(self, ids: list[str]) -> int:
        return self.run(self.core().remove_servers(ids))

    def set_draining(self, ids: list[str], draining: bool) -> int:
        return self.run(self.core().set_draining(ids, draining))

    def clear_sticky(self) -> None:
        core = self.core(self.pinned_sticky_ttl())  # its buckets are where the sessions are
        self.run(core.clear_sticky(), core)

    def reap_all(self) -> tuple[int, float, float]:
        """As a tool: judged by the workers' lease ttls, and waiting for every unheard one."""
        return self.run(self.core().reap_all(tool=True))

    def request_owner(self, request_id: str) -> tuple[str | None, Any]:
        """The replica serving ``request_id`` now, and its metadata (None, None: none)."""
        core = self.core(self.pinned_sticky_ttl())  # its buckets are where the sessions are
        owner = self.run(core.request_owner(request_id), core)
        raw = self.client.hget(servers_key(self.name), owner) if owner else None
        return owner, json.loads(raw) if raw else None

    def bump(self, sticky: bool) -> dict[str, int]:
        core = self.core(self.pinned_sticky_ttl())
        return self.run(core.bump_weight_version(sticky), core)

    def pin_sticky_ttl(self, seconds: float) -> None:
        """Pin sticky_ttl as a worker's first acquire would (HSETNX: a pinned value stays)."""
        self.client.hsetnx(config_key(self.name), "sticky_ttl_ms", self.core(seconds).sticky_ms)

    def metadata(self) -> dict[str, Any]:
        """Every replica's metadata as readers see it (a plain URL string is {"url": it};
        validation.metadata), read in one HGETALL."""
        raw = self.client.hgetall(servers_key(self.name))
        return {
            (sid.decode() if isinstance(sid, bytes) else sid): validation.stored_metadata(meta)
            for sid, meta in raw.items()
        }


class ShardedPool(Balancer):
    """A sharded pool as the CLI drives it: its status as one (and per shard), pool commands
    on each replica's home shard through the pool's directory (redis_router.shards)."""

    def __init__(self, client: Any, name: str, url: str, shard_names: list[str]) -> None:
        super().__init__(client, name, url)  # its core's keys are the directory's
        self.shards = [Balancer(client, n, url) for n in shard_names]
        self.directory = Directory.of(self.name, OPTION_DEFAULTS["sticky_ttl"])

    def exists(self) -> bool:
        return True

    def pinned_sticky_ttl(self) -> float | None:
        return self.shards[0].pinned_sticky_ttl()

    def pinned(self, field: str) -> str:
        return self.shards[0].pinned(field)

    def status(self) -> dict[str, Any]:
        found = [b.status() for b in self.shards]
        stats = self.run(self.directory.stats())
        placing = placement(self.shards, stats)
        return merged_status(self.name, found, placing)  # sticky_ttl: the first shard's

    def _by_home(self, ids: list[str]) -> dict[int, list[str]]:
        return by_home(self.run(self.directory.layout()).homes, ids)

    def add_servers(self, servers: dict[str, Any], capacity: dict[str, int] | None) -> int:
        homes = self.run(self.directory.assign(capacities(servers, capacity)))
        return sum(
            self.shards[shard].add_servers(*part)
            for shard, part in split_servers(servers, capacity, homes).items()
        )

    def remove_servers(self, ids: list[str]) -> int:
        n = sum(self.shards[s].remove_servers(part) for s, part in self._by_home(ids).items())
        self.run(self.directory.unassign(ids))
        return n

    def set_draining(self, ids: list[str], draining: bool) -> int:
        return sum(
            self.shards[s].set_draining(part, draining) for s, part in self._by_home(ids).items()
        )

    def clear_sticky(self) -> None:
        for b in self.shards:
            b.clear_sticky()

    def reap_all(self) -> tuple[int, float, float]:
        got = [b.reap_all() for b in self.shards]
        return sum(g[0] for g in got), max(g[1] for g in got), max(g[2] for g in got)

    def pin_sticky_ttl(self, seconds: float) -> None:
        for b in self.shards:
            b.pin_sticky_ttl(seconds)

    def request_owner(self, request_id: str) -> tuple[str | None, Any]:
        for b in self.shards:
            found = b.request_owner(request_id)
            if found[0] is not None:
                return found
        return None, None

    def bump(self, sticky: bool) -> dict[str, int]:
        return merged_bump([b.bump(sticky) for b in self.shards])

    def metadata(self) -> dict[str, Any]:
        return {sid: meta for b in self.shards for sid, meta in b.metadata().items()}


def balancer_at(client: Any, name: str, url: str) -> Balancer:
    """The balancer named ``name``: a :class:`ShardedPool` where that is a sharded pool's."""
    shards = sharded_layout(client, name)
    return ShardedPool(client, name, url, shards) if shards else Balancer(client, name, url)


def sharded_layout(client: Any, name: str) -> list[str]:
    """The shards' names if ``name`` is a sharded pool's, else []."""
    raw = client.hget(f"rr:{{{name}}}:layout", "names")
    if raw is None:
        return []
    return [str(n) for n in json.loads(raw.decode() if isinstance(raw, bytes) else raw)]


def missing_balancer(balancer: Balancer) -> CliError:
    others = known_balancers(balancer.client)
    hint = f"balancers there: {', '.join(others)}" if others else "it holds no balancer"
    name = balancer.name
    return CliError(
        f"no balancer named {name!r} at {balancer.url} (keys {config_key(name)} and "
        f"{servers_key(name)} not found; {hint}); check --name"
    )


@contextmanager
def open_balancer(
    args: Any, *, create: bool = False, pool_wide: bool = False
) -> Iterator[Balancer]:
    """Yield the ``--name`` balancer. Raises CliError when Redis is unreachable, or when the
    balancer does not exist and ``create`` is False (only `servers add` may create one).
    A sharded pool's name yields the pool (:class:`ShardedPool`) for commands that act on
    it as one (``pool_wide``); the others are told to name a shard."""
    url = url_of(args)
    client = connect(url)
    try:
        balancer = Balancer(client, args.name, url)
        try:
            balancer = balancer_at(client, balancer.name, url)
            if isinstance(balancer, ShardedPool) and not pool_wide:
                shards = [b.name for b in balancer.shards]
                raise CliError(
                    f"{balancer.name!r} is a sharded pool: this command works on one "
                    f"balancer; run it on each shard (--name {shards[0]!r} ... "
                    f"{shards[-1]!r})"
                )
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
    snap["ejection"] = health.describe(balancer.pinned("ejection"))
    # Engine-aware scoring as pinned (None: off): redis_router.scoring.
    scoring = EngineScoring.parse(balancer.pinned("engine"))
    snap["engine_scoring"] = dataclasses.asdict(scoring) if scoring else None
    snap["waiting"] = raw["waiting"]
    # data-parallel replicas: their ranks' ids and sums (redis_router.dp)
    snap["dp_replicas"] = dp.grouped(replicas)
    if raw.get("holders") is not None:  # worker processes: live, dead, leases awaiting reclaim
        snap["holders"] = raw["holders"]
    if "shards" in raw:  # a sharded pool: each shard, and the directory's view of it
        snap["shards"] = [
            {**{k: v for k, v in s.items() if k not in ("holders", "waiting")}, **p}
            for s, p in zip(raw["shards"], raw["placement"], strict=True)
        ]
    return snap
