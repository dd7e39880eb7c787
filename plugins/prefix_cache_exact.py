"""The exact index's hashes of a prompt, for prefix_cache's exact routing (``kv_block_size``).

Why a module of its own: the exact index keys a block by a SHA-1 chained over every engine
block (``redis_router.kv_events.block_hashes``: an event carries only its own blocks, so each
hash must continue from its parent's), which costs one SHA-1 per 16 tokens in the client,
~165 µs for 4k tokens. Most prompts a router sees repeat or extend one it saw a moment ago (a
GRPO group's 8 samples, the next turn of a session, a shared system prompt), so
:class:`ExactChains` remembers where the chain stood at each sampled depth of recent prompts
and continues from the deepest one this prompt shares: only its new blocks are hashed.

The key of a remembered prefix is the approximate index's hash of it (64-bit blake2b of its
tokens, already computed for the acquire), so looking one up costs a dict probe per depth.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

from redis_router.kv_events.hashing import HASH_CHARS, pack_tokens

__all__ = ["ExactChains", "grid_positions"]

MEMO_SIZE = 8192  # prefixes remembered (each ~0.5 KB): a few hundred recent prompts


def grid_positions(blocks: int) -> list[int]:
    """The grid of depths prefix_cache samples, up to ``blocks`` (every depth up to 8, then
    four per doubling), without the prompt's own length appended."""
    out, j = [], 1
    while j <= blocks:
        out.append(j)
        j += 1 << max(0, j.bit_length() - 3)
    return out


@lru_cache(maxsize=4096)
def _grid_set(blocks: int) -> frozenset[int]:
    return frozenset(grid_positions(blocks))


class ExactChains:
    """Exact hashes at the sampled depths of prompts, continued from remembered prefixes.
    Safe to share between threads (a lost update only costs a recomputation)."""

    def __init__(self, kv_block_size: int, size: int = MEMO_SIZE) -> None:
        self.kv_block_size = kv_block_size
        self.size = size
        # approximate prefix hash -> (engine blocks b, exact hashes at grid depths <= b,
        # exact hash of block b)
        self.memo: OrderedDict[str, tuple[int, tuple[str, ...], str]] = OrderedDict()
        self.lock = threading.Lock()

    def hashes(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        marks: Sequence[tuple[int, str]],
    ) -> tuple[int, list[str]]:
        """(engine blocks n of the prompt's first ``max_tokens`` tokens, the exact hashes at
        the grid of depths of n, the last one at depth n). ``marks``: (tokens, approximate
        hash of the prompt up to there) per sampled depth, shallowest first. Raises
        ValueError for token ids outside [0, 2**32)."""
        kbs = self.kv_block_size
        n = min(len(prompt_ids), max_tokens) // kbs
        at = {t // kbs: key for t, key in marks if t % kbs == 0 and 0 < t // kbs <= n}
        start, grid, prev = 0, [], f"kv{kbs}:"
        for b in sorted(at, reverse=True):
            got = self.memo.get(at[b])
            if got is not None and got[0] == b:
                start, grid, prev = b, list(got[1]), got[2]
                break
        raw = pack_tokens(prompt_ids[start * kbs : n * kbs])
        width, sha1, prev_b = 4 * kbs, hashlib.sha1, prev.encode()
        chain: list[bytes] = []  # the hashes of blocks start + 1 .. n
        for off in range(0, len(raw), width):
            prev_b = sha1(prev_b + raw[off : off + width]).hexdigest()[:HASH_CHARS].encode()
            chain.append(prev_b)
        new: list[tuple[int, tuple[str, ...], str]] = []
        marks_after = sorted(b for b in at if b > start)
        for j in grid_positions(n):
            if j <= start:
                continue
            while marks_after and marks_after[0] < j:  # a mark between grid depths
                b = marks_after.pop(0)
                new.append((b, tuple(grid), chain[b - start - 1].decode()))
            grid.append(chain[j - start - 1].decode())
        for b in marks_after:
            new.append((b, tuple(grid), chain[b - start - 1].decode()))
        if n and n not in _grid_set(n):  # the prompt's own length closes the grid
            grid.append(chain[-1].decode() if chain else prev)
        self._remember(at, new)
        return n, grid

    def _remember(self, at: dict[int, str], new: list[tuple[int, tuple[str, ...], str]]) -> None:
        with self.lock:
            for entry in new:
                self.memo[at[entry[0]]] = entry
            while len(self.memo) > self.size:
                self.memo.popitem(last=False)  # the oldest remembered
