"""Where each replica publishes its KV-cache events, and a deterministic port plan.

A replica's metadata (``servers add ID --meta JSON``) names its publisher under ``kv_events``: a
``tcp://host:port`` (or ``ipc://``) string, or a list of them, one per data-parallel rank; and
optionally ``kv_events_replay`` likewise, the publisher's replay (ROUTER) socket. A replica
without ``kv_events`` has no exact index. A data-parallel rank registered as a pool member of
its own (``dp_rank`` in its metadata, redis_router.dp) reads its rank's publisher only.

vLLM (and SGLang) bind rank r's publisher at the configured port + r, so replicas on one
machine need ports far enough apart: :func:`replica_ports` gives replica i the block
``base + i * stride``, publishers at its start and replay sockets at its middle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "StreamEndpoint",
    "offset_endpoint_port",
    "replica_ports",
    "streams_of",
]

DEFAULT_BASE_PORT = 5557
DEFAULT_STRIDE = 16


@dataclass(frozen=True)
class StreamEndpoint:
    """One publisher: a replica's data-parallel rank, where it publishes and replays."""

    server_id: str
    rank: int
    ranks: int
    endpoint: str
    replay: str | None


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel rank ``data_parallel_rank`` uses, as vLLM computes it: a tcp
    port plus the rank (a port of 0 is left for the OS), an inproc name with ``_dp{rank}``;
    rank 0 and None unchanged; anything else is refused, as vLLM refuses it."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(
        f"endpoint {endpoint!r} must contain 'inproc' or 'tcp' to be offset by a dp rank"
    )


def replica_ports(
    index: int,
    *,
    host: str,
    base: int = DEFAULT_BASE_PORT,
    stride: int = DEFAULT_STRIDE,
    dp_size: int = 1,
) -> tuple[dict[str, Any], str]:
    """Ports for replica number ``index`` (0, 1, ...): its metadata for the balancer
    (``kv_events`` and ``kv_events_replay``, one endpoint per dp rank, at ``host``) and the
    ``--kv-events-config`` JSON to start it with (vLLM binds ``*`` and adds the rank itself).

    Replica i publishes rank r at ``base + i * stride + r`` and replays at
    ``base + i * stride + stride // 2 + r``: deterministic, so every worker and subscriber
    computes the same plan, and ranks never collide while ``dp_size <= stride // 2``."""
    for value, arg, low in ((index, "index", 0), (dp_size, "dp_size", 1), (stride, "stride", 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
    if dp_size > stride // 2:
        raise ValueError(
            f"dp_size {dp_size} does not fit in stride {stride}: use stride >= {2 * dp_size}"
        )
    pub = base + index * stride
    replay = pub + stride // 2
    if pub <= 0 or replay + dp_size - 1 > 65535:
        raise ValueError(f"ports {pub}..{replay + dp_size - 1} are outside 1..65535")
    meta: dict[str, Any] = {
        "kv_events": [f"tcp://{host}:{pub + r}" for r in range(dp_size)],
        "kv_events_replay": [f"tcp://{host}:{replay + r}" for r in range(dp_size)],
    }
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    return meta, json.dumps(config)


def _as_list(value: Any, key: str, server_id: str) -> list[str] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(e, str) and e for e in items):
        raise ValueError(
            f"replica {server_id!r}: metadata {key!r} must be an endpoint string or a non-empty "
            f"list of them, one per dp rank; got {value!r}"
        )
    return items


def streams_of(server_id: str, metadata: Any) -> list[StreamEndpoint]:
    """The publishers a replica's metadata names (none without ``kv_events``). Raises
    ValueError naming the replica and key when the metadata is malformed."""
    if not isinstance(metadata, dict) or "kv_events" not in metadata:
        return []
    pubs = _as_list(metadata["kv_events"], "kv_events", server_id) or []
    replays = _as_list(metadata.get("kv_events_replay"), "kv_events_replay", server_id)
    if replays is not None and len(replays) != len(pubs):
        raise ValueError(
            f"replica {server_id!r}: {len(pubs)} kv_events endpoints but {len(replays)} "
            "kv_events_replay ones; give one of each per dp rank"
        )
    rank = metadata.get("dp_rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        # A rank registered as a pool member of its own (redis_router.dp): its publisher
        # alone, as a replica of one rank. One endpoint for all ranks is offset as vLLM does.
        if len(pubs) > 1 and rank >= len(pubs):
            raise ValueError(
                f"replica {server_id!r}: dp_rank {rank} but {len(pubs)} kv_events endpoints; "
                "give one per dp rank, or one that each rank offsets"
            )
        if len(pubs) > 1:
            return [StreamEndpoint(server_id, 0, 1, pubs[rank], replays[rank] if replays else None)]
        pub = offset_endpoint_port(pubs[0], rank)
        replay = offset_endpoint_port(replays[0], rank) if replays else None
        assert pub is not None
        return [StreamEndpoint(server_id, 0, 1, pub, replay)]
    return [
        StreamEndpoint(server_id, r, len(pubs), pub, replays[r] if replays else None)
        for r, pub in enumerate(pubs)
    ]
