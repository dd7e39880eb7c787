"""Each replica's exact-index state, as `redis-router status` and the exporter show it.

Reads only (two HGETALLs), and needs neither msgspec nor pyzmq, so status works without the
``kv-events`` extra. States: ``exact``; ``degraded`` with a reason (``never connected``, ``no
subscriber``, ``publisher unreachable``, ``gap not replayable``, ``history not replayable``,
``over capacity``, ``dropping old entries``); ``off`` when the metadata names no publisher.
"""

from __future__ import annotations

from typing import Any

from .endpoints import streams_of

__all__ = ["REASONS", "index_states"]

STATUS_REASONS = {
    "gap": "gap not replayable",
    "history": "history not replayable",
    "full": "over capacity",
}
REASONS = (
    "never connected",
    "no subscriber",
    "publisher unreachable",
    *STATUS_REASONS.values(),
    "dropping old entries",
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _stream_reason(raw: str | None, now_ms: int) -> tuple[str | None, int]:
    """(why the stream is not exact, or None; blocks it maps)."""
    if raw is None:
        return "never connected", 0
    _seq, _ts, _epoch, blocks, trash, _seen, link, status = raw.split(" ")
    if status in STATUS_REASONS:
        return STATUS_REASONS[status], int(blocks)
    if link != "1":
        return "publisher unreachable", int(blocks)
    if int(trash) > 0:
        return "dropping old entries", int(blocks)
    return None, int(blocks)


def index_states(client: Any, name: str, metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per replica (of ``metadata``: id -> metadata) with a publisher: ``state`` (exact |
    degraded), ``reason`` (None when exact), ``blocks`` mapped, over its dp ranks."""
    prefix = f"rr:{{{name}}}:"
    streams = {_text(k): _text(v) for k, v in client.hgetall(prefix + "kv:stream").items()}
    exact = {_text(k): int(_text(v)) for k, v in client.hgetall(prefix + "kv:exact").items()}
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    out: dict[str, dict[str, Any]] = {}
    for sid, meta in metadata.items():
        try:
            ranks = streams_of(sid, meta)
        except ValueError:
            out[sid] = {"state": "degraded", "reason": "bad kv_events metadata", "blocks": 0}
            continue
        if not ranks:
            out[sid] = {"state": "off", "reason": None, "blocks": 0}
            continue
        reasons, blocks = [], 0
        for s in ranks:
            why, n = _stream_reason(streams.get(f"{s.rank}:{sid}"), now_ms)
            blocks += n
            if why:
                reasons.append(why)
        if not reasons and exact.get(sid, 0) < now_ms:
            reasons.append("no subscriber")
        out[sid] = {
            "state": "degraded" if reasons else "exact",
            "reason": reasons[0] if reasons else None,
            "blocks": blocks,
        }
    return out
