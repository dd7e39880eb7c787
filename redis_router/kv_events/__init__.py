"""An exact index of which replica holds which KV-cache block, kept in Redis from the
replicas' own KV-cache events (vLLM's and SGLang's ``--kv-events-config`` publishers), shared
by every worker of a balancer.

Pieces: :class:`KVEventSubscriber` (``redis-router kv-events``) follows every replica whose
metadata names a publisher (:mod:`.endpoints`), decodes its batches (:mod:`.wire`) and applies
each, once, with one script call (:class:`KVIndex`); routing reads the index inside its own
script with ``plugins/kv_index_lib.lua`` after hashing the prompt with :func:`block_hashes`.
:mod:`.publisher` publishes in the engines' wire format, to test or benchmark without one.

Keys (``P = "rr:{NAME}:"``; a stream is one dp rank of one replica, ``RANK:ID``):

- ``P kv:idx`` HASH: router block hash (16 hex) -> ``ID\\x1fRANK\\x1fEPOCH\\x1f`` per holder.
- ``P kv:exact`` HASH: replica id -> deadline (ms, Redis clock) until which its index is exact.
- ``P kv:stream`` HASH: ``RANK:ID`` -> ``SEQ TS EPOCH BLOCKS TRASH SEEN LINK STATUS``.
- ``P kv:map:RANK:ID`` HASH: engine block hash -> router block hash.
- ``P kv:trash`` LIST and ``P kv:trash:EPOCH:RANK:ID`` HASHes: maps a reset set aside, dropped
  a share per call; ``P kv:epochs``: the epoch counter.

Details, states and memory: docs/kv_events.md. The subscriber needs the ``kv-events`` extra
(msgspec, pyzmq); everything else here does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .endpoints import StreamEndpoint, offset_endpoint_port, replica_ports, streams_of
from .hashing import block_hashes
from .index import AllBlocksCleared, Applied, BlockRemoved, BlockStored, KVIndex
from .state import index_states

if TYPE_CHECKING:
    from .subscriber import KVEventSubscriber

__all__ = [
    "AllBlocksCleared",
    "Applied",
    "BlockRemoved",
    "BlockStored",
    "KVEventSubscriber",
    "KVIndex",
    "StreamEndpoint",
    "block_hashes",
    "index_states",
    "offset_endpoint_port",
    "replica_ports",
    "streams_of",
]


def __getattr__(name: str) -> Any:
    """KVEventSubscriber is imported on first use: it needs pyzmq and msgspec."""
    if name == "KVEventSubscriber":
        try:
            from .subscriber import KVEventSubscriber
        except ImportError as exc:
            raise ImportError(
                f"KVEventSubscriber needs the kv-events extra: pip install msgspec pyzmq ({exc})"
            ) from exc
        return KVEventSubscriber
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
