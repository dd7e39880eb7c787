"""The subscriber against vLLM's own publisher (vllm.distributed.kv_events.ZmqEventPublisher,
CPU only). Needs vllm, which .ci/run installs in an environment of its own (.venv-vllm) and
runs this file there, where a missing vllm fails it; elsewhere the file is skipped."""

from __future__ import annotations

import importlib
import os
import random
import time
from typing import Any

import pytest

if os.environ.get("REDIS_ROUTER_REQUIRE_VLLM"):  # .ci/run: a missing vllm is a failure
    kv = importlib.import_module("vllm.distributed.kv_events")
else:
    kv = pytest.importorskip(
        "vllm.distributed.kv_events", reason="needs vllm: .ci/run runs this file in .venv-vllm"
    )

from redis_router import RedisLoadBalancer
from redis_router.kv_events import KVEventSubscriber, index_states, offset_endpoint_port

from .test_kv_events import expect, holders, settle

BS = 4


def publisher(folder: Any) -> Any:
    return kv.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"ipc://{folder}/pub",
        replay_endpoint=f"ipc://{folder}/replay",
    )


def batch(events: list[Any]) -> Any:
    return kv.KVEventBatch(ts=time.time(), events=events)


def stored(hashes: list[Any], parent: Any, tokens: list[int]) -> Any:
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_the_index_follows_vllms_own_publisher(server, r, tmp_path):
    rng = random.Random(12)
    meta = {"kv_events": f"ipc://{tmp_path}/pub", "kv_events_replay": f"ipc://{tmp_path}/replay"}
    lb = RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv")
    pub = publisher(tmp_path)
    a, b, c = ([rng.randrange(30_000) for _ in range(3 * BS)] for _ in range(3))
    pub.publish(batch([stored([1, 2], None, a[: 2 * BS])]))
    pub.publish(batch([stored([3], 2, a[2 * BS :]), stored([b"\x07" * 32], None, b[:BS])]))
    sub = KVEventSubscriber(server.url, "kv", poll=0.2, heartbeat=0.2)
    try:
        # published before the subscriber connected: found through the replay socket
        settle([sub], lambda: holders(r, "kv") == expect({"r0": [a, b[:BS]]}, BS))
        pub.publish(batch([kv.BlockRemoved(block_hashes=[3], medium="GPU")]))
        pub.publish(batch([stored([9, 10, 11], None, c)]))
        settle([sub], lambda: holders(r, "kv") == expect({"r0": [a[: 2 * BS], b[:BS], c]}, BS))
        assert index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact"

        pub.shutdown()  # the replica restarts: a new publisher, numbers from 0
        time.sleep(0.2)
        pub = publisher(tmp_path)
        pub.publish(batch([stored([21], None, c[:BS])]))
        settle([sub], lambda: holders(r, "kv") == expect({"r0": [c[:BS]]}, BS), timeout=30)

        pub.publish(batch([kv.AllBlocksCleared()]))
        settle([sub], lambda: holders(r, "kv") == {})
        settle([sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact")
    finally:
        sub.close()
        pub.shutdown()
        lb.close()


def test_dp_rank_ports_match_vllms_offset():
    for endpoint in ("tcp://*:5557", "tcp://10.0.0.1:6000", "tcp://*:0", "inproc://cache", None):
        for rank in (0, 1, 3):
            assert offset_endpoint_port(
                endpoint, rank
            ) == kv.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
