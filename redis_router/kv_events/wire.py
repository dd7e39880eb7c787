"""Decoding the KV-events wire format vLLM and SGLang publish (needs msgspec).

A message is ZMQ multipart: topic, sequence number (8 bytes big-endian), and a msgpack
``KVEventBatch``: an array ``[ts, events, data_parallel_rank?]``. Each event is a tagged struct,
``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``: SGLang and older vLLM encode it as an
array whose first item is the tag (``array_like``), current vLLM as a map with a ``type`` key.
Fields that newer engines append are ignored, absent optional ones take their defaults.

Only blocks the router can look up are kept: on the GPU (``medium`` None or GPU), in the first
KV-cache group, and hashed from token ids alone (no LoRA, no multimodal or salt ``extra_keys``).
A ``BlockStored`` whose token ids do not fill its blocks (or do not fit uint32) is skipped too:
one odd engine must not stop the subscriber, and with it the index of every replica. A skipped
``BlockStored`` leaves its engine hashes unmapped, so its descendants are skipped too and its
removal is a no-op.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .hashing import TOKEN_LIMIT
from .index import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["Batch", "decode_batch", "decode_seq"]

Hash = int | bytes


class Batch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _StoredA(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedA(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedA(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _StoredM(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedM(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedM(msgspec.Struct, tag="AllBlocksCleared"):
    pass


_BATCH = msgspec.msgpack.Decoder(Batch)
_ARRAY = msgspec.msgpack.Decoder(_StoredA | _RemovedA | _ClearedA)
_MAP = msgspec.msgpack.Decoder(_StoredM | _RemovedM | _ClearedM)
_MAP_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def _on_gpu(medium: str | None, group_idx: int | None) -> bool:
    return (medium is None or medium.upper() == "GPU") and not group_idx


def _hashable(ev: _StoredA | _StoredM) -> bool:
    """Its token ids fill its blocks exactly and fit uint32: what the index can hash."""
    toks = ev.token_ids
    return (
        ev.block_size >= 1
        and len(toks) == len(ev.block_hashes) * ev.block_size
        and (not toks or (min(toks) >= 0 and max(toks) < TOKEN_LIMIT))
    )


def _event(raw: msgspec.Raw) -> Event | None:
    """One event in the index's terms, None for an unknown tag or a block the router cannot
    look up (see the module docstring)."""
    data = bytes(raw)
    try:
        ev = (_MAP if data and data[0] in _MAP_BYTES else _ARRAY).decode(data)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Invalid value") and text.endswith(("at `$[0]`", "at `$.type`")):
            return None  # an event type this subscriber does not know: newer engines add some
        raise
    if isinstance(ev, (_StoredA, _StoredM)):
        plain = ev.lora_id is None and not ev.lora_name and not any(ev.extra_keys or ())
        if not (plain and _on_gpu(ev.medium, ev.group_idx) and _hashable(ev)):
            return None
        return BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
    if isinstance(ev, (_RemovedA, _RemovedM)):
        return BlockRemoved(ev.block_hashes) if _on_gpu(ev.medium, ev.group_idx) else None
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """(ts, events the index keeps, data_parallel_rank) of one published payload. Raises
    msgspec.DecodeError (a subclass of ValueError) for a malformed one."""
    batch = _BATCH.decode(payload)
    events = [e for e in map(_event, batch.events) if e is not None]
    return batch.ts, events, batch.data_parallel_rank


def decode_seq(frame: bytes) -> int:
    """The sequence number frame: 8 bytes big-endian, signed (the replay end marker is -1)."""
    if len(frame) != 8:
        raise ValueError(f"sequence number frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
