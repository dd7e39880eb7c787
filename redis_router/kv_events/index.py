"""The exact index's writes: one script call per event batch, per heartbeat, per removal.

Thin by design: the events are checked and encoded here, the state changes in the scripts
(``plugins/kv_index_*.lua``; keys at the top of ``kv_index_lib.lua``). Every write names the
stream (replica, dp rank) and the batch's sequence number and time, so any number of
subscribers may send the same batch: the first applies it, the rest are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from redis import exceptions as rx

from .. import validation
from ..invoke import ATTEMPTS, Sender
from ..scripts import Script, load_file
from .hashing import pack_tokens

__all__ = ["AllBlocksCleared", "Applied", "BlockRemoved", "BlockStored", "KVIndex"]

DEFAULT_STALE = 10.0  # s a stream stays trusted without a subscriber vouching for it
DEFAULT_MAX_BLOCKS = 1 << 20  # blocks mapped per stream (~ a large GPU's KV cache, 16 tokens each)
DROP_BUDGET = 512  # old map entries one call drops: about a millisecond of Redis time
U64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockStored:
    """Blocks an engine cached: their engine hashes, the parent's (None: the prompt's start),
    and their token ids (``block_size`` per block)."""

    block_hashes: Sequence[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: Sequence[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: Sequence[int | bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
# One batch of a stream: server id, dp rank, the replica's dp ranks, sequence number, time, events.
Batch = tuple[str, int, int, int, float, Sequence[Event]]


class Applied(NamedTuple):
    """What the index did with a batch: ``outcome`` is ``ok``, ``dup`` (applied before or
    older than the stream: nothing done), ``need`` (send ``need`` first: nothing done) or
    ``removed`` (the replica left the pool: nothing done)."""

    outcome: str
    stored: int = 0
    removed: int = 0
    unchained: int = 0
    need: int = -1


def engine_key(block_hash: int | bytes) -> bytes:
    """An engine block hash as the stream's map keys it: 8 bytes big-endian for an int (vLLM
    masks its int hashes to 64 bits; SGLang's may be signed), else the bytes."""
    if isinstance(block_hash, bytes):
        return block_hash
    if isinstance(block_hash, bool) or not isinstance(block_hash, int):
        raise TypeError(f"block hash must be an int or bytes, got {type(block_hash).__name__}")
    return (block_hash & U64).to_bytes(8, "big")


def encode_events(events: Iterable[Event]) -> list[bytes | str | int]:
    """The events as kv_index_apply.lua's arguments. Raises ValueError for a malformed one."""
    out: list[bytes | str | int] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            n, bs = len(ev.block_hashes), ev.block_size
            if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
                raise ValueError(f"BlockStored block_size must be an int >= 1, got {bs!r}")
            if len(ev.token_ids) != n * bs:
                raise ValueError(
                    f"BlockStored has {n} blocks of {bs} tokens but {len(ev.token_ids)} token ids"
                )
            parent = b"" if ev.parent_block_hash is None else engine_key(ev.parent_block_hash)
            out += ["S", parent, bs, n, *(engine_key(h) for h in ev.block_hashes)]
            out.append(pack_tokens(ev.token_ids))
        elif isinstance(ev, BlockRemoved):
            out += ["R", len(ev.block_hashes), *(engine_key(h) for h in ev.block_hashes)]
        elif isinstance(ev, AllBlocksCleared):
            out.append("C")
        else:
            raise TypeError(f"not a KV-cache event: {type(ev).__name__}")
    return out


@cache
def _script(name: str) -> Script:
    folder = resources.files("redis_router") / "plugins"
    return load_file(Path(str(folder / f"{name}.lua")))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _applied(raw: Any) -> Applied:
    reply = [_text(v) for v in raw]
    if reply[0] == "ok":
        return Applied("ok", int(reply[1]), int(reply[2]), int(reply[3]))
    if reply[0] == "need":
        return Applied("need", need=int(reply[1]))
    return Applied(reply[0])


