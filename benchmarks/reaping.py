"""After a mass crash: the slowest single acquire against a normal one, by SLOWLOG.

A process holding a lease on each of 4096 replicas stops sending heartbeats (as a SIGKILL
would stop them). Once lease_ttl has passed, the script calls that reclaim its leases
(acquires 2 each, the keeper's heartbeat and reap calls 8 each) run while every other client
waits: none may be much slower than an ordinary acquire. The slowest of N calls is set by the
tail of every call on a shared machine (a descheduled server, a Lua collection step), and
grows with N, so it is compared with the slowest of as many ordinary acquires, timed right
after on the same server; the medians are in the row's note.
"""

from __future__ import annotations

import statistics
import time
import uuid

import redis

from redis_router import RedisLoadBalancer
from redis_router.scripts import NAMES, compositions

from .harness import Row, Sizes
from .latency import servers

REPLICAS = 4096
LEASE_TTL = 0.3


def _durations(client: redis.Redis) -> dict[str, list[int]]:
    """Microseconds of every script call in the slow log (logging everything), by script."""
    sent = [s for name in NAMES for s in compositions(name)]  # as balancers compose them
    names = {s.sha: s.name for s in sent}
    names.update({s.function: s.name for s in sent})  # sent by FCALL
    out: dict[str, list[int]] = {}
    for e in client.slowlog_get(200_000):
        words = str(e["command"]).split()
        verb = words[0].upper().strip("B'\"") if words else ""
        if verb in ("EVALSHA", "FCALL", "FCALL_RO") and len(words) > 1:
            out.setdefault(names.get(words[1].strip("'"), "other"), []).append(int(e["duration"]))
    return out


def run(client: redis.Redis, sizes: Sizes) -> list[Row]:
    survivor = RedisLoadBalancer(servers(REPLICAS), redis=client, name="bench-reap", lease_ttl=5)
    crashed = RedisLoadBalancer(redis=client, name="bench-reap", lease_ttl=LEASE_TTL)
    old = client.config_get("slowlog-*")
    client.config_set("slowlog-max-len", 200_000)
    client.config_set("slowlog-log-slower-than", 0)
    try:
        for _ in range(50):  # warm: scripts loaded, keys created
            rid = uuid.uuid4().hex
            survivor.release_server(survivor.acquire_server(rid)[0], rid)
        for lo in range(0, REPLICAS, 1000):
            crashed.acquire_many([uuid.uuid4().hex for _ in range(min(1000, REPLICAS - lo))])
        assert crashed._keeper is not None
        crashed._keeper.stop()  # the process stops sending heartbeats
        owned = f"{crashed._core.prefix}owned:{crashed._core.holder}"
        time.sleep(LEASE_TTL + 0.1)
        client.slowlog_reset()
        while client.exists(owned):  # acquires and heartbeats reclaim them
            rid = uuid.uuid4().hex
            survivor.release_server(survivor.acquire_server(rid)[0], rid)
        after = _durations(client)
        ordinary = _acquire_times(client, survivor, len(after["acquire"]))
    finally:
        client.config_set("slowlog-log-slower-than", old["slowlog-log-slower-than"])
        client.config_set("slowlog-max-len", old["slowlog-max-len"])
        survivor.destroy()
        survivor.close()
    worst, usual = max(after["acquire"]), max(ordinary)
    others = {k: max(v) for k, v in after.items() if k != "acquire"}
    medians = statistics.median(after["acquire"]), statistics.median(ordinary)
    return [
        Row(
            "reap_slowest_acquire",
            f"slowest acquire while {REPLICAS} dead leases are reclaimed",
            worst / 1e6,
            "s",
            baseline=f"slowest of {len(ordinary)} ordinary",
            baseline_value=usual / 1e6,
            ratio=worst / usual,
            target=("<=", 3.0),
            note=f"{len(after['acquire'])} acquires, median {medians[0]:.0f} us (ordinary "
            f"{medians[1]:.0f} us); slowest other calls (us): "
            + ", ".join(f"{k} {v}" for k, v in sorted(others.items())),
        )
    ]


def _acquire_times(client: redis.Redis, lb: RedisLoadBalancer, n: int) -> list[int]:
    """Microseconds of each acquire of ``n`` acquire+release pairs, by SLOWLOG (read every
    few hundred pairs: the log also holds each command a script runs)."""
    out: list[int] = []
    for lo in range(0, n, 500):
        client.slowlog_reset()
        for _ in range(min(500, n - lo)):
            rid = uuid.uuid4().hex
            lb.release_server(lb.acquire_server(rid)[0], rid)
        out += _durations(client).get("acquire", [])
    return out
