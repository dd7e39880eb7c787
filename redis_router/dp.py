"""Data-parallel ranks as routing units.

An engine run with data-parallel attention (vLLM ``--data-parallel-size N``, SGLang 0.5.23
``--attn-dp-size N``, formerly ``--dp-size N --enable-dp-attention``) serves one URL from N
ranks, each with its own KV cache. Routed to the server only, a session's turns land on any
rank and find their prefix cached one time in N. Both engines take the rank per request, so
the balancer routes to ranks instead:

* A replica registered with ``"dp_size": N`` in its metadata becomes N pool members, its
  *units*, ``"<replica id>#dp<k>"`` for k in 0..N-1, each with the replica's metadata plus
  ``"dp_rank": k``. Everything per member applies per rank: sticky sessions, the declared
  capacity (each rank gets the replica's), the prefix index, passive health, leases.
* Ids ending in ``#dp<digits>`` are reserved for units: registering one is refused.
* The admin calls (remove, drain, undrain) take the replica id and act on all its ranks (a
  unit id acts on that rank alone).
* A grant's handle is the unit's metadata, so it carries ``dp_rank``; :func:`vllm_headers` and
  :func:`sglang_fields` turn it into what each engine reads.

The names the engines read come from their source: vLLM 0.33 reads the header
``X-data-parallel-rank`` (``GenerateBaseServing._get_data_parallel_rank`` in
``vllm/entrypoints/generate/base/serving.py``, used by the chat, completion and generate
endpoints); SGLang 0.5.23 reads the body field ``routed_dp_rank`` (``PDRoutingFields`` in
``sglang/srt/entrypoints/openai/protocol.py`` and ``GenerateReqInput`` in
``sglang/srt/managers/io_struct.py``), and still accepts ``data_parallel_rank`` as a
deprecated alias.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "DP_RANK",
    "DP_SIZE",
    "MAX_DP_SIZE",
    "SGLANG_FIELD",
    "SGLANG_LEGACY_FIELD",
    "VLLM_HEADER",
    "expand",
    "members",
    "rank_body",
    "rank_of",
    "replica_of",
    "sglang_fields",
    "unit_id",
    "vllm_headers",
]

DP_SIZE = "dp_size"
DP_RANK = "dp_rank"
MAX_DP_SIZE = 1024
MARK = "#dp"
VLLM_HEADER = "X-data-parallel-rank"
SGLANG_FIELD = "routed_dp_rank"
SGLANG_LEGACY_FIELD = "data_parallel_rank"
_UNIT = re.compile(r"#dp(0|[1-9][0-9]*)\Z")


def unit_id(replica: str, rank: int) -> str:
    """The pool member that stands for rank ``rank`` of ``replica``."""
    return f"{replica}{MARK}{rank}"


def replica_of(server_id: str) -> tuple[str, int | None]:
    """(replica id, rank) of a pool member: a unit's replica and rank, else (id, None)."""
    m = _UNIT.search(server_id)
    if m is None or m.start() == 0:
        return server_id, None
    return server_id[: m.start()], int(m.group(1))


def dp_size(meta: Any, sid: str) -> int | None:
    """A replica's ``dp_size`` (None when its metadata has none), checked."""
    if not isinstance(meta, Mapping) or meta.get(DP_SIZE) is None:
        return None
    value = meta[DP_SIZE]
    arg = f"servers[{sid!r}]['{DP_SIZE}']"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{arg} must be an int (the engine's data-parallel size, 1 to {MAX_DP_SIZE}), "
            f"got {type(value).__name__}"
        )
    if not 1 <= value <= MAX_DP_SIZE:
        raise ValueError(f"{arg} must be from 1 to {MAX_DP_SIZE}, got {value}")
    if DP_RANK in meta:
        raise ValueError(
            f"servers[{sid!r}] has both '{DP_SIZE}' and '{DP_RANK}': register the replica with "
            f"'{DP_SIZE}' only; each rank gets its '{DP_RANK}'"
        )
    return value


def expand(
    servers: Mapping[str, Any], capacity: Mapping[str, int] | None
) -> tuple[dict[str, Any], Mapping[str, int] | None, dict[str, int]]:
    """Checked servers (and their capacities) with every data-parallel replica replaced by its
    units; also {replica id: dp_size}. A capacity given by replica id applies to each of its
    ranks, one given by a rank's id to that rank. Raises before anything is sent: an id that
    ends like a unit's, a bad dp_size."""
    out: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for sid, meta in servers.items():
        if replica_of(sid)[1] is not None:
            raise ValueError(
                f"server id {sid!r} ends in '{MARK}<k>', the form reserved for rank k of a "
                f"data-parallel replica; choose another id (or register the replica with "
                f"'{DP_SIZE}' in its metadata)"
            )
        size = dp_size(meta, sid)
        if size is None:
            out[sid] = meta
            continue
        sizes[sid] = size
        for k in range(size):
            out[unit_id(sid, k)] = {**meta, DP_RANK: k}
    if capacity is None or not sizes or not isinstance(capacity, Mapping):
        return out, capacity, sizes
    caps: dict[str, int] = {}
    for sid, cap in capacity.items():
        if sid in sizes:
            caps.update({unit_id(sid, k): cap for k in range(sizes[sid])})
    caps.update({sid: cap for sid, cap in capacity.items() if sid not in sizes})
    return out, caps, sizes


