"""Target 4: Redis memory per sticky session, against the two obvious layouts.

N sessions with uuid4().hex request ids are routed with acquire_many (batches of 10,000) on
an empty server; ``INFO memory`` used_memory before and after, divided by N, is the cost. The
leases are then reclaimed (the balancer is built with a 1 ms lease ttl, so every lease has
expired; ``reap()`` ends them exactly as releases would), which leaves only the sticky
entries: that is the per-session figure. The difference is the cost of an in-flight lease.
The reference layouts store the same ids and replica ids, filled with pipelines:
one string key per session with a TTL, and one field per session in a single plain hash.

Ending the leases leaves one remembered release each (kept so that a resent copy is
recognised). A store's cost per record moves with how full it is: a Redis hash table doubles
when outgrown and keeps the old table until later writes have moved every entry, so a layout
with an entry per record pays most just past a power of two. The releases are ended in chunks
and the store is weighed (``MEMORY USAGE``, every entry counted) just past the last power of
two below N and at N: the row for that fill is the per-release figure at N (``used_memory``)
plus the difference. The resend window is lengthened while they are ended, so every record
stays in one generation wherever the keeper's rotation would fall.
"""

from __future__ import annotations

import time
import uuid

import redis

from redis_router import RedisLoadBalancer, core

from .harness import Row, Sizes
from .latency import servers

BATCH = 10_000
STICKY_TTL = 3600.0


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _ids(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


def _settled(client: redis.Redis) -> None:
    """Wait until background frees are done (Valkey 8 frees lazily by default), so
    used_memory counts only live data."""
    for _ in range(200):
        if int(client.info("memory").get("lazyfree_pending_objects", 0)) == 0:
            return
        time.sleep(0.05)


def _fresh(client: redis.Redis) -> int:
    client.execute_command("FLUSHALL", "SYNC")
    _settled(client)
    return used_memory(client)


def doubling_point(n: int, chunk: int) -> int:
    """The first chunk boundary past the last power of two below ``n``: where a table with an
    entry per record has just doubled."""
    power = 1 << (max(n - 1, 1).bit_length() - 1)
    return min(n, (power // chunk + 1) * chunk)


def store_bytes(client: redis.Redis, key: str, records: int) -> float:
    """Bytes per record of a key, every entry counted."""
    return int(client.memory_usage(key, samples=0) or 0) / records


def measure_router(client: redis.Redis, n: int) -> tuple[float, float, float, int, float, float]:
    """(bytes per sticky session, per in-flight lease, per remembered release; the fill just
    past the last power of two below ``n``, and ``MEMORY USAGE`` per record there and at ``n``)
    for redis-router. Releases are remembered for a while so that a resent copy is
    recognised."""
    _fresh(client)
    lb = RedisLoadBalancer(servers(8), redis=client, name="bench-mem", sticky_ttl=STICKY_TTL)
    before = used_memory(client)
    batches = []
    for lo in range(0, n, BATCH):
        rids = _ids(min(BATCH, n - lo))
        batches.append(list(zip((sid for sid, _ in lb.acquire_many(rids)), rids, strict=True)))
    _settled(client)
    with_leases = used_memory(client)
    ended = [pair for batch in batches for pair in batch]
    chunk = max(1, min(BATCH, n // 100))
    doubled = doubling_point(n, chunk)
    at_doubling = 0.0
    records, old = lb._core.prefix + "remembered", lb._core.prefix + "remembered:old"
    window, core.RESEND_WINDOW_MS = core.RESEND_WINDOW_MS, 3_600_000
    try:
        for lo in range(0, n, chunk):
            part = ended[lo : lo + chunk]
            lb._run(lb._core.release_many([(sid, rid, None) for sid, rid in part]))
            if lo + len(part) == doubled:
                at_doubling = store_bytes(client, records, doubled)
    finally:
        core.RESEND_WINDOW_MS = window
    assert lb.get_total_inflight() == 0
    assert not client.exists(old), "one generation expected"
    at_n = store_bytes(client, records, n)
    _settled(client)
    with_records = used_memory(client)
    client.delete(records, old)
    _settled(client)
    sticky_only = used_memory(client)
    status = lb.get_status()
    assert status["sticky_sessions"] == n, status["sticky_sessions"]
    lb.destroy()
    lb.close()
    return (
        (sticky_only - before) / n,
        (with_leases - sticky_only) / n,
        (with_records - sticky_only) / n,
        doubled,
        at_doubling,
        at_n,
    )


def measure_reference(client: redis.Redis, n: int, layout: str) -> float:
    """Bytes per session of a reference layout ("string_ttl" or "hash_field")."""
    before = _fresh(client)
    ttl_ms = int(STICKY_TTL * 1000)
    ids = servers(8)
    names = list(ids)
    pipe = client.pipeline(transaction=False)
    for lo in range(0, n, BATCH):
        for j, rid in enumerate(_ids(min(BATCH, n - lo))):
            sid = names[(lo + j) % len(names)]
            if layout == "string_ttl":
                pipe.set(f"ref:{{s}}:{rid}", sid, px=ttl_ms)
            else:
                pipe.hset("ref:{s}:sticky", rid, sid)
        pipe.execute()
    _settled(client)
    return (used_memory(client) - before) / n


def run(client: redis.Redis, sizes: Sizes) -> list[Row]:
    n = sizes.sessions
    per_session, per_lease, per_release, doubled, at_doubling, at_n = measure_router(client, n)
    string_ttl = measure_reference(client, n, "string_ttl")
    hash_field = measure_reference(client, n, "hash_field")
    client.execute_command("FLUSHALL", "SYNC")
    note = f"{n:,} sessions, 32-hex ids, sliding TTL kept (time-bucket hashes)"
    return [
        Row(
            "memory_sticky",
            "(4) memory per sticky session (redis-router)",
            per_session,
            "B",
            target=("<=", 120),
            note=note,
            extra={"sessions": n},
        ),
        Row(
            "memory_string_ttl",
            "    reference: string key with TTL per session",
            string_ttl,
            "B",
            baseline="redis-router",
            baseline_value=per_session,
            ratio=string_ttl / per_session,
        ),
        Row(
            "memory_hash_field",
            "    reference: plain hash field (no TTL)",
            hash_field,
            "B",
            baseline="redis-router",
            baseline_value=per_session,
            ratio=hash_field / per_session,
        ),
        Row(
            "memory_lease",
            "    in-flight lease state, per lease (freed on release)",
            per_lease,
            "B",
        ),
        Row(
            "memory_release_record",
            "    remembered release, per release (kept 30-60 s for resends)",
            per_release,
            "B",
            target=("<=", 60),
            note=f"{n:,} in one generation (used_memory)",
        ),
        Row(
            "memory_release_record_doubled",
            "    the same, just past a power of two",
            per_release + at_doubling - at_n,
            "B",
            target=("<=", 60),
            note=(
                f"{doubled:,} releases: MEMORY USAGE {at_doubling:.1f} B per release, "
                f"against {at_n:.1f} B at {n:,}"
            ),
            extra={"releases": doubled},
        ),
    ]
