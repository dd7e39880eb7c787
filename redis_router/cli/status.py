"""`redis-router status`: the replicas, their load and sessions, and which are safe to remove."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any

from .. import dp
from ..errors import RedisUnavailable
from .common import Balancer, open_balancer, snapshot

COLUMNS = (
    ("REPLICA", None),
    ("STATE", None),
    ("IN-FLIGHT", "inflight"),
    ("LEASES", "live_leases"),
    ("SESSIONS", "sticky_sessions"),
    ("ACQUIRES", "acquires"),
    ("STICKY HITS", "sticky_hits"),
    ("RECLAIMED", "reclaimed"),
    ("RE-PINS", "repins"),
    ("CAPACITY", "capacity"),
    ("METADATA", None),
)
META_WIDTH = 40
CLEAR = "\033[H\033[2J"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "States: active (takes new sessions), full (holds its declared capacity: takes "
        "nothing until a request ends), failing (its last request or probe failed; it still "
        "takes new sessions unless ejection is on), ejected (failing: takes nothing until its "
        "ejection ends), draining (serves only its sticky sessions), "
        "drained (draining with nothing in flight: safe to remove). Leases of worker processes "
        "that died await reclaim: acquires and heartbeats take a few each, `redis-router reap` "
        "takes the rest. Reads only: nothing in Redis changes."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C"
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between redraws with --watch (default: 1)",
    )


def _meta(value: Any) -> str:
    if value is None:
        return ""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= META_WIDTH else text[: META_WIDTH - 3] + "..."


def _cli(snap: dict[str, Any]) -> str:
    """The command prefix that targets this balancer (for hints the user can paste)."""
    name = snap["balancer"]
    return "redis-router" + ("" if name == "default" else f" --name {shlex.quote(name)}")


def render(snap: dict[str, Any], *, clock: str | None = None) -> str:
    """The status table, its totals row and hints on what to do next."""
    ttl = snap["sticky_ttl"]
    pinned = "sticky_ttl not pinned yet" if ttl is None else f"sticky_ttl {ttl:g}s"
    head = f"balancer {snap['balancer']!r} at {snap['redis']} · {pinned}"
    lines = [head + (f" · {clock}" if clock else "")]
    rows = [[title for title, _ in COLUMNS]]
    groups = snap.get("dp_replicas") or {}
    for sid, r in snap["replicas"].items():
        replica, rank = dp.replica_of(sid)
        group = groups.get(replica) if rank is not None else None
        if group is not None and rank == dp.replica_of(group["units"][0])[1]:
            rows.append(_group_row(replica, group, snap["replicas"]))
        shown = ("-" if r.get(f) is None else str(r[f]) for _, f in COLUMNS[2:-1])
        meta = r["metadata"]
        if group is not None:  # a rank: its replica's row shows the rest
            sid, meta = "  " + sid, {dp.DP_RANK: rank}
        rows.append([sid, r["state"], *shown, _meta(meta)])
    t = snap["totals"]
    sums = ("" if f == "capacity" else str(t[f]) for _, f in COLUMNS[2:-1])
    rows.append(["TOTAL", f"{t['replicas']} replicas", *sums, ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        cells = [
            cell.rjust(w) if 2 <= i < len(COLUMNS) - 1 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append(
        f"{t['active']} active, "
        + (f"{t['failing']} failing, " if t["failing"] else "")
        + f"{t['full']} full, {t['ejected']} ejected, {t['draining']} draining, "
        f"{t['drained']} drained"
    )
    lines += shard_lines(snap)
    lines += health_lines(snap)
    lines += engine_lines(snap)
    lines += kv_index_lines(snap)
    lines += hints(snap)
    return "\n".join(lines)


def shard_lines(snap: dict[str, Any]) -> list[str]:
    """A sharded pool's shards: replicas, in flight, sessions, and what the directory last
    heard of each (the in-flight total it places new sessions by)."""
    return [
        f"shard {s['name']}: {s['servers']} replicas, {s['total_inflight']} in flight, "
        f"{s['sticky_sessions']} sessions; directory: {s['published_inflight']} in flight "
        f"as last published, {s['placed_since']} new sessions since"
        for s in snap.get("shards", ())
    ]


def _group_row(replica: str, group: dict[str, Any], rows: dict[str, Any]) -> list[str]:
    """A data-parallel replica's row, above its ranks': its ranks' sums and its metadata."""
    units = [rows[u] for u in group["units"]]
    sums = ("-" if f == "capacity" else str(sum(u[f] for u in units)) for _, f in COLUMNS[2:-1])
    meta = {k: v for k, v in units[0]["metadata"].items() if k != dp.DP_RANK}
    return [replica, f"{len(units)} ranks", *sums, _meta(meta)]


def with_kv_index(balancer: Balancer, snap: dict[str, Any]) -> dict[str, Any]:
    """Add each replica's exact-index state (``kv_index``) where its metadata names a
    KV-events publisher (docs/kv_events.md)."""
    from ..kv_events.state import index_states

    meta = {sid: r["metadata"] for sid, r in snap["replicas"].items()}
    for sid, state in index_states(balancer.client, balancer.name, meta).items():
        if state["state"] != "off":
            snap["replicas"][sid]["kv_index"] = state
    return snap


