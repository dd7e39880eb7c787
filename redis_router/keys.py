"""Every Redis key a balancer uses, named once.

The scripts build key names from the balancer's prefix ``P = "rr:{NAME}:"`` and a suffix
(``P .. 'load'``). This table is the one list of those suffixes: the key schema in
docs/design.md and the list of keys ``destroy`` deletes (lua/destroy.lua) are generated from
it (``python -m redis_router.keys --write``), and a test fails when a script names a key that
is not here, or when an entry here is named by no script.

A family of keys (one per replica, holder, time bucket, ...) is written with its variable part
in angle brackets: ``held:<id>``; scripts name it by the part before the bracket.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# How destroy() ends a key: "list" (deleted by name, the generated list in lua/destroy.lua),
# "pool" (one per replica: destroy walks load, draining and off), "holders" (one per holder:
# it walks holders), "waiters" (one per waiting ticket), "buckets" (one per sticky time bucket
# it searches back), "plugin" (the owning policy's clear script runs before it), "stream"
# (the KV-event index's keys: dropped with the streams, kv_index_drop.lua).
Ends = Literal["list", "pool", "holders", "waiters", "buckets", "plugin", "stream"]


@dataclass(frozen=True)
class Key:
    """One key, or one family of keys, under a balancer's prefix."""

    name: str  # the suffix after P; a family's variable part in <angle brackets>
    type: str  # the Redis type: hash, zset, set, string, list
    holds: str  # what it holds (Markdown, one line)
    ends: Ends = "list"
    # Who uses it: the core scripts, a plugin policy, or only clients of an earlier version
    # (still read so that a rolling upgrade finds their data, and deleted by destroy).
    part: Literal["core", "prefix_cache", "kv_events", "earlier"] = "core"

    @property
    def family(self) -> bool:
        return "<" in self.name

    @property
    def stem(self) -> str:
        """What a script concatenates to P: the whole name, or a family's fixed part."""
        return self.name.split("<", 1)[0]


SEP = "␟"  # U+001F, as the docs show it

