"""The KV-events lag benchmark row runs (``python -m benchmarks --quick --only kv_lag``), every
event it publishes reaches the index, and its simulated engine emits valid events.

Structure only: no lag is compared with a target here (timings on a shared machine prove
nothing in a test); ``python -m benchmarks`` prints PASS / FAIL.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from benchmarks.kv_engine import BLOCK, CAPACITY, Engine
from redis_router.kv_events import BlockRemoved, BlockStored
from redis_router.kv_events.index import encode_events
from redis_router.kv_events.wire import decode_batch
from redis_router.local_server import first_server_binary

ROOT = Path(__file__).resolve().parent.parent
ROWS = (
    "kv_lag_p99",
    "kv_lag_p99_2_subscribers",
    "kv_lag_p99_vs_light_load",
    "kv_lag_p99_64_replicas",
)


def test_simulated_engine_emits_events_an_index_accepts() -> None:
    """Every batch decodes and encodes as a real one; removals name only cached blocks; the
    cache stays within its capacity once something is evictable; stores chain to cached
    parents."""
    engine = Engine(random.Random(3))
    cached: set[int] = set()
    removed = 0
    for _ in range(400):
        payload = msgspec.msgpack.encode([1.0, engine.step(40), 0])
        _, events, _ = decode_batch(payload)
        assert len(events) >= 40
        encode_events(events)  # raises on a malformed event
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == BLOCK
                assert ev.parent_block_hash is None or ev.parent_block_hash in cached
                cached.update(int(h) for h in ev.block_hashes)
            else:
                assert isinstance(ev, BlockRemoved)
                (h,) = ev.block_hashes
                cached.remove(int(h))
                removed += 1
    assert removed > 0
    assert len(cached) == engine.cached <= CAPACITY


@pytest.mark.slow
@pytest.mark.skipif(first_server_binary() is None, reason="no server binary found")
def test_lag_rows_run_and_every_event_is_applied(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "kv_lag", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["id"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {*ROWS, "kv_redis_cpu_per_event"}
    for rid in ROWS:
        extra = rows[rid]["extra"]
        assert extra["missing_events"] == 0, rid
        assert extra["events_per_s"] > 0, rid
        assert 0 < extra["p50_s"] <= extra["p99_s"] <= extra["max_s"], rid
        assert math.isfinite(extra["max_s"]), rid
        assert extra["poll_period_s"] > 0, rid
        assert extra["mix"]["stored_events"] > 0, rid
    assert rows["kv_lag_p99"]["passed"] in (True, False)