def health_lines(snap: dict[str, Any]) -> list[str]:
    """Ejections (why, until when), failure streaks, and the acquires waiting for a place."""
    out = []
    for sid, r in snap["replicas"].items():
        if r.get("ejected_until"):
            until = time.strftime("%H:%M:%S", time.localtime(r["ejected_until"]))
            out.append(
                f"ejected {sid} until {until} ({r['ejected_for']:.1f} s left, ejection "
                f"{r['ejections_in_a_row']} in a row): {r['ejected_why']}"
            )
        elif r.get("failures_in_a_row"):
            line = f"failing {sid}: {r['failures_in_a_row']} failures in a row"
            if r.get("last_error") is not None:  # none from before versions that keep it
                line += f", the last {r['last_error_age']:.1f} s ago: {r['last_error']}"
            out.append(line)
    if "ejection" in snap:
        out.append(f"ejection: {snap['ejection']}")
    scoring = snap.get("engine_scoring")
    if scoring:
        ceiling = scoring["kv_ceiling"]
        out.append(
            f"engine scoring: reports count for {scoring['ttl']:g} s, a full KV cache weighs "
            f"{scoring['kv_weight']:g} requests, "
            + (f"KV ceiling {ceiling:.0%}" if ceiling is not None else "no KV ceiling")
        )
    w = snap.get("waiting")
    if w and (w["now"] or w["served"] or w["timed_out"]):
        out.append(
            f"waiting for a place: {w['now']} now (first for {w['oldest_wait']:.1f} s); "
            f"{w['served']} served after waiting (mean {w['mean_wait'] * 1000:.0f} ms, max "
            f"{w['max_wait'] * 1000:.0f} ms), {w['timed_out']} gave up, {w['abandoned']} "
            "abandoned"
        )
    return out


def engine_lines(snap: dict[str, Any]) -> list[str]:
    """One line per replica whose engine reported its own load (redis-router load), with the
    report's age: an old one means no reporter reaches the replica."""
    out = []
    for sid, r in snap["replicas"].items():
        e = r.get("engine")
        if e:
            kv = "unknown" if e["kv_usage"] is None else f"{e['kv_usage']:.1%}"
            out.append(
                f"engine {sid}: running {e['running']}, waiting {e['waiting']}, KV cache {kv} "
                f"(reported {e['age_s']:.1f} s ago)"
            )
    return out


def kv_index_lines(snap: dict[str, Any]) -> list[str]:
    """One line per replica with a KV-events publisher: exact, or degraded and why."""
    out = []
    for sid, r in snap["replicas"].items():
        kv = r.get("kv_index")
        if kv:
            why = f" ({kv['reason']})" if kv["reason"] else ""
            out.append(f"kv index {sid}: {kv['state']}{why}, {kv['blocks']} blocks")
    return out


def hints(snap: dict[str, Any]) -> list[str]:
    cli, t, replicas = _cli(snap), snap["totals"], snap["replicas"]
    out = []
    if not replicas:
        out.append(f"no replicas: register one with `{cli} servers add ID --meta JSON`")
    elif t["active"] + t.get("failing", 0) == 0:
        out.append("no replica takes new sessions: new sessions fail until one is undrained")
    drained = [sid for sid, r in replicas.items() if r["state"] == "drained"]
    if drained:
        ids = " ".join(shlex.quote(s) for s in drained)
        out.append(f"safe to remove (drained, nothing in flight): `{cli} servers remove {ids}`")
    holders = snap.get("holders") or {}
    waiting, dead = holders.get("awaiting_reclaim", 0), holders.get("dead", 0)
    if waiting > 0:
        out.append(f"{waiting} lease(s) of {dead} dead process(es) await reclaim: `{cli} reap`")
    unheard = holders.get("unheard", 0)
    if unheard > 0:
        left = holders.get("probation_ms", 0) / 1000
        line = (
            f"{unheard} process(es) unheard for {holders.get('unheard_ms', 0) / 1000:.1f}s (they "
            f"exited, or Redis paused), holding {holders.get('unheard_leases', 0)} lease(s): on "
            "probation, "
        )
        if holders.get("probation_running"):
            line += f"reclaimed in {left:.1f}s unless heard again"
        else:  # no script that may reap has run since the gap: the next one starts it
            line += f"reclaimed {left:.1f}s after a worker or `{cli} reap --wait` next calls"
        out.append(line)
    return out


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval:g}")
    with open_balancer(args, pool_wide=True) as balancer:
        if not args.watch:
            snap = with_kv_index(balancer, snapshot(balancer))
            print(json.dumps(snap) if args.json else render(snap))
            return 0
        return _watch(balancer, args)


def _watch(balancer: Balancer, args: argparse.Namespace) -> int:
    """Redraw until Ctrl-C: in place on a terminal, else one frame (or JSON line) after another.
    A Redis outage is shown in the frame and retried; it does not end the watch."""
    tty = sys.stdout.isatty()
    try:
        while True:
            clock = time.strftime("%H:%M:%S")
            try:
                snap = with_kv_index(balancer, snapshot(balancer))
                frame = json.dumps(snap) if args.json else render(snap, clock=clock)
            except RedisUnavailable as exc:
                frame = json.dumps({"error": str(exc)}) if args.json else f"{clock} {exc}"
            if args.json:
                print(frame, flush=True)
            elif tty:
                print(CLEAR + frame + "\n\n(Ctrl-C to stop)", flush=True)
            else:
                print(frame + "\n", flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