REGISTRY: tuple[Key, ...] = (
    # -- the pool -----------------------------------------------------------------------
    Key(
        "servers",
        "hash",
        "replica id → JSON metadata (the pool); every reader (health, load, serve, status) "
        'takes a plain URL string for `{"url": it}` (`validation.metadata`)',
    ),
    Key("load", "zset", "replica id → in-flight count, replicas taking new sessions"),
    Key("draining", "zset", "replica id → in-flight count, replicas serving only sticky sessions"),
    Key(
        "off",
        "zset",
        "replica id → in-flight count, replicas full or ejected: no acquire looks here (I10)",
    ),
    Key("back", "hash", "replica in `off` → `load` or `draining`, where it returns"),
    Key("capacity", "hash", "replica → requests it can hold (declared; absent = no limit)"),
    # -- leases and holders ---------------------------------------------------------------
    Key("held:<id>", "zset", "lease token → acquired at: the leases on one replica", "pool"),
    Key(
        "leases",
        "hash",
        f"token → `id{SEP}request id{SEP}holder[{SEP}weight]`",
    ),
    Key("byreq", "hash", f"`id{SEP}request id` → its lease tokens, space separated"),
    Key("holders", "zset", "holder → deadline (last heartbeat + its `lease_ttl`)"),
    Key(
        "owned:<holder>",
        "zset",
        "token → acquired (or renewed) at: the leases of one holder",
        "holders",
    ),
    Key(
        "clock",
        "hash",
        "`heard` (when Redis last ran a heartbeat), `since` and `till` (a pause's start and "
        "its probation's end), `short`/`long` (the lease ttls in use) with when each was last "
        "seen, `remembered` (when the current generation of remembered releases began)",
    ),
    Key("heal", "hash", "`servers`, `byreq`: the cursors of the repair pass (`heal.lua`)"),
    Key(
        "remembered",
        "hash",
        "operation ids of releases a resent copy must recognise, packed: an id's last three "
        "characters → `␟` then the rest of each id, each followed by `␟`; `@` → when a "
        "heartbeat began the generation; rotated every 30 s, expiring 60 s after its start "
        "(a `close()` gives a generation no heartbeat began 60 s)",
    ),
    Key(
        "remembered:old",
        "hash",
        "the generation of `remembered` before the current one, expiring 30 s after the rotation",
    ),
    # -- sessions -----------------------------------------------------------------------
    Key(
        "sticky:<b>",
        "hash",
        "request id → replica, sessions last seen in time bucket b (expires)",
        "buckets",
    ),
    Key("stickyn:<b>", "hash", "replica → sessions in bucket b (expires with it)", "buckets"),
    Key(
        "pinned",
        "hash",
        "replica → live sticky sessions naming it; `@` → the oldest bucket counted "
        "(only with `spread_sessions`; I13)",
    ),
    Key(
        "group:<b>",
        "hash",
        f"group id → `replica{SEP}members placed there in a row`, groups last joined in "
        "time bucket b (expires)",
        "buckets",
    ),
    Key(
        "repins",
        "hash",
        "replica → sticky sessions the affinity margin moved off it, or that left it because "
        "it no longer held their prompt (`sticky_min_cached`)",
    ),
    Key(
        "weighted",
        "zset",
        "replica → sum of its leases' weights (policies that weigh requests)",
    ),
    Key("locality", "set", "locality keys policies declared, dropped by `bump_weight_version`"),
    Key("weight_version", "string", "weight version bumps so far"),
    Key(
        "config",
        "hash",
        "the settings every process must share, pinned by the first acquire "
        "(`redis_router.core.PINNED_SETTINGS`)",
    ),
    # -- counters -----------------------------------------------------------------------
    Key("acquires", "hash", "replica → acquires (counter)"),
    Key("sticky_hits", "hash", "replica → acquires that followed a sticky entry (counter)"),
    Key("reclaimed", "hash", "replica → leases of dead holders reclaimed (counter)"),
    # -- health -------------------------------------------------------------------------
    Key("ejected", "zset", "replica → ejected until (ms)"),
    Key("eject_why", "hash", "replica → why it was ejected"),
    Key(
        "fails",
        "hash",
        "replica → failures in a row, ejection on or off: on, a success deletes it (it exists "
        "only while a streak does); off, it holds only while the replica's mark (`P "
        "last_error`) is the one its last failure recorded, so a success ends it without a "
        "write",
    ),
    Key(
        "last_error",
        "hash",
        f"replica → `at_ms{SEP}mark{SEP}reason`: its last failure (a request: `request "
        "failed`; a probe: `health check: ...`; at most 200 bytes, user info of URLs hidden) "
        "and the mark then: its leases that had ended other than by a reclaim (`acquires − "
        "ZCARD held − reclaimed`; 0 with ejection on, where a success deletes the streak)",
    ),
    Key("ejections", "hash", "replica → ejections in a row; `replica␟t` → when the last one ends"),
    Key("failures", "hash", "replica → failed requests and probes reported (counter)"),
    # -- waiting acquires ---------------------------------------------------------------
    Key("waiters", "zset", "waiting ticket → arrival number (FIFO)"),
    Key("waiting", "hash", f"ticket → `holder{SEP}give-up time{SEP}arrived at`"),
    Key(
        "wake:<ticket>",
        "list",
        "pushed to wake the waiter that blocks on it (BLPOP); expires",
        "waiters",
    ),
    Key("waitseq", "string", "arrival counter of waiting acquires"),
    Key("waitstats", "hash", "served, waited_ms, max_ms, timed_out, abandoned"),
    # -- engine-reported load -----------------------------------------------------------
    Key(
        "engine",
        "hash",
        "replica → `at_ms running waiting kv_permille leases_at`: its engine's last report",
    ),
    Key("engine_at", "zset", "replica → at_ms of its engine report: the oldest in O(log N)"),
    Key(
        "escore",
        "zset",
        "replica → count + extra: what engine-aware least loaded ranks (while `engine_scoring` "
        "is pinned)",
    ),
    Key("eextra", "hash", "replica → what its engine report adds to its count"),
    Key("wscore", "zset", "replica → tokens in flight + extra in tokens (`least_tokens`)"),
    Key("wextra", "hash", "replica → what its engine report adds, in tokens (`least_tokens`)"),
    # -- the prefix_cache policy's index (plugins/prefix_cache_index.lua) ------------------
    Key(
        "pc:idx", "hash", "block hash → its holders, `id␟us␟` per replica", "plugin", "prefix_cache"
    ),
    Key("pc:lru", "zset", "write → when it was made (µs)", "plugin", "prefix_cache"),
    Key("pc:n", "string", "block hashes the writes in `pc:lru` name", "plugin", "prefix_cache"),
    # -- the exact KV-event index (plugins/kv_index_lib.lua) ------------------------------
    Key("kv:idx", "hash", "router block hash → the replicas holding it", "stream", "kv_events"),
    Key(
        "kv:exact",
        "hash",
        "replica → deadline while every stream of it is exact",
        "stream",
        "kv_events",
    ),
    Key("kv:stream", "hash", "`RANK:ID` → the stream's state", "stream", "kv_events"),
    Key("kv:epochs", "string", "counter of stream resets", "stream", "kv_events"),
    Key(
        "kv:map:<rank>:<id>",
        "hash",
        "engine block hash → router block hash, one map per stream",
        "stream",
        "kv_events",
    ),
    Key("kv:trash", "list", "`EPOCH:RANK:ID` of maps a reset set aside", "stream", "kv_events"),
    Key(
        "kv:trash:<epoch>:<rank>:<id>",
        "hash",
        "a map set aside by a reset, dropped a share per call",
        "stream",
        "kv_events",
    ),
    # -- a sharded pool's directory (its keys under the pool's own name) -----------------
    Key(
        "layout",
        "hash",
        "`shards` → the shard count, `names` → the shards' balancer names (JSON list), `gen` "
        "→ when the sessions' records last rotated (D2)",
    ),
    Key("homes", "hash", "replica id → `shard capacity`: the shard it is registered on"),
    Key(
        "shards",
        "hash",
        "`n:<s>` replicas, `cap:<s>` their capacity, `in:<s>` in-flight as last published, "
        "`new:<s>` sessions placed since, `at:<s>` when that total was claimed (D1)",
    ),
    Key(
        "placed",
        "hash",
        "session or group id → its shard: looked up since the generation began (`layout`'s "
        "`gen`; D2)",
    ),
    Key(
        "placed:old",
        "hash",
        "the generation before `placed`, dropped at the next rotation (one sticky ttl)",
    ),
    # -- kept by earlier versions; read during an upgrade, deleted by destroy -------------
    Key("released", "set", "remembered releases of earlier clients", part="earlier"),
    Key("released:old", "set", "the generation before `released`", part="earlier"),
    Key("ended", "hash", "remembered releases of still earlier clients", part="earlier"),
    Key("ended:old", "hash", "the generation before `ended`", part="earlier"),
    Key("weights", "hash", "request weights of earlier clients", part="earlier"),
)

