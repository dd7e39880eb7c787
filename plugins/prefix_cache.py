"""Prefix-cache-aware routing: send a request to the replica that already holds the longest
prefix of its prompt in its KV cache, unless that would unbalance the pool.

Why: recomputing a prompt prefix that another replica already has is the biggest avoidable
cost in LLM serving. Multi-turn sessions are served by stickiness; GRPO-style groups (one
prompt sampled n times under n request ids) and shared system prompts are not: a least-loaded
balancer scatters them over the pool, and every replica recomputes the same prefix.

Algorithm (the policy of SGLang's cache-aware router, on an approximate index in Redis):

1. The client cuts ``prompt_ids`` into blocks of ``block_size`` tokens (a trailing partial
   block is ignored) and hashes the prompt up to a grid of depths, as vLLM's prefix caching
   does with chained block hashes: one running blake2b (64 bits, seeded with the block size;
   never Python's ``hash()``) read at each depth, so one hash names a whole prefix and a
   replica that received depth i also received every depth < i. Only the grid is hashed and
   indexed (every block up to 8, then four per doubling, plus the prompt's own length: 21
   hashes for 4k tokens), so acquire costs O(log n) and a cached prefix is found to within 1/8
   of its length; an identical prompt (a GRPO group) matches in full.
2. One atomic script (``prefix_cache.lua``, on the shared ``acquire_all``) routes: a retry or a
   sticky session goes where the core sends it. For a new session the deepest hash some live
   replica (in the pool, not draining) received within ``index_ttl`` wins, among those
   covering at least ``min_match`` of the prompt's blocks: the least loaded of its holders
   (random tie-break with client entropy), else the least loaded of the pool. Unless that
   replica would become a *hot spot*: with this request, its in-flight count would exceed the
   median count ``m`` of the replicas taking new sessions by more than
   ``balance_abs_threshold`` and be more than ``balance_rel_threshold * m``, or exceed the
   least loaded count by more than 4 x ``balance_abs_threshold`` and be more than
   ``balance_rel_threshold`` times it (replicas that never received a shared prefix may be
   fewer than half the pool, below the median); then the least-loaded replica gets it. A
   request whose whole prompt the replica holds (its deepest hash: a GRPO group's samples, a
   repeat) is judged against the least loaded count only, by more than 2 x
   ``balance_abs_threshold``: sent elsewhere it would lose all of its prompt, not the share a
   shared system prompt is, and while fewer groups than replicas are in flight the median is
   0, so the first test would split every group larger than ``balance_abs_threshold``. The
   deepest hash is read first (a repeated prompt costs one HGET), the rest with one HMGET;
   the hot-spot test (ZCARD, two ZRANGE by rank, a ZSCORE) runs only when a prefix decides.

   SGLang's cache-aware router instead ignores prefixes whenever the pool's spread, max - min
   and max / min, exceeds its thresholds. Judging the replica the prefix picks, against the
   median and the least loaded, keeps a GRPO group (n samples of one prompt, arriving
   together) on one replica until that replica itself stands out, even while another
   replica is busy with long sticky sessions, and moves it as soon as it does. With the
   spread test, small thresholds split groups and large ones let whole groups pile onto one
   replica (the measured table is in docs/prefix_cache.md).
3. The same script records the prompt's hashes for the chosen replica (also on sticky turns;
   those it received in the last ``index_ttl / 16`` are not rewritten, so a hot prefix costs
   reads only) as one *write*: one HSET into the index hash and one LRU entry for the lot.
   Then it trims the index: writes naming more than ``max_index_blocks`` hashes in all lose
   the oldest, and writes older than ``index_ttl`` go a few per call. Keys: see
   ``prefix_cache_index.lua`` (``rr:{NAME}:pc:idx``, ``pc:lru``, ``pc:n``).

The index is approximate: it assumes a replica keeps what it was sent for ``index_ttl``.

Exact routing (``kv_block_size`` set to the replicas' engine block size, vLLM's
``--block-size``): for replicas whose KV-events stream is healthy (``redis-router kv-events``
keeps the exact index, docs/kv_events.md; a replica counts while its ``kv:exact`` deadline is
in the future) the script reads what the engine itself reports it holds, in the same call.
The client also hashes the prompt as the exact index does (SHA-1 chained per engine block,
:func:`redis_router.kv_events.block_hashes`, read at the same grid of depths; ~165 µs for a
never-seen 4k-token prompt at 16 tokens a block, ~10 µs for one repeating a recent prompt, see
``prefix_cache_exact.py``; so it is off unless asked for) and step 2 becomes: the deepest
prefix, in tokens, held by an exact replica per the exact index, or by any other replica per
the approximate index, wins; depths less than a block of the coarser grid apart pool their
holders. With no replica listed in ``kv:exact`` the script costs one HLEN more and routes as
without exact hashes. An exact replica's approximate
records count only while younger than ``kv_event_lag``: they stand in for the events of blocks
it was just sent and has not reported yet (a GRPO group's 8 samples arrive together, before
the first one's prefill is published); after that the exact index is the truth, including its
evictions. So record_on_acquire keeps recording for every replica.

Options (YAML keys beside ``router_class``, or keyword arguments; the core's options such as
``redis``, ``name``, ``sticky_ttl``, ``lease_ttl`` pass through):

- ``block_size`` (32): tokens per block; a match shorter than one block is ignored.
- ``balance_abs_threshold`` (4) and ``balance_rel_threshold`` (1.2): the replica a prefix picks
  is a hot spot, and the request goes to the least-loaded replica instead, only when its count
  with the request exceeds the median by more than the first and is more than the second
  times the median, or exceeds the least loaded count by more than four times the first and
  is more than the second times it. At high load the relative one decides (a replica may
  carry 20 % more than the median for its prefixes); the absolute one lets small counts (3
  against a median of 0) keep their prefix. A repeat of a whole prompt (a GRPO group) stays
  until it would exceed the least loaded count by more than twice the first: 8 with the
  default, so a group of up to 9 samples stays whole on an idle pool (for groups of n, set
  it to n / 2).
- ``min_match`` (0.5): smallest fraction of the prompt's blocks a cached prefix must cover to
  override least-loaded (SGLang's ``cache_threshold``).
- ``index_ttl`` (600 s): how long a replica is assumed to keep a block it received.
- ``max_index_blocks`` (100_000): bound on the index, in hashes recorded (a hash recorded
  for two replicas, or twice for one, counts twice); about 160 bytes per hash recorded.
- ``max_prompt_blocks`` (1024): blocks of a prompt looked at (32k tokens); later ones ignored.
- ``record_on_acquire`` (true): record blocks on acquire; false when only
  :meth:`PrefixCacheRouter.record_blocks` / :meth:`~PrefixCacheRouter.evict_blocks` feed the
  approximate index (hashes from :meth:`~PrefixCacheRouter.block_hashes`).
- ``kv_block_size`` (None): the engine's KV block size in tokens; set it to route on the exact
  index for the replicas whose stream is exact (None: the approximate index only, and the
  client computes no exact hashes).
- ``kv_event_lag`` (2 s): how long an acquire's approximate record stands in for an exact
  replica's KV events that have not reached the index yet.
- ``sticky_min_cached`` (None: off): eviction-aware stickiness. A sticky turn stays on its
  replica while that replica's exact index holds at least this share of the prompt's engine
  blocks (the first sampled depth covering it; 0.5 = half the prompt); when it no longer
  does, the turn is placed by the rule above as a new session would be (a replica holding
  the prefix, else the least loaded) and counted as a re-pin of the replica it left. Only
  replicas whose stream is exact are judged (a sticky replica judged by the approximate
  record stays); needs ``kv_block_size``. Pinned in Redis like the balancer's settings.

Under ``full_determinism`` new sessions are placed by rendezvous hashing as in the core (I5).
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, validation
from redis_router.core import BalancerCore, Call, Op
from redis_router.plugins.prefix_cache_exact import ExactChains
from redis_router.policy import RoutingPolicy
from redis_router.scripts import Script, load_file

# Index blocks past index_ttl that one call forgets: bounded, so a call never walks a stale index.
INDEX_TRIM_BUDGET = 64

__all__ = [
    "AsyncPrefixCacheRouter",
    "PrefixCache",
    "PrefixCacheRouter",
    "PrefixSettings",
    "chain_hashes",
    "sample_depths",
]

# Bounds of the options (see PrefixSettings.__post_init__).
MAX_BLOCK_SIZE = 1 << 20
MAX_INDEX_BLOCKS = 1 << 40
MAX_THRESHOLD = 1e12
HASH_CHARS = 16  # hex characters per block hash (64 bits), as prefix_cache_index.lua's HW
MAX_BLOCKS_PER_CALL = 1024  # per record_blocks/evict_blocks call, as prefix_cache_record.lua says
_PERSON = b"rr-prefix"
_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PrefixSettings:
    """The router's own options, validated before anything is sent (I8)."""

    block_size: int = 32
    balance_abs_threshold: float = 4
    balance_rel_threshold: float = 1.2
    min_match: float = 0.5
    index_ttl: float = 600.0
    max_index_blocks: int = 100_000
    max_prompt_blocks: int = 1024
    record_on_acquire: bool = True
    kv_block_size: int | None = None
    kv_event_lag: float = 2.0
    sticky_min_cached: float | None = None

    def __post_init__(self) -> None:
        # Upper bounds keep every value exact in Lua's doubles and within what it is packed in
        # (block_size seeds the hash as 8 bytes), so no option fails later with OverflowError.
        _int(self.block_size, "block_size", 1, MAX_BLOCK_SIZE)
        _int(self.max_index_blocks, "max_index_blocks", 1, MAX_INDEX_BLOCKS)
        _int(self.max_prompt_blocks, "max_prompt_blocks", 1, 1 << 20)
        _number(self.balance_abs_threshold, "balance_abs_threshold", 0, MAX_THRESHOLD)
        _number(self.balance_rel_threshold, "balance_rel_threshold", 1, MAX_THRESHOLD)
        _number(self.min_match, "min_match", 0, 1)
        validation.seconds(self.index_ttl, "index_ttl")
        if self.kv_block_size is not None:
            _int(self.kv_block_size, "kv_block_size", 1, MAX_BLOCK_SIZE)
        _number(self.kv_event_lag, "kv_event_lag", 0, validation.MAX_TTL)
        if self.sticky_min_cached is not None:
            _number(self.sticky_min_cached, "sticky_min_cached", 0, 1)
            if self.sticky_min_cached <= 0:
                raise ValueError(
                    f"sticky_min_cached must be a share of the prompt in (0, 1] (e.g. 0.5), "
                    f"got {self.sticky_min_cached!r}"
                )
            if self.kv_block_size is None:
                raise ValueError(
                    "sticky_min_cached needs kv_block_size (the exact KV-events index): the "
                    "approximate index records what was sent to a replica, not what it still "
                    "holds, so it cannot tell an evicted session from a kept one"
                )
        if not isinstance(self.record_on_acquire, bool):
            raise TypeError(
                f"record_on_acquire must be a bool, got {type(self.record_on_acquire).__name__}"
            )

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.index_ttl * 1000))

    def lua(self) -> str:
        """The settings argument of prefix_cache.lua."""
        return (
            f"{self.balance_abs_threshold!r} {self.balance_rel_threshold!r} "
            f"{self.ttl_ms} {self.max_index_blocks} {INDEX_TRIM_BUDGET} "
            f"{int(self.record_on_acquire)} {max(1, self.ttl_ms // 16)} "
            f"{round(self.kv_event_lag * 1000)} {self.block_size} {self.kv_block_size or 0} "
            f"{'-' if self.sticky_min_cached is None else repr(float(self.sticky_min_cached))}"
        )


