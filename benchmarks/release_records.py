"""``python -m benchmarks.release_records [--quick] [--server-bin PATH]``

What a remembered release costs in two layouts, by how full the store is.

A release's operation id is remembered for a while so that a resent copy is recognised. The
library packs the ids (lib/leases.lua): a hash whose field is an id's last three characters and
whose value holds the rest of each of its ids between separators, written with ``HGET`` and
``HSET``. The obvious layout, and the library's before, is a set with a member per id (one
``SADD``), whose cost moves with its hash table: just past a doubling a member carries two
slots of the new table and one of the old, which Redis moves over a step per later write.
Both are filled by a script per id, the way a single release writes its record; each row gives
``used_memory`` per id and the server time per call (``INFO commandstats``) of both.
"""

from __future__ import annotations

import argparse

import redis

from redis_router import core
from redis_router.local_server import LocalServer

from .__main__ import _binary

SET = "redis.call('SADD', KEYS[1], ARGV[1]) return 1"
# What lib/leases.lua's remember_release() writes.
PACKED = """
local op = ARGV[1]
local field = string.sub(op, -3)
local ids = redis.call('HGET', KEYS[1], field)
redis.call('HSET', KEYS[1], field, (ids or '\\31') .. string.sub(op, 1, -4) .. '\\31')
return 1
"""
PIPELINE = 2_000


def fills(quick: bool = False) -> list[int]:
    """Just past a doubling (2^k + 1/64 of it) and just before the next one."""
    k = 12 if quick else 19
    return [(1 << k) + (1 << (k - 6)), 8_000 if quick else 1_000_000]


def fill(client: redis.Redis, script: str, ids: list[str]) -> tuple[float, float]:
    """(used_memory bytes per id, server µs per call) for ``ids`` written one call each."""
    client.execute_command("FLUSHALL", "SYNC")
    client.config_resetstat()
    sha = client.script_load(script)
    before = int(client.info("memory")["used_memory"])
    pipe = client.pipeline(transaction=False)
    for j, op in enumerate(ids, 1):
        pipe.evalsha(sha, 1, "records", op)
        if j % PIPELINE == 0:
            pipe.execute()
    pipe.execute()
    per_id = (int(client.info("memory")["used_memory"]) - before) / len(ids)
    usec = float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
    client.execute_command("FLUSHALL", "SYNC")
    return per_id, usec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.release_records", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small fills (a smoke test)")
    ap.add_argument("--server-bin", metavar="PATH", help="server binary (default: first found)")
    args = ap.parse_args(argv)
    binary = _binary(args.server_bin)
    print(f"server: {binary.label}; one script call per id, 12-character ids")
    print(f"{'ids':>10}  {'set B/id':>9}  {'packed B/id':>11}  {'set µs':>7}  {'packed µs':>9}")
    with LocalServer(binary) as server:
        client = server.client()
        try:
            for n in fills(args.quick):
                ids = core.new_operations(n)
                set_bytes, set_us = fill(client, SET, ids)
                packed_bytes, packed_us = fill(client, PACKED, ids)
                print(
                    f"{n:>10,}  {set_bytes:>9.1f}  {packed_bytes:>11.1f}  {set_us:>7.2f}  "
                    f"{packed_us:>9.2f}"
                )
        finally:
            client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