BY_NAME = {k.name: k for k in REGISTRY}

ROOT = Path(__file__).resolve().parent
SCRIPT_DIRS = (ROOT / "lua", ROOT / "plugins")
# A key named in Lua: P .. 'suffix' or P.."suffix".
_NAMED = re.compile(r"\bP\s*\.\.\s*(['\"])([^'\"]*)\1")


def lookup(suffix: str) -> Key | None:
    """The registry entry a script's literal suffix names: a key's whole name, or a family's
    fixed part (``held:``)."""
    key = BY_NAME.get(suffix)
    if key is not None and not key.family:
        return key
    return next((k for k in REGISTRY if k.family and suffix == k.stem), None)


def _code(lua: str) -> str:
    """Lua source without its comments (a ``--`` outside a string literal to the line's end)."""
    out = []
    for line in lua.splitlines():
        quote = None
        for i, ch in enumerate(line):
            if quote:
                if ch == quote:
                    quote = None
            elif ch in "'\"":
                quote = ch
            elif line.startswith("--", i):
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


def named_in_scripts() -> dict[str, set[str]]:
    """Each literal key suffix the Lua scripts name (comments aside) → the files naming it."""
    found: dict[str, set[str]] = {}
    for directory in SCRIPT_DIRS:
        for path in sorted(directory.rglob("*.lua")):
            for m in _NAMED.finditer(_code(path.read_text())):
                rel = path.relative_to(directory.parent).as_posix()
                found.setdefault(m.group(2), set()).add(rel)
    return found