def members(ids: Iterable[str], pool: Iterable[str]) -> list[str]:
    """The pool members the admin ids name: an id in the pool names itself, and a replica id
    also names every unit of it in the pool. Ids that name nothing are kept (the scripts
    ignore them), so the caller's counts stay the scripts' own."""
    present = set(pool)
    by_replica: dict[str, list[str]] = {}
    for member in present:
        replica, rank = replica_of(member)
        if rank is not None:
            by_replica.setdefault(replica, []).append(member)
    out: list[str] = []
    for sid in ids:
        units = by_replica.get(sid, [])
        if not units or sid in present:
            out.append(sid)
        out += sorted(units, key=lambda u: replica_of(u)[1] or 0)
    return list(dict.fromkeys(out))


def stale(sizes: Mapping[str, int], plain: Iterable[str], pool: Iterable[str]) -> list[str]:
    """Pool members a registration replaces: ranks beyond a replica's new dp_size, the plain
    member of a replica now registered with ranks, and the ranks of one registered plain."""
    plain = set(plain)
    out = []
    for member in pool:
        replica, rank = replica_of(member)
        if rank is None:
            if member in sizes:
                out.append(member)
        elif (replica in sizes and rank >= sizes[replica]) or replica in plain:
            out.append(member)
    return sorted(out)


def rank_of(handle: Any) -> int | None:
    """The data-parallel rank a grant's handle names, or None (not a rank of a replica)."""
    if not isinstance(handle, Mapping):
        return None
    rank = handle.get(DP_RANK)
    if isinstance(rank, bool) or not isinstance(rank, int):
        return None
    return rank


def vllm_headers(handle: Any) -> dict[str, str]:
    """The request headers that send a request to the handle's rank on vLLM (empty when
    the handle names no rank)."""
    rank = rank_of(handle)
    return {} if rank is None else {VLLM_HEADER: str(rank)}


def sglang_fields(handle: Any, *, legacy: bool = False) -> dict[str, int]:
    """The request body fields that send a request to the handle's rank on SGLang (empty
    when the handle names no rank). ``legacy``: the older name ``data_parallel_rank``
    instead, for SGLang releases from before ``routed_dp_rank``."""
    rank = rank_of(handle)
    if rank is None:
        return {}
    return {SGLANG_LEGACY_FIELD if legacy else SGLANG_FIELD: rank}


def rank_body(handle: Any, body: Any) -> bytes | None:
    """A JSON request body sent to the handle's rank: ``body`` (the parsed request) with the
    SGLang field set to the rank, as bytes; None when the handle names no rank or the body is
    no JSON object (send it unchanged). vLLM ignores the field (it reads the header)."""
    rank = rank_of(handle)
    if rank is None or not isinstance(body, dict) or not body:
        return None
    return json.dumps({**body, SGLANG_FIELD: rank}, separators=(",", ":")).encode()


def grouped(replicas: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A status's units grouped under their replica: {replica id: {"dp_size", "units" (ids
    by rank), "inflight" (their sum), "draining" (every unit drains), "ejected_units",
    "full_units"}}; plain replicas are left out."""
    ranks: dict[str, dict[int, str]] = {}
    for sid, row in replicas.items():
        replica, rank = replica_of(sid)
        meta = row.get("metadata")
        if rank is not None and isinstance(meta, Mapping) and meta.get(DP_RANK) == rank:
            ranks.setdefault(replica, {})[rank] = sid
    out: dict[str, dict[str, Any]] = {}
    for replica, by_rank in sorted(ranks.items()):
        units = [by_rank[k] for k in sorted(by_rank)]
        rows = [replicas[u] for u in units]
        out[replica] = {
            "dp_size": rows[0]["metadata"].get(DP_SIZE),
            "units": units,
            "inflight": sum(int(r.get("inflight", 0)) for r in rows),
            "draining": all(r.get("draining") for r in rows),
            "ejected_units": [
                u for u, r in zip(units, rows, strict=True) if r.get("ejected_until")
            ],
            "full_units": [u for u, r in zip(units, rows, strict=True) if r.get("full")],
        }
    return out