OPTION_NAMES = frozenset(PrefixSettings.__dataclass_fields__)


def _int(value: object, arg: str, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{arg} must be {bound}, got {value}")


def _number(value: object, arg: str, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{arg} must be a finite number {bound}, got {value!r}")


def sample_depths(blocks: int) -> list[int]:
    """The depths (in blocks) of a prompt the index keeps: every depth up to 8, then four per
    doubling (10, 12, 14, 16, 20, 24, ...), then the prompt's own length. Every prompt shares
    the grid, so a cached prefix is found to within 1/8 of its length with O(log n) hashes."""
    return list(_grid(blocks))


@lru_cache(maxsize=4096)
def _grid(blocks: int) -> tuple[int, ...]:
    """sample_depths, computed once per prompt length (acquire's hot path)."""
    out, j = [], 1
    while j <= blocks:
        out.append(j)
        j += 1 << max(0, j.bit_length() - 3)
    if out and out[-1] != blocks:
        out.append(blocks)
    return tuple(out)


@lru_cache(maxsize=4096)
def _first_counted(blocks: int, min_match: float) -> str:
    """The 1-based index of the first sampled depth that covers ``min_match`` of the prompt:
    the shallowest hash a cached prefix may match to override least-loaded."""
    depths = _grid(blocks)
    need = min_match * blocks
    return str(next((k for k, d in enumerate(depths, 1) if d >= need), len(depths)))


def _prefix_hex(
    prompt_ids: Sequence[int], block_size: int, limit: int
) -> tuple[tuple[int, ...], str]:
    """The sampled depths of ``prompt_ids`` (full blocks, at most ``limit``) and the hashes of
    the prompt up to each, as one string of 16 hex characters per depth.

    One running blake2b (64 bits, seeded with the block size; never ``hash()``) is read at each
    depth, so a hash names a whole prefix and the prompt's bytes are hashed once; the digests
    are hexed together. Hot path of acquire: ~30 µs for 4k tokens, most of it turning Python
    ints into bytes."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise TypeError(
            f"prompt_ids must be a sequence of token ids (ints), got {type(prompt_ids).__name__}"
        )
    n = len(prompt_ids) // block_size
    if n > limit:
        prompt_ids, n = prompt_ids[: limit * block_size], limit
    ids = array("I")
    try:
        if type(prompt_ids) is list:
            ids.fromlist(prompt_ids)  # a third faster than array("I", list)
        else:
            ids = array("I", prompt_ids)
        seed = b"I"
    except OverflowError:  # a negative id or one >= 2**32: its own namespace of hashes
        ids, seed = _wide_ids(prompt_ids), b"q"
    except (TypeError, ValueError):
        raise TypeError(
            f"prompt_ids must be a sequence of token ids (ints), got {type(prompt_ids).__name__}"
        ) from None
    if seed == b"I" and ids.itemsize != 4:  # array's C types vary by platform; hashes must not
        ids, seed = array("q", ids), b"q"
    if n == 0:  # checked all the same: bad input raises however short (I8)
        return (), ""
    if sys.byteorder != "little":
        ids.byteswap()
    raw = memoryview(ids)
    depths = _grid(n)
    h = hashlib.blake2b(seed + block_size.to_bytes(8, "little"), digest_size=8, person=_PERSON)
    last, out = 0, []
    for d in depths:
        h.update(raw[last * block_size : d * block_size])
        out.append(h.digest())
        last = d
    return depths, b"".join(out).hex()


def _wide_ids(prompt_ids: Sequence[int]) -> array[int]:
    """Token ids outside [0, 2**32) as 64-bit ints; an id no 64-bit int holds (or one that is
    no int) is refused naming ``prompt_ids``, before anything is sent."""
    try:
        return array("q", prompt_ids)
    except OverflowError:
        raise ValueError(
            f"prompt_ids must hold token ids from {-(2**63)} to {2**63 - 1} (a tokenizer's ids "
            "are far smaller); got one outside that range"
        ) from None
    except (TypeError, ValueError):
        raise TypeError(
            f"prompt_ids must be a sequence of token ids (ints), got {type(prompt_ids).__name__}"
        ) from None


def chain_hashes(
    prompt_ids: Sequence[int], block_size: int, limit: int
) -> tuple[list[int], list[str]]:
    """The sampled depths of ``prompt_ids`` (full blocks, at most ``limit``) and the hash of
    the prompt up to each (16 hex characters): one hash names a whole prefix, so prompts that
    share a hash share everything before it. Stable across processes and machines."""
    depths, hexed = _prefix_hex(prompt_ids, block_size, limit)
    return list(depths), [hexed[k : k + HASH_CHARS] for k in range(0, len(hexed), HASH_CHARS)]


def _check_hashes(block_hashes: object) -> str:
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise TypeError("block_hashes must be a list of hashes from block_hashes()")
    if len(block_hashes) > MAX_BLOCKS_PER_CALL:
        raise ValueError(
            f"at most {MAX_BLOCKS_PER_CALL} block hashes per call, got {len(block_hashes)}; "
            "split the event"
        )
    for h in block_hashes:
        if not isinstance(h, str) or len(h) != HASH_CHARS or h.strip("0123456789abcdef"):
            raise ValueError(
                f"block hash {h!r} is not {HASH_CHARS} lowercase hex characters; make hashes "
                "with the router's block_hashes(token_ids)"
            )
    return "".join(block_hashes)


def _script(name: str) -> Script:
    return load_file(_HERE / f"{name}.lua")


class PrefixCache(RoutingPolicy):
    """The prefix-cache routing policy (see the module docstring); options: PrefixSettings."""

    name = "prefix_cache"
    script_path = _HERE / "prefix_cache.lua"
    acquire_fields = ("prompt_ids",)
    arity = 5
    locality_keys = ("pc:idx", "pc:lru", "pc:n")

    def __init__(self, **options: Any) -> None:
        # None means "not given" (a YAML key left empty, an explicit keyword set to None).
        self.settings = PrefixSettings(**{k: v for k, v in options.items() if v is not None})
        self._lua_settings = self.settings.lua()
        self.sticky_min_cached = self.settings.sticky_min_cached
        kbs = self.settings.kv_block_size
        self._exact = ExactChains(kbs) if kbs is not None else None

    def options(self) -> dict[str, Any]:
        return asdict(self.settings)

    def request_args(self, fields: Mapping[str, Any]) -> tuple[str, ...]:
        """(settings, prefix hashes, first counted depth, exact hashes, exact info):
        prefix_cache.lua's arguments. The last two are empty unless ``kv_block_size`` is set."""
        prompt_ids = fields.get("prompt_ids")
        if prompt_ids is None:
            return self._lua_settings, "", "1", "", ""
        s = self.settings
        depths, hexed = _prefix_hex(prompt_ids, s.block_size, s.max_prompt_blocks)
        first = _first_counted(depths[-1], s.min_match) if depths else "1"
        if self._exact is None:
            return self._lua_settings, hexed, first, "", ""
        bs = s.block_size
        marks = [
            (d * bs, hexed[k * HASH_CHARS : (k + 1) * HASH_CHARS]) for k, d in enumerate(depths)
        ]
        try:
            kn, kv = self._exact.hashes(prompt_ids, s.max_prompt_blocks * bs, marks)
        except ValueError:  # ids outside [0, 2**32): in no engine's cache; approximate only
            kn, kv = 0, []
        kfirst = _first_counted(kn, s.min_match) if kn else "1"
        ablocks = depths[-1] if depths else 0
        return self._lua_settings, hexed, first, "".join(kv), f"{kfirst} {kn} {ablocks}"

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[str]:
        """The approximate index's hashes of a prompt (what :meth:`record_blocks` takes for the
        tokens a replica holds): one per sampled depth, see :func:`sample_depths`."""
        s = self.settings
        return chain_hashes(prompt_ids, s.block_size, s.max_prompt_blocks)[1]


class _IndexOps:
    """Index maintenance both twins share; routing itself is the policy's."""

    _core: BalancerCore

    @property
    def prefix_policy(self) -> PrefixCache:
        policy = self._core.policy
        if not isinstance(policy, PrefixCache):
            raise TypeError(f"this router's policy is {policy.name!r}, not prefix_cache")
        return policy

    @property
    def settings(self) -> PrefixSettings:
        return self.prefix_policy.settings

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[str]:
        """See :meth:`PrefixCache.block_hashes`."""
        return self.prefix_policy.block_hashes(prompt_ids)

    def _blocks_op(self, mode: str, server_id: str, block_hashes: Sequence[str]) -> Op[int]:
        sid = validation.server_id(server_id)
        joined = _check_hashes(block_hashes)
        s = self.settings
        args = (mode, sid, joined, s.ttl_ms, s.max_index_blocks, INDEX_TRIM_BUDGET)
        return int((yield Call(_script("prefix_cache_record"), args)))

    def _clear_op(self) -> Op[int]:
        return int((yield Call(_script("prefix_cache_clear"), ())))


class PrefixCacheRouter(_IndexOps, RedisLoadBalancer):
    """A :class:`~redis_router.RedisLoadBalancer` with the :class:`PrefixCache` policy, and
    the approximate index's maintenance by hand (the exact index is written by
    ``redis-router kv-events``)."""

    default_policy = PrefixCache

    def record_blocks(self, server_id: str, block_hashes: Sequence[str]) -> int:
        """The replica now holds these blocks (the approximate index, fed by hand). Returns
        how many were recorded (0 if the replica is not in the pool)."""
        return self._run(self._blocks_op("record", server_id, block_hashes))

    def evict_blocks(self, server_id: str, block_hashes: Sequence[str]) -> int:
        """The replica dropped these blocks (the approximate index, fed by hand). Returns how
        many entries went."""
        return self._run(self._blocks_op("evict", server_id, block_hashes))

    def clear_index(self) -> int:
        """Forget every recorded block (leases and sessions stay). Returns how many."""
        return self._run(self._clear_op())

    def destroy(self) -> int:
        """Delete the index, then every key of the balancer. Returns how many keys went."""
        return self.clear_index() + super().destroy()

    def __repr__(self) -> str:
        return f"PrefixCacheRouter(name={self.name!r}, redis={self.url!r})"


class AsyncPrefixCacheRouter(_IndexOps, AsyncRedisLoadBalancer):
    """The asyncio twin of :class:`PrefixCacheRouter`: same options, scripts and keys."""

    default_policy = PrefixCache

    async def record_blocks(self, server_id: str, block_hashes: Sequence[str]) -> int:
        return await self._run(self._blocks_op("record", server_id, block_hashes))

    async def evict_blocks(self, server_id: str, block_hashes: Sequence[str]) -> int:
        return await self._run(self._blocks_op("evict", server_id, block_hashes))

    async def clear_index(self) -> int:
        return await self._run(self._clear_op())

    async def destroy(self) -> int:
        return await self.clear_index() + await super().destroy()

    def __repr__(self) -> str:
        return f"AsyncPrefixCacheRouter(name={self.name!r}, redis={self.url!r})"
