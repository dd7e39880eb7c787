"""The router's block hashes of a token sequence, as the exact index keys them.

Each hash names a whole token prefix, chained one engine block at a time: hash(d) = the first
16 hex characters of SHA-1(hash(d - 1) + the block's token ids as uint32 little-endian), with
``"kv{block_size}:"`` before the first block. Chained, because a ``BlockStored`` event carries
only its own blocks' tokens and its parent's engine hash: the index script (``kv_index_apply.lua``,
with Redis's ``redis.sha1hex``) continues from the parent's router hash. A running hash over the
whole prompt (what ``plugins/prefix_cache.py`` uses for the approximate index) cannot be
continued from a digest, so the two indexes use different hashes of the same token ids.
Never the engine's own hash: it depends on the engine's hash seed.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["block_hashes", "pack_tokens"]

HASH_CHARS = 16
TOKEN_LIMIT = 1 << 32


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian. Raises ValueError for an id outside [0, 2**32)."""
    try:
        ids = array("I", token_ids) if array("I").itemsize == 4 else array("L", token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None
    except TypeError:
        raise TypeError(
            f"token_ids must be a sequence of ints, got {type(token_ids).__name__}"
        ) from None
    if ids.itemsize != 4:  # array's C types vary by platform; the hashes must not
        if any(t >= TOKEN_LIMIT for t in ids):
            raise ValueError("token ids must be in [0, 2**32)")
        return b"".join(t.to_bytes(4, "little") for t in ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[str]:
    """The router hash of each full block of ``token_ids`` (a trailing partial block has none),
    at most ``limit`` of them: what a routing script looks up in ``kv:idx``. ``block_size`` is
    the replica's (vLLM's ``--block-size``, 16 by default), not the approximate router's."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    raw = pack_tokens(token_ids[: n * block_size])
    prev = f"kv{block_size}:".encode()
    width = 4 * block_size
    out = []
    sha1 = hashlib.sha1
    for j in range(n):
        h = sha1(prev + raw[j * width : (j + 1) * width]).hexdigest()[:HASH_CHARS]
        out.append(h)
        prev = h.encode()
    return out
