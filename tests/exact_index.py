"""Replicas with KV-events streams, prompts, and an engine publishing through the exact index's
own script (kv_index_apply.lua): what the tests of exact-index routing share."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

from redis_router.kv_events import BlockStored, KVIndex
from redis_router.plugins.prefix_cache import PrefixCacheRouter

SERVERS = {f"s{i}": {"kv_events": f"tcp://127.0.0.1:{i + 1}"} for i in range(4)}
BLOCK = 32  # the approximate index's block
KV_BLOCK = 16  # the engine's block


def prompt(seed: int, tokens: int = 8 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(tokens)]


class Engine:
    """One replica's event stream: batches numbered from 0, applied by the index script."""

    def __init__(self, index: KVIndex, sid: str) -> None:
        self.index, self.sid, self.seq, self.next_hash = index, sid, 0, 1

    def publish(self, *events: Any) -> None:
        got = self.index.apply(self.sid, 0, 1, self.seq, 1.0 + self.seq, events)
        assert got.outcome == "ok", got
        self.seq += 1

    def store(self, tokens: list[int]) -> list[int]:
        """Cache the full engine blocks of ``tokens``; returns their engine hashes."""
        n = len(tokens) // KV_BLOCK
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        self.publish(BlockStored(hashes, None, tokens[: n * KV_BLOCK], KV_BLOCK))
        return hashes


@contextlib.contextmanager
def routers(url: str, **defaults: Any) -> Iterator[Callable[..., PrefixCacheRouter]]:
    """Make prefix_cache routers on the exact index over SERVERS (the engine's and the
    approximate index's blocks, then ``defaults``, then each call's own settings); closed at
    the end."""
    made: list[PrefixCacheRouter] = []

    def make(**kw: Any) -> PrefixCacheRouter:
        kw = {"kv_block_size": KV_BLOCK, "block_size": BLOCK, **defaults, **kw}
        lb = PrefixCacheRouter(SERVERS, router_kwargs={"redis": url, **kw})
        made.append(lb)
        return lb

    try:
        yield make
    finally:
        for lb in made:
            lb.close()


def engines(r: Any, name: str, sids: Any, stale: float = 10.0) -> dict[str, Engine]:
    """An exact stream per replica named (an empty first batch: exact, nothing cached)."""
    index = KVIndex(r, name, stale=stale)
    out = {sid: Engine(index, sid) for sid in sids}
    for e in out.values():
        e.publish()
    return out
