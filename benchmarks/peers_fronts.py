"""redis-router's own HTTP fronts in the peers benchmark: ``redis-router serve`` instances (one
process each, ``python -m redis_router ... serve``, as a user starts them) on the benchmark's
Redis, and the oracle (benchmarks/peers_oracle.py), measured as the gateways are.

Each front says which measures it takes part in: ``serve`` with its default policy
(least_loaded) in latency, throughput and balance; ``serve`` with the prefix_cache router YAML
(the shipped thresholds, and ``balance_abs_threshold=64 balance_rel_threshold=1.5``) in the
prefix measures, a session's turns naming it in ``X-Session-ID``; the oracle in latency and
throughput only (it does not route).
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass
from pathlib import Path

from redis_router import RedisLoadBalancer

from . import peers_gateways as gws

PREFIX_CONFIG = "pkg://redis_router.plugins/prefix_cache.yaml"
SESSION_HEADER = "X-Session-ID"


@dataclass(frozen=True)
class FrontSpec:
    label: str
    measures: frozenset[str]  # latency, throughput, balance, multiturn, grpo
    balancer: str = ""  # the balancer name its instances share ("" for the oracle)
    args: tuple[str, ...] = ()  # serve's own flags after ``serve --host H --port P``
    session_header: bool = False  # send a multi-turn session's id in X-Session-ID
    ping_redis: bool = False  # the oracle makes one Redis round trip per request

    @property
    def oracle(self) -> bool:
        return not self.balancer


SERVE = "redis-router serve least_loaded"
ORACLE = "aiohttp pass-through, no Redis, no routing (oracle)"
ORACLE_PING = "aiohttp pass-through, one Redis PING per request (oracle)"
FRONTS = (
    FrontSpec(SERVE, frozenset({"latency", "throughput", "balance"}), "peers-serve"),
    # The same instance serving from both cores of the machine (serve --processes).
    FrontSpec(
        SERVE + ", 2 processes",
        frozenset({"latency", "throughput"}),
        "peers-serve",
        ("--processes", "2"),
    ),
    FrontSpec(
        "redis-router serve prefix_cache, shipped defaults",
        frozenset({"multiturn", "grpo"}),
        "peers-serve-prefix",
        ("--router-config", PREFIX_CONFIG),
        session_header=True,
    ),
    FrontSpec(
        "redis-router serve prefix_cache, abs 64 / rel 1.5",
        frozenset({"multiturn", "grpo"}),
        "peers-serve-prefix-64",
        (
            "--router-config",
            PREFIX_CONFIG,
            "--option",
            "balance_abs_threshold=64",
            "--option",
            "balance_rel_threshold=1.5",
        ),
        session_header=True,
    ),
    FrontSpec(ORACLE, frozenset({"latency", "throughput"})),
    # A front that asks Redis once per request can add no less than this.
    FrontSpec(ORACLE_PING, frozenset({"latency", "throughput"}), ping_redis=True),
)


def needed(spec: FrontSpec, measures: set[str], instances: int) -> int:
    """Instances of ``spec`` the chosen measures use: one for latency and throughput, one
    per client process for the others, none when it takes part in none of them."""
    if spec.measures & measures - {"latency", "throughput"}:
        return instances
    return 1 if spec.measures & measures else 0


def start(
    specs: tuple[FrontSpec, ...],
    counts: dict[str, int],
    servers: dict[str, str],
    redis_url: str,
    log_dir: Path,
) -> dict[str, list[gws.Gateway]]:
    """Register the replicas on each front's balancer, start every instance at once, then
    wait until each proxies a completion."""
    out: dict[str, list[gws.Gateway]] = {}
    for spec in specs:
        n = counts.get(spec.label, 0)
        if not n:
            continue
        if not spec.oracle:
            lb = RedisLoadBalancer(redis=redis_url, name=spec.balancer)
            try:
                lb.add_servers(servers)
            finally:
                lb.close()
        gspec = gws.GatewaySpec(spec.label, "llm-redis-router", "", (), "")
        insts = []
        for i in range(n):
            port = gws.free_port()
            if spec.oracle:
                cmd = [sys.executable, "-m", "benchmarks.peers_oracle", "--port", str(port)]
                if spec.ping_redis:
                    cmd += ["--redis", redis_url]
                cmd += list(servers.values())
            else:
                cmd = [sys.executable, "-m", "redis_router", "--redis", redis_url, "--name"]
                cmd += [spec.balancer, "serve", "--host", gws.HOST, "--port", str(port)]
                cmd += list(spec.args)
            oracle = "oracle-ping" if spec.ping_redis else "oracle"
            log = log_dir / f"front-{spec.balancer or oracle}-{i}.log"
            insts.append(gws.spawn(gspec, cmd, port, log, cwd=gws.ROOT))
        out[spec.label] = insts
    for insts in out.values():
        for g in insts:
            gws.wait_ready(g)
    return out


def versions() -> dict[str, str]:
    """The HTTP stack the fronts run on."""
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        loop = "asyncio"
    else:
        loop = "uvloop " + importlib.metadata.version("uvloop")
    return {"aiohttp": importlib.metadata.version("aiohttp"), "fronts' loop": loop}