def scripts_naming(key: Key, named: dict[str, set[str]]) -> list[str]:
    return sorted({s for suffix, files in named.items() if lookup(suffix) == key for s in files})


# -- generated text ------------------------------------------------------------------------

SCHEMA_BEGIN = "<!-- key schema: generated by python -m redis_router.keys --write -->"
SCHEMA_END = "<!-- end of key schema -->"
DESTROY_BEGIN = "-- generated by python -m redis_router.keys --write: the keys deleted by name"
DESTROY_END = "-- end of generated list"

_ENDS_TEXT = {
    "list": "destroy",
    "pool": "destroy (per replica)",
    "holders": "destroy (per holder)",
    "waiters": "destroy (per waiter)",
    "buckets": "destroy (per bucket); expires",
    "plugin": "destroy (the policy's clear)",
    "stream": "the index's drop",
}


def schema_markdown() -> str:
    """The key schema table of docs/design.md."""
    named = named_in_scripts()
    rows = [
        "| key | type | content | named in | ended by |",
        "|---|---|---|---|---|",
    ]
    for k in REGISTRY:
        scripts = ", ".join(
            f"`{Path(s).stem}`" for s in scripts_naming(k, named) if "/lib/" not in s
        )
        libs = ", ".join(f"`lib/{Path(s).stem}`" for s in scripts_naming(k, named) if "/lib/" in s)
        where = ", ".join(p for p in (scripts, libs) if p) or "(none: earlier versions)"
        rows.append(f"| `P {k.name}` | {k.type} | {k.holds} | {where} | {_ENDS_TEXT[k.ends]} |")
    return "\n".join(rows) + "\n"


def destroy_lua() -> str:
    """The list of keys lua/destroy.lua deletes by name."""
    names = [k.name for k in REGISTRY if k.ends == "list"]
    lines, line = [], "local NAMED = {"
    for name in names:
        piece = f" '{name}',"
        if len(line) + len(piece) > 96:
            lines.append(line)
            line = " "
        line += piece
    lines.append(line.rstrip(",") + " }")
    return "\n".join(lines) + "\n"


def _splice(text: str, begin: str, end: str, body: str, where: str) -> str:
    try:
        head, rest = text.split(begin + "\n", 1)
        _, tail = rest.split(end, 1)
    except ValueError:
        raise SystemExit(f"{where}: markers {begin!r} ... {end!r} not found") from None
    return f"{head}{begin}\n{body}{end}{tail}"


TARGETS = {
    "docs/design.md": (SCHEMA_BEGIN, SCHEMA_END, schema_markdown),
    "lua/destroy.lua": (DESTROY_BEGIN, DESTROY_END, destroy_lua),
}


def drift(root: Path) -> list[str]:
    """The generated files (relative to a checkout's root) that differ from this table."""
    stale = []
    for rel, (begin, end, make) in TARGETS.items():
        path = root / rel
        text = path.read_text()
        if _splice(text, begin, end, make(), rel) != text:
            stale.append(rel)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m redis_router.keys",
        description="Print the key registry, or rewrite what is generated from it.",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="rewrite docs/design.md's schema and destroy.lua's list",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 naming each generated file that differs"
    )
    args = parser.parse_args(argv)
    root = ROOT.parent
    if args.write:
        for rel, (begin, end, make) in TARGETS.items():
            path = root / rel
            path.write_text(_splice(path.read_text(), begin, end, make(), rel))
        return 0
    if args.check:
        stale = drift(root)
        for rel in stale:
            print(
                f"{rel}: differs from redis_router/keys.py; run python -m redis_router.keys --write"
            )
        return 1 if stale else 0
    sys.stdout.write(schema_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