class KVIndex:
    """The exact index of balancer ``name`` on a redis-py client (sync)."""

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        stale: float = DEFAULT_STALE,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        self.client = client
        self.name = validation.name(name)
        self.prefix = f"rr:{{{self.name}}}:"
        self.stale_ms = max(1, round(validation.seconds(stale, "stale") * 1000))
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an int >= 1, got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._scripts = Sender(client)  # FCALL or EVALSHA, probed on the first call

    def _call(self, name: str, args: Sequence[Any]) -> Any:
        return self._scripts.send(_script(name), self.prefix, tuple(args))

    def _apply_args(
        self,
        server_id: str,
        rank: int,
        ranks: int,
        seq: int,
        ts: float,
        events: Iterable[Event],
        gap_ok: bool,
    ) -> list[Any]:
        return [
            server_id,
            rank,
            ranks,
            seq,
            repr(float(ts)),
            int(gap_ok),
            self.stale_ms,
            self.max_blocks,
            DROP_BUDGET,
            *encode_events(events),
        ]

    def apply(
        self,
        server_id: str,
        rank: int,
        ranks: int,
        seq: int,
        ts: float,
        events: Iterable[Event],
        *,
        gap_ok: bool = False,
    ) -> Applied:
        """Apply one batch of stream (server_id, rank); see kv_index_apply.lua."""
        args = self._apply_args(server_id, rank, ranks, seq, ts, events, gap_ok)
        return _applied(self._call("kv_index_apply", args))

    def apply_many(self, batches: Sequence[Batch]) -> list[Applied]:
        """Apply batches (of any streams, each stream's in order) in one round trip: a pipeline
        of one script call per batch, not a transaction, so the outcomes are those of apply()
        called on each in turn. Nothing is sent if an event is malformed (ValueError)."""
        if not batches:
            return []
        argss = [self._apply_args(*b, gap_ok=False) for b in batches]
        script = _script("kv_index_apply")
        for attempt in range(ATTEMPTS):
            # the last attempt sends the source (EVAL), which no SCRIPT FLUSH can race
            head = ("EVAL", script.source) if attempt == ATTEMPTS - 1 else ("EVALSHA", script.sha)
            pipe = self.client.pipeline(transaction=False)
            for args in argss:
                pipe.execute_command(*head, 1, self.prefix, *args)
            replies = pipe.execute(raise_on_error=False)
            if not any(isinstance(r, rx.NoScriptError) for r in replies):
                break
            # Resending them all is safe: a batch that did apply the first time answers "dup".
            self.client.script_load(script.source)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [_applied(r) for r in replies]

    def restarted(self, server_id: str, rank: int, ranks: int, seq: int, ts: str) -> Applied:
        """The publisher restarted and published nothing since: reset the stream, unless its
        last applied batch is no longer (seq, ts) (another subscriber got there first)."""
        args = [server_id, rank, ranks, seq, ts, 2, self.stale_ms, self.max_blocks, DROP_BUDGET]
        return Applied(_text(self._call("kv_index_apply", args)[0]))

    def heartbeat(self, streams: Sequence[tuple[str, int, int, str]]) -> tuple[int, int]:
        """Vouch for streams (server id, rank, ranks, link "1" | "0" | "e"); drop a share of
        old maps. Returns (maps still waiting, replicas trusted among those named)."""
        args: list[Any] = [self.stale_ms, DROP_BUDGET]
        for sid, rank, ranks, link in streams:
            args += [sid, rank, ranks, link]
        waiting, trusted = self._call("kv_index_heartbeat", args)
        return int(waiting), int(trusted)

    def drop(self, server_ids: Sequence[str]) -> tuple[int, int]:
        """Forget replicas that left the pool. Returns (streams forgotten, maps waiting)."""
        forgotten, waiting = self._call("kv_index_drop", [DROP_BUDGET, *server_ids])
        return int(forgotten), int(waiting)

    def drain(self) -> int:
        """Drop old maps until none waits (bounded calls). Returns how many calls it took."""
        calls = 0
        while True:
            calls += 1
            waiting, _ = self.heartbeat([])
            if waiting == 0:
                return calls
