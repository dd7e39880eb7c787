"""``python -m benchmarks.pair_profile [--calls N] [--rounds R] [--server-bin PATH]``

Where the Redis time of one acquire + release pair goes, stage by stage. The acquire (a new
session, one request, the default policy) and the release (as ``Lease.release`` sends it: the
request id and its token) are each loaded as a series of Redis Functions libraries, one per
stage, each returning at once where the next stage would start; the last is the unchanged
script. Every variant runs ``calls`` times per round, rounds interleaved; the server's own
``INFO commandstats`` gives the time per call (the FCALL's, which includes the commands it
makes) and the Redis commands each stage adds. Printed per stage: the median over rounds of
the cumulative time, what the stage adds to the stage before, and its commands per call.

Then the bound: the Redis commands one pair makes (read from ``SLOWLOG`` at threshold 0 for
one acquire and its release) replayed by two Functions that make the same commands with the
same arguments and no other Lua (the *oracle*), against one no-op FCALL with one key, all in
the same rounds. A pair cannot cost less Redis time than the oracle while it makes those
commands, so ``oracle / no-op`` is the floor of ``pair / no-op`` for this key schema.

This checkout's scripts, by FCALL (Redis 7+ or Valkey): the cut points are lines of
``lua/lib/acquiring.lua`` and ``lua/release.lua``; one that is no longer there stops the run
and names the stage.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import statistics
import sys
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import redis

from redis_router import RedisLoadBalancer, scripts
from redis_router.local_server import LocalServer
from redis_router.scripts import Script

from .__main__ import _binary

REPLICAS = 8
# (stage, the line it starts at): a variant returns just before that line.
ACQUIRE = (
    ("the call: arguments, per-call state, policy table", "  local now = now_ms()\n  local cur"),
    ("clock and holder heartbeat", "  if cfg.spread then\n"),
    ("settings, admission check", "  if #ARGV == HEAD + stride then\n"),
    ("retry check (lease by token)", "  local old, ob\n"),
    ("sticky lookup, every live bucket", "  -- A sticky replica is counted where it is"),
    ("least-loaded pick and count", "  if cx.engine then redis.call('ZADD', P .. 'escore'"),
    ("lease records and request index", "  if not (ob == cur and old == id) then\n    if ob then"),
    ("sticky entry, session count", "  redis.call('HINCRBY', P .. 'acquires', id, '1')\n"),
    ("counters, replica metadata, reply", None),
)
RELEASE = (
    ("the call: arguments, per-call state", "local done, unowned = nil, nil\n"),
    ("lease lookup by token", "  local sid = end_lease(token, rec, toks, unowned)\n"),
    ("end_lease: record, index, holder, counts", "  if done then\n    done[#done + 1]"),
    ("resend record, health, reply", None),
)


def variants(script: Script, stages: tuple[tuple[str, str | None], ...]) -> list[Script]:
    """One library per stage, returning where the next stage starts (the last: unchanged)."""
    out = []
    for k, (stage, line) in enumerate(stages):
        shared, body = script.shared, script.body
        if line is not None:
            cut = "  do return 1 end\n" + line
            if line in shared:
                shared = shared.replace(line, cut, 1)
            elif line in body:
                body = body.replace(line, cut, 1)
            else:
                raise SystemExit(f"stage {stage!r}: its line is no longer in {script.name}.lua")
        source = f"{shared}\n{body}"
        sha = hashlib.sha1(source.encode()).hexdigest()
        out.append(
            replace(
                script,
                name=f"{script.name}_{k}",
                source=source,
                sha=sha,
                function="",
                shared=shared,
                body=body,
            )
        )
    return out


def recorded(r: redis.Redis, run: Callable[[], None]) -> list[list[str]]:
    """The Redis commands ``run``'s script calls make, in order (SLOWLOG at threshold 0)."""
    before = str(r.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"])
    r.config_set("slowlog-max-len", 1024)
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()
    try:
        run()
        entries = r.slowlog_get(1024)
    finally:
        r.config_set("slowlog-log-slower-than", before)
    out = []
    for e in reversed(entries):  # newest first
        words = e["command"].decode().split(" ")
        if words[0].upper() not in ("FCALL", "SLOWLOG", "CONFIG"):
            out.append(words)
    return out


def oracle(name: str, commands: list[list[str]], subs: dict[str, str]) -> str:
    """A Functions library whose one function makes ``commands`` and returns. The arguments
    are the recorded ones, but for the strings in ``subs`` (the request id and the token),
    taken from the call's ARGV (``subs`` names the ARGV index), so a series of calls makes
    the same keys and fields grow as the scripts' calls do."""
    calls = "\n".join(
        "redis.call(" + ", ".join(_lua_expr(w, subs) for w in words) + ")" for words in commands
    )
    return (
        f"#!lua name={name}\nredis.register_function{{function_name='{name}', "
        f"callback=function(keys, argv)\n{calls}\nreturn 1\nend}}\n"
    )


def _lua_expr(word: str, subs: dict[str, str]) -> str:
    """``word`` as a Lua expression: string literals, joined to ``argv[k]`` for each ``subs``
    string found in it."""
    pattern = "(" + "|".join(re.escape(s) for s in subs) + ")"
    parts = [
        f"argv[{subs[piece]}]" if piece in subs else _lua_string(piece)
        for piece in re.split(pattern, word)
        if piece
    ]
    return " .. ".join(parts) or "''"


def _lua_string(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


# The release of a lease by its token, as the library's makes it, written by hand in the
# fewest Lua lines (no procedures, no checks the token path does not need): what the library's
# structure costs over the strings its commands need. ARGV: replica, request id, token, op id.
MINIMAL_RELEASE = r"""#!lua name=minimal_release
redis.register_function{function_name='minimal_release', callback=function(keys, argv)
local P, id, token, op = keys[1], argv[1], argv[3], argv[4]
local rec = redis.call('HGET', P .. 'leases', token)
local a = string.find(rec, '\31', 1, true)
local b = string.find(rec, '\31', a + 1, true)
local field, holder = string.sub(rec, 1, b - 1), string.sub(rec, b + 1)
redis.call('HDEL', P .. 'leases', token)
if redis.call('HGET', P .. 'byreq', field) == token then redis.call('HDEL', P .. 'byreq', field) end
redis.call('ZREM', P .. 'owned:' .. holder, token)
redis.call('ZREM', P .. 'held:' .. id, token)
redis.call('ZADD', P .. 'escore', 'XX', 'INCR', '-1', id)
redis.call('ZADD', P .. 'load', 'XX', 'INCR', '-1', id)
local f, rest = string.sub(op, -3), string.sub(op, 1, -4)
local ids = redis.call('HGET', P .. 'remembered', f)
redis.call('HSET', P .. 'remembered', f, (ids or '\31') .. rest .. '\31')
return { token }
end}
"""

NOOP = (
    "#!lua name=noop\n"
    "redis.register_function{function_name='noop', callback=function(keys, argv) return 1 end}\n"
)


def _repeat(r: redis.Redis, fn: str, key: str, n: int) -> None:
    for _ in range(n):
        r.fcall(fn, 1, key)


def _replay(r: redis.Redis, fn: str, key: str, pairs: list[tuple[str, str]]) -> None:
    for rid, token in pairs:
        r.fcall(fn, 1, key, rid, token)


def timed(r: redis.Redis, run: Callable[[], None]) -> tuple[float, dict[str, float]]:
    """µs per FCALL and Redis commands per FCALL, of ``run``'s calls."""
    r.config_resetstat()
    run()
    stats = r.info("commandstats")
    fcall = stats["cmdstat_fcall"]
    calls = fcall["calls"]
    inner = {
        k.removeprefix("cmdstat_").upper(): v["calls"] / calls
        for k, v in stats.items()
        if k not in ("cmdstat_fcall", "cmdstat_config", "cmdstat_info")
    }
    return float(fcall["usec_per_call"]), inner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pair_profile", description=__doc__)
    ap.add_argument("--calls", type=int, default=2000, help="calls per variant and round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--server-bin", help="redis-server / valkey-server to start (7+)")
    args = ap.parse_args(argv)
    binary = _binary(args.server_bin)
    # As a default balancer composes it: every optional part left out (scripts.OPTIONAL).
    acquires = variants(scripts.load("acquire", frozenset(scripts.OPTIONAL)), ACQUIRE)
    releases = variants(scripts.load("release"), RELEASE)
    rng = random.Random(1)
    times: dict[str, list[float]] = {s.name: [] for s in acquires + releases}
    inner: dict[str, dict[str, float]] = {}
    with LocalServer(binary) as server:
        r = redis.Redis.from_url(server.url)
        try:
            r.function_list()
        except redis.ResponseError:
            raise SystemExit(
                f"{binary.label} has no Redis Functions: pass a 7+ or Valkey server"
            ) from None
        lb = RedisLoadBalancer({f"s{i}": f"http://h{i}" for i in range(REPLICAS)}, redis=server.url)
        lb.acquire("warm").release()
        core = lb._core
        head, prefix = core._acquire_head, core.prefix
        # Its holder stays alive by the acquires' own heartbeats; no keeper of this process
        # then repairs the counts that cut variants leave without a lease (the pick's).
        lb.close()
        for s in acquires + releases:
            r.function_load(s.library(), replace=True)
        full_acquire, full_release = acquires[-1], releases[-1]

        def acquire(fn: str, rid: str) -> tuple[str, str]:
            token = uuid.uuid4().hex
            got = r.fcall(fn, 1, prefix, *head, rid, token, rng.getrandbits(31), "")
            return (got[0].decode() if isinstance(got, list) else ""), token

        def release(fn: str, held: list[tuple[str, str, str]]) -> None:
            for sid, rid, token in held:
                r.fcall(fn, 1, prefix, sid, rid, token, uuid.uuid4().hex)

        # The bound: one pair's commands, recorded, and replayed without the scripts' Lua.
        # (After a few pairs: the holder is known and the sticky bucket has its expiry, as
        # for the pairs timed below.)
        for k in range(20):
            sid, token = acquire(full_acquire.function, f"warm{k}")
            release(full_release.function, [(sid, f"warm{k}", token)])
        got: dict[str, tuple[str, str]] = {}
        rid = "oracle-request-0"
        a_cmds = recorded(r, lambda: got.update(lease=acquire(full_acquire.function, rid)))
        sid, token = got["lease"]
        r_cmds = recorded(r, lambda: release(full_release.function, [(sid, rid, token)]))
        subs = {rid: "1", token: "2"}
        bound = {
            "noop": NOOP,
            "oracle_acquire": oracle("oracle_acquire", a_cmds, subs),
            "oracle_release": oracle("oracle_release", r_cmds, subs),
            "minimal_release": MINIMAL_RELEASE,
        }
        for lib in bound.values():
            r.function_load(lib, replace=True)
        for rnd in range(args.rounds):
            for s in acquires:  # new sessions: a request id never seen
                rids = [f"a{rnd}.{s.name}.{i}" for i in range(args.calls)]
                made: list[tuple[str, str, str]] = []

                def run(
                    fn: str = s.function, rids: list[str] = rids, made: list[Any] = made
                ) -> None:
                    for rid in rids:
                        sid, token = acquire(fn, rid)
                        if sid:
                            made.append((sid, rid, token))

                us, inner[s.name] = timed(r, run)
                times[s.name].append(us)
                release(full_release.function, made)
            for s in releases:
                held: list[tuple[str, str, str]] = []
                for i in range(args.calls):
                    rid = f"r{rnd}.{s.name}.{i}"
                    sid, token = acquire(full_acquire.function, rid)
                    held.append((sid, rid, token))
                us, inner[s.name] = timed(r, partial(release, s.function, held))
                times[s.name].append(us)
                release(full_release.function, held)  # what a cut variant left
            us, _ = timed(r, partial(_repeat, r, "noop", prefix, args.calls))
            times.setdefault("noop", []).append(us)
            pairs = [(f"o{rnd}.{i}", uuid.uuid4().hex) for i in range(args.calls)]
            for name in ("oracle_acquire", "oracle_release"):
                us, _ = timed(r, partial(_replay, r, name, prefix, pairs))
                times.setdefault(name, []).append(us)
            held = []
            for i in range(args.calls):
                sid, token = acquire(full_acquire.function, f"m{rnd}.{i}")
                held.append((sid, f"m{rnd}.{i}", token))
            us, _ = timed(r, partial(release, "minimal_release", held))
            times.setdefault("minimal_release", []).append(us)
    print(
        f"{binary.label}; {args.calls} calls per variant, {args.rounds} interleaved rounds, "
        "medians; µs of Redis time per call (INFO commandstats)"
    )
    width = 2 + max(len(stage) for stage, _ in ACQUIRE + RELEASE)
    print(f"{'stage':{width}s} {'cumul.':>8s} {'adds':>7s}  commands the stage adds, per call")
    for label, vs, stages in (("acquire", acquires, ACQUIRE), ("release", releases, RELEASE)):
        prev, seen = 0.0, dict[str, float]()
        print(label)
        for s, (stage, _) in zip(vs, stages, strict=True):
            m = statistics.median(times[s.name])
            cmds = inner[s.name]
            added = {
                c: n - seen.get(c, 0.0) for c, n in cmds.items() if n - seen.get(c, 0.0) > 0.05
            }
            seen = cmds
            what = ", ".join(
                f"{c}" if abs(n - 1) < 0.05 else f"{c} x{n:.1f}" for c, n in added.items()
            )
            print(f"  {stage:{width - 2}s} {m:8.1f} {m - prev:+7.1f}  {what}")
            prev = m
    noop = statistics.median(times["noop"])
    pair = statistics.median(
        a + b for a, b in zip(times[acquires[-1].name], times[releases[-1].name], strict=True)
    )
    floor = statistics.median(
        a + b for a, b in zip(times["oracle_acquire"], times["oracle_release"], strict=True)
    )
    print(
        f"\nthe bound ({len(a_cmds)} + {len(r_cmds)} commands a pair: "
        f"{' '.join(w[0].upper() for w in a_cmds)} | {' '.join(w[0].upper() for w in r_cmds)})"
    )
    print(f"  {'no-op FCALL, one key':{width - 2}s} {noop:8.1f}")
    for what, us in (("the pair", pair), ("its commands alone (oracle)", floor)):
        print(f"  {what:{width - 2}s} {us:8.1f}  {us / noop:5.1f}x the no-op")
    lua = "the scripts' Lua beyond their commands"
    print(f"  {lua:{width - 2}s} {pair - floor:8.1f}")
    for label, script in (("acquire", acquires[-1]), ("release", releases[-1])):
        mine, bare = (
            statistics.median(times[script.name]),
            statistics.median(times[f"oracle_{label}"]),
        )
        what = f"  of which the {label}"
        print(f"  {what:{width - 2}s} {mine - bare:8.1f}  ({mine:.1f} against {bare:.1f})")
    hand = statistics.median(times["minimal_release"])
    what = "the release written by hand, fewest Lua lines"
    library = statistics.median(times[releases[-1].name])
    print(f"  {what:{width - 2}s} {hand:8.1f}  (the library's: {library:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
