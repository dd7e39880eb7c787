"""Redis Functions (FCALL) where the server has them, EVALSHA where it has not.

Every script of the library and of plugins/ loads as a function; the server picks the path
(Redis 6.2: EVALSHA, by itself); two versions of a script load side by side; flushes of the
script cache and of the function libraries, in a loop from another connection while sync and
asyncio workers run, or timed to fall between every reload and its resend, never reach a
caller; and the FCALL and EVALSHA paths give the same replies and leave the same keys.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from redis_router import (
    AsyncRedisLoadBalancer,
    NoCapacity,
    NoServersAvailable,
    RedisLoadBalancer,
    RedisOutOfMemory,
    RedisUnavailable,
    core,
    scripts,
)
from redis_router.invoke import ENV, Sender, configured_mode, loaded_functions
from redis_router.local_server import LocalServer

from . import invariants

ROOT = Path(__file__).resolve().parent.parent
SERVERS = {f"s{i}": f"http://10.0.0.{i}:8000" for i in range(4)}


def has_functions(r: redis.Redis) -> bool:
    """Redis 7+ and Valkey have FUNCTION; 6.2 answers "unknown command"."""
    try:
        r.function_list()
    except redis.ResponseError as exc:
        assert "unknown command" in str(exc).lower(), exc
        return False
    return True


def plugin_scripts() -> list[scripts.Script]:
    """Every script in plugins/ (the files with a "-- Uses" line; the rest are their parts)."""
    found = []
    for path in sorted((ROOT / "plugins").glob("*.lua")):
        if "\n-- Uses " in "\n" + path.read_text():
            found.append(scripts.load_file(path))
    return found


def stats(r: redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


# -- loading -------------------------------------------------------------------------------


def composed_acquires() -> list[scripts.Script]:
    """Every acquire script (the core's and the plugins') as a balancer composes it, for each
    set of optional parts its settings can leave out."""
    kinds = [frozenset(), *(frozenset({p}) for p in scripts.OPTIONAL), frozenset(scripts.OPTIONAL)]
    paths = [scripts.lua_dir() / "acquire.lua"]
    paths += [ROOT / "plugins" / f"{n}.lua" for n in ("least_tokens", "prefix_cache")]
    return [scripts.load_file(p, k) for p in paths for k in kinds if k]


def test_every_script_of_the_library_and_of_plugins_loads_as_a_function(r):
    every = [*scripts.all_scripts().values(), *plugin_scripts(), *composed_acquires()]
    assert {s.name for s in plugin_scripts()} >= {"least_tokens", "prefix_cache"}
    if not has_functions(r):  # Redis 6.2: the sender goes by EVALSHA without asking again
        sender = Sender(r)
        assert sender.send(scripts.load("counts"), "rr:{x}:", ()) == []
        assert sender.mode == "evalsha"
        return
    r.function_flush()  # FLUSHALL between tests keeps functions: load each here, anew
    for script in every:  # compiles here: Lua's 200 locals and 60 upvalues hold
        assert r.function_load(script.library()) == script.function
    listed = {}
    for lib in r.function_list(library="rr_*"):
        lib = lib if isinstance(lib, dict) else dict(zip(lib[::2], lib[1::2], strict=True))
        (fn,) = lib["functions"]
        fn = fn if isinstance(fn, dict) else dict(zip(fn[::2], fn[1::2], strict=True))
        assert fn["name"] == lib["library_name"]
        listed[fn["name"]] = set(fn["flags"])
    assert listed == {
        s.function: {"no-writes"} if s.read_only else {"allow-oom"} if s.allow_oom else set()
        for s in every
    }
    read_only = {s.name for s in every if s.read_only}
    assert read_only == {"configure", "counts", "owned", "owner", "status"}


def test_a_balancer_sends_no_code_for_an_option_its_settings_leave_off(make_lb, r):
    """The acquire script is composed per configuration: engine scoring's part and the
    spread_sessions tie-break are in a balancer's script only while it pins them on, and each
    variant routes (its own library, or script by EVALSHA)."""
    marks = {"lib/scoring": "local function scoring()", "lib/pinning": "local function pinning()"}
    options: dict[str, dict[str, Any]] = {
        "default": {},
        "engine": {"engine_scoring": True},
        "spread": {"spread_sessions": True},
        "both": {"engine_scoring": True, "spread_sessions": True},
        "deterministic": {"spread_sessions": True, "full_determinism": True},  # spread is off
    }
    wanted = {
        "default": set(),
        "engine": {"lib/scoring"},
        "spread": {"lib/pinning"},
        "both": {"lib/scoring", "lib/pinning"},
        "deterministic": set(),
    }
    sent = set()
    for name, kw in options.items():
        lb = make_lb(SERVERS, name=f"composed-{name}", **kw)
        script = lb._core._acquire
        assert {p for p, mark in marks.items() if mark in script.source} == wanted[name], name
        assert script.source.count("local function acquire_all(") == 1
        for i in range(6):
            lb.acquire(f"{name}-{i}").release()
        sent.add(script.function)
    assert len(sent) == 4  # one script per set of parts (deterministic: the default's)
    assert sent == {s.function for s in scripts.compositions("acquire")}  # every form it has
    # A part a script names itself stays: engine_report reads scores whatever is left out.
    assert (
        scripts.load("engine_report", frozenset(scripts.OPTIONAL)).source.count(
            marks["lib/scoring"]
        )
        == 1
    )
    assert scripts.load("acquire").source.count("local function pinning()") == 1  # whole
    with pytest.raises(ValueError, match=r"leave_out: \['lib/base'\] are not optional"):
        scripts.load("acquire", frozenset({"lib/base"}))


def test_read_only_scripts_go_by_fcall_ro_and_could_not_write(make_lb, r):
    lb = make_lb(SERVERS)
    lb.acquire_server("warm")
    r.config_resetstat()
    lb.get_status(), lb.request_owner("warm"), lb.get_inflight_count("s0")
    if not has_functions(r):
        assert stats(r, "evalsha") >= 3 and stats(r, "fcall_ro") == 0  # NOSCRIPT ones too
        return
    assert stats(r, "fcall_ro") >= 3 and stats(r, "fcall") == stats(r, "evalsha") == 0
    # no-writes is the server's promise, not ours: a write in such a function is refused
    bad = scripts.from_source(
        "writes_anyway",
        "-- Keeps    read only.\n-- Uses lib/base\nreturn redis.call('SET', P .. 'x', 1)",
    )
    assert bad.read_only
    with pytest.raises(redis.ResponseError, match=r"(?i)write commands are not allowed"):
        Sender(r).send(bad, invariants.prefix("ro"), ())


def test_the_server_chooses_the_path_and_the_environment_can_force_evalsha(server, r, monkeypatch):
    functions = has_functions(r)
    lb = RedisLoadBalancer(SERVERS, redis=server.url, name="auto")
    assert lb._scripts.mode == ("fcall" if functions else "evalsha")  # probed by the first call
    lb.close()
    monkeypatch.setenv(ENV, "eval")
    r.config_resetstat()
    with RedisLoadBalancer(SERVERS, redis=server.url, name="forced") as forced:
        forced.acquire("x").release()
        assert forced._scripts.mode == "evalsha"
    assert stats(r, "evalsha") > 0 and stats(r, "fcall") == stats(r, "fcall_ro") == 0
    monkeypatch.setenv(ENV, "Function")
    assert configured_mode() == "function"
    assert Sender(r).mode == "fcall"  # not probed: FCALL from the first call ...
    with RedisLoadBalancer(SERVERS, redis=server.url, name="by-hand") as by_hand:
        by_hand.acquire("y").release()
        assert by_hand._scripts.mode == ("fcall" if functions else "evalsha")  # ... but 6.2
    assert scripts.Script("x-y", "return 1", "ab" * 20).function == "rr_x_y_" + "ab" * 8
    monkeypatch.setenv(ENV, "lua")
    with pytest.raises(ValueError, match=f"{ENV}='lua': expected auto, function or eval"):
        RedisLoadBalancer(SERVERS, redis=server.url, name="bad-mode")


def test_the_shared_parts_are_defined_once_and_their_state_set_on_every_call():
    """A library defines the lib/ parts at load: marked state is declared there and assigned
    on entry, in order; unmarked state is refused, whichever script would carry it."""
    declared, resets = scripts.hoist(
        "local P = KEYS[1] -- per call\nlocal LIMIT = 9\nlocal A, B = {}, P .. 'x' -- per call\n"
        "local function f() return A end"
    )
    assert declared.splitlines() == [
        "local P",
        "local LIMIT = 9",
        "local A, B",
        "local function f() return A end",
    ]
    assert resets == ["P = KEYS[1]", "A, B = {}, P .. 'x'"]
    for state in (
        "local CACHE = {}",
        "local N = nil -- a count",
        "local F = string.format",
        "local T = {} -- once per library",  # only a nil, filled with procedures on first use
    ):
        with pytest.raises(ValueError, match="must be marked '-- per call'"):
            scripts.hoist(state)
    kept = "local PROCS = nil -- once per library: procedures"
    assert scripts.hoist(kept) == (kept, [])
    acquire = scripts.load("acquire")
    library = acquire.library()
    assert acquire.shared and "local function acquire_all" in library.split("register_function")[0]
    assert "rr_enter_call(keys, argv)" in library and acquire.function != scripts.function_name(
        "acquire", acquire.sha
    )  # a library of the other shape is another version
    # A plugin's own parts stay in the call, as under EVALSHA: only lib/ ones are shared.
    prefix = next(s for s in plugin_scripts() if s.name == "prefix_cache")
    assert prefix.body.startswith("-- prefix_cache_index.lua") and "-- lib/" not in prefix.body
    assert "-- lib/acquiring.lua" in prefix.shared


def test_two_versions_of_a_script_load_side_by_side(r):
    if not has_functions(r):
        pytest.skip("Redis 6.2 has no Functions (EVALSHA scripts are addressed by hash anyway)")
    text = (scripts.lua_dir() / "counts.lua").read_text()
    old, new = scripts.load("counts"), scripts.from_source("counts", text + "\n-- next version")
    assert old.function != new.function and old.function.startswith("rr_counts_")
    lb = invariants.prefix("sbs")
    r.hset(lb + "servers", "a", "{}")
    r.zadd(lb + "load", {"a": 2})
    a, b = Sender(r), Sender(r)
    assert a.send(old, lb, ("a",)) == b.send(new, lb, ("a",)) == ["a", "2"]
    assert {old.function, new.function} <= loaded_functions(r)
    assert a.send(old, lb, ("a",)) == ["a", "2"]  # the new one replaced nothing


# -- flushes never reach callers -------------------------------------------------------------


class FlushingClient(redis.Redis):
    """A real client that, right after each FUNCTION LOAD or SCRIPT LOAD it sends, flushes the
    server's functions and scripts from another connection: the worst moment, every time."""

    flusher: redis.Redis

    def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = super().execute_command(*args, **options)
        if args[0] in ("FUNCTION LOAD", "SCRIPT LOAD"):
            if args[0] == "FUNCTION LOAD":
                self.flusher.function_flush()
            self.flusher.script_flush()
        return reply


def test_a_flush_after_every_reload_still_never_reaches_the_caller(server, r):
    client = FlushingClient(port=server.port, decode_responses=True)
    client.flusher = r
    r.script_flush()  # FLUSHALL (between tests) keeps both: start from neither
    if has_functions(r):
        r.function_flush()
    with RedisLoadBalancer(SERVERS, redis=client, name="flushed") as lb:
        r.config_resetstat()
        lease = lb.acquire("r1")  # every reload is flushed: only the last attempt's EVAL runs
        assert lease.release()
        assert stats(r, "eval") == 2
        assert invariants.check(r, "flushed") == dict.fromkeys(SERVERS, 0)
    client.close()


def _flush_forever(url: str, stop: threading.Event, flushes: list[int]) -> None:
    c = redis.Redis.from_url(url)
    functions = has_functions(c)
    while not stop.is_set():
        c.script_flush()
        if functions:
            c.function_flush()
        flushes[0] += 1
        time.sleep(0.001)
    c.close()


def test_flushes_in_a_loop_while_sync_and_asyncio_workers_run(server, r):
    """SCRIPT FLUSH and FUNCTION FLUSH in a loop for 3 s: no error reaches a caller, and once
    every worker is done no lease is left counted."""
    name, duration = "storm", 3.0
    stop, flushes = threading.Event(), [0]
    errors: list[BaseException] = []
    done = [0]
    deadline = time.monotonic() + duration

    def sync_worker(lb: RedisLoadBalancer, k: int) -> None:
        rng = random.Random(k)
        try:
            while time.monotonic() < deadline:
                with lb.lease(f"t{k}-{rng.randrange(20)}"):
                    pass
                rid = f"u{k}-{rng.randrange(20)}"
                sid, _ = lb.acquire_server(rid)
                assert lb.release_server(sid, rid)
                lb.get_status()
                done[0] += 1
        except BaseException as exc:
            errors.append(exc)

    async def async_workers() -> None:
        async with AsyncRedisLoadBalancer(redis=server.url, name=name) as alb:

            async def one(k: int) -> None:
                while time.monotonic() < deadline:
                    async with alb.lease(f"a{k}-{k % 7}"):
                        await asyncio.sleep(0)
                    grants = await alb.acquire_many([f"m{k}", f"n{k}"])
                    for (sid, _), rid in zip(grants, (f"m{k}", f"n{k}"), strict=True):
                        await alb.release_server(sid, rid)
                    done[0] += 1

            results = await asyncio.gather(*(one(k) for k in range(4)), return_exceptions=True)
            errors.extend(e for e in results if isinstance(e, BaseException))

    r.config_resetstat()
    lbs = [
        RedisLoadBalancer(SERVERS if k == 0 else None, redis=server.url, name=name)
        for k in range(2)
    ]
    flusher = threading.Thread(target=_flush_forever, args=(server.url, stop, flushes))
    threads = [threading.Thread(target=sync_worker, args=(lbs[k % 2], k)) for k in range(3)]
    flusher.start()
    for t in threads:
        t.start()
    try:
        asyncio.run(async_workers())
    finally:
        for t in threads:
            t.join(timeout=60)
        stop.set()
        flusher.join(timeout=60)
    reloads = stats(r, "function|load") + stats(r, "script|load") + stats(r, "eval")
    try:
        assert not errors, f"{len(errors)} errors reached callers, first: {errors[0]!r}"
        assert done[0] > 20 and flushes[0] > 20, (done, flushes)
        assert reloads > 10, "the flushes never made a worker reload: the test proves nothing"
        assert invariants.check(r, name) == dict.fromkeys(SERVERS, 0)  # counts == live leases
    finally:
        for lb in lbs:
            lb.close()


# -- FCALL and EVALSHA agree ---------------------------------------------------------------


def _dump(r: redis.Redis, name: str, holder: str) -> dict[str, Any]:
    """Every key of a balancer, normalised: the holder id as "H", time buckets merged,
    clock-valued scores left out."""
    p = invariants.prefix(name)

    def norm(text: str) -> str:
        return text.replace(holder, "H")

    out: dict[str, Any] = {}
    for key in sorted(r.keys(p + "*")):
        family = norm(key[len(p) :])
        kind = r.type(key)
        if family.split(":")[0] in ("sticky", "stickyn", "group"):
            family = family.split(":")[0] + ":*"
        if kind == "zset":
            rows = r.zrange(key, 0, -1, withscores=True)
            timed = family.split(":")[0] in ("held", "owned", "holders", "ejected", "waiters")
            value: Any = sorted(norm(m) if timed else (norm(m), s) for m, s in rows)
        elif kind == "hash":
            fields = r.hgetall(key)
            if family in ("waitstats", "waiting"):
                value = len(fields)
            elif family == "clock":  # times Redis heard heartbeats: their fields only
                value = sorted(fields)
            elif family == "last_error":  # at_ms SEP mark SEP why: all but the time
                value = {k: v.partition(invariants.SEP)[2] for k, v in fields.items()}
            else:
                clock = ("@", invariants.SEP + "t")  # a generation's start, an ejection's end
                value = {
                    norm(k): norm(v)
                    for k, v in fields.items()
                    if not (k.startswith(clock[0]) or k.endswith(clock[1]))
                }
        elif kind == "string":
            value = r.get(key)
        else:
            value = kind
        if family in out and isinstance(value, dict):
            out[family].update(value)
        else:
            out[family] = value
    return out


def _outcome(call: Any) -> Any:
    try:
        return call()
    except (NoCapacity, NoServersAvailable) as exc:
        return type(exc).__name__


def test_procedures_made_once_per_library_act_on_each_callers_keys(server, r, monkeypatch):
    """Capacity, ejection and engine scoring make their procedures once per Functions library
    and reuse them in every later call, whichever balancer makes it: each balancer's calls
    must still read and write its own keys, never those of the balancer that made them."""
    if not has_functions(r):
        pytest.skip("Redis 6.2 has no Functions: every call makes its procedures")
    monkeypatch.setenv(ENV, "auto")
    names = [f"once-{k}-{random.randrange(1 << 30):x}" for k in range(2)]
    lbs = [
        RedisLoadBalancer(
            {"full": {"capacity": 1}, "spare": None},
            redis=server.url,
            name=name,
            eject_after=1,
            engine_scoring=True,
            wait_timeout=0,
        )
        for name in names
    ]
    try:
        for lb in lbs:  # each in turn: fill "full", eject "spare", then nothing is left
            held = [lb.acquire(f"{lb.name}-{k}") for k in range(2)]
            assert sorted(x.server_id for x in held) == ["full", "spare"]
            held[[x.server_id for x in held].index("spare")].fail().result()
            with pytest.raises(NoCapacity):
                lb.acquire(f"{lb.name}-more")
            p = f"rr:{{{lb.name}}}:"
            assert set(r.zrange(p + "off", 0, -1)) == {"full", "spare"}
            assert r.zrange(p + "ejected", 0, -1) == ["spare"]
            assert set(r.zrange(p + "escore", 0, -1)) == {"full", "spare"}
            invariants.check(r, lb.name)
        for lb in lbs:
            lb.destroy()
        assert not list(r.scan_iter(match="rr:{once-*"))
    finally:
        for lb in lbs:
            lb.close()


def test_spread_procedures_made_once_per_library_read_each_callers_pins(server, r, monkeypatch):
    """spread_sessions' tie-break is made once per Functions library too: each balancer must
    count its own pinned sessions, whichever balancer's call made it."""
    if not has_functions(r):
        pytest.skip("Redis 6.2 has no Functions: every call makes its procedures")
    monkeypatch.setenv(ENV, "auto")
    tag = f"{random.randrange(1 << 30):x}"
    pool = {"r1": None, "r2": None}
    a, b = (
        RedisLoadBalancer(pool, redis=server.url, name=f"pins-{k}-{tag}", spread_sessions=True)
        for k in "ab"
    )
    try:
        # a pins four sessions on r1, b four on r2 (the other replica drained meanwhile).
        for lb, full, other in ((a, "r1", "r2"), (b, "r2", "r1")):
            lb.drain_servers([other])
            for k in range(4):
                lease = lb.acquire(f"{lb.name}-old{k}")
                assert lease.server_id == full
                lease.release().result()
            lb.undrain_servers([other])
        # Counts tie (every lease released): each new session goes where its own balancer
        # pins fewest, so a's go to r2 and b's to r1, turn after turn.
        for turn in range(2):
            for lb, emptier in ((a, "r2"), (b, "r1")):
                for k in range(2):
                    lease = lb.acquire(f"{lb.name}-new{turn}-{k}")
                    assert lease.server_id == emptier
                    lease.release().result()
    finally:
        for lb in (a, b):
            lb.destroy()
            lb.close()


@pytest.mark.parametrize("seed", range(4))
def test_fcall_and_evalsha_give_identical_results_on_random_sequences(server, r, monkeypatch, seed):
    if not has_functions(r):
        pytest.skip("Redis 6.2 has no Functions: nothing to compare EVALSHA with")
    # Odd seeds turn on the options whose state lives in other parts of the shared Lua
    # (defined once per Functions library, set again on each call): a call must not see the
    # last one's.
    options: dict[str, Any] = {"eject_after": 2, "lease_ttl": 600.0, "affinity_margin": 2}
    if seed % 2:
        options = {"lease_ttl": 600.0, "spread_sessions": True, "engine_scoring": True}
        options |= {"affinity_ratio": 1.5, "group_cap": 2}
    pool = {**SERVERS, "cap": {"capacity": 2}}
    # Lease tokens and release ids are entropy, as the tie-break is: made in the same order on
    # both sides, each side's n-th one is the same.
    made = [0, 0]
    side = [0]

    def tokens(n: int) -> list[str]:
        made[side[0]] += n
        return [f"d{k:015x}" for k in range(made[side[0]] - n, made[side[0]])]

    monkeypatch.setattr(core, "new_tokens", tokens)
    monkeypatch.setattr(core, "new_token", lambda: tokens(1)[0])
    monkeypatch.setattr(core, "new_operations", tokens)
    monkeypatch.setattr(core, "new_operation", lambda: tokens(1)[0])
    monkeypatch.setenv(ENV, "eval")
    by_eval = RedisLoadBalancer(
        pool, redis=server.url, name=f"ev{seed}", rng=random.Random(seed), **options
    )
    monkeypatch.setenv(ENV, "auto")
    by_fcall = RedisLoadBalancer(
        pool, redis=server.url, name=f"fc{seed}", rng=random.Random(seed), **options
    )
    lbs = (by_eval, by_fcall)
    leases: tuple[list[Any], list[Any]] = ([], [])
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(12)]

    def step(i: int, lb: RedisLoadBalancer, op: str, arg: Any) -> Any:
        held, side[0] = leases[i], i
        if op == "acquire":
            lease = lb.acquire(arg, token=f"tok{len(held)}x{arg}")
            held.append(lease)
            return (lease.server_id, lease.handle, lease.sticky)
        if op == "many":
            grants = lb.acquire_many(arg)
            return grants
        if op == "release" and held:
            return held.pop(arg % len(held)).release().result()
        if op == "fail" and held:
            return held.pop(arg % len(held)).fail().result()
        if op == "release_by_id":
            return lb.release_server(f"s{arg % 4}", ids[arg % len(ids)]).result()
        if op == "drain":
            return lb.drain_servers([arg])
        if op == "undrain":
            return lb.undrain_servers([arg])
        if op == "remove":
            return lb.remove_servers([arg])
        if op == "add":
            return lb.add_servers({arg: None})
        if op == "owner":
            return lb.request_owner(ids[arg % len(ids)])
        if op == "renew" and held:
            return held[arg % len(held)].renew()
        if op == "clear":
            return lb.clear_sticky_cache()
        if op == "bump":
            return lb.bump_weight_version(sticky=bool(arg % 2))
        if op == "reap":
            return lb.reap()
        if op == "status":
            st = lb.get_status()
            return st["servers"], st["active_servers"], st["draining_servers"]
        return None

    ops = ["acquire"] * 4 + ["many", "many", "release", "release", "fail", "release_by_id"]
    ops += ["drain", "undrain", "remove", "add", "owner", "status", "renew", "clear", "bump"]
    ops += ["reap"]
    try:
        for _ in range(80):
            op = rng.choice(ops)
            if op in ("drain", "undrain", "remove", "add"):
                arg: Any = rng.choice(["s1", "s2", "s3", "cap"])
            elif op == "acquire":
                arg = rng.choice(ids)
            elif op == "many":
                arg = rng.sample(ids, rng.randint(2, 5))
            else:
                arg = rng.randrange(64)
            replies = [
                _outcome(lambda lb=lb, i=i, op=op, arg=arg: step(i, lb, op, arg))
                for i, lb in enumerate(lbs)
            ]
            assert replies[0] == replies[1], (op, arg, replies)
        dumps = [_dump(r, lb._core.name, lb._core.holder) for lb in lbs]
        assert dumps[0] == dumps[1]
        assert by_eval._scripts.mode == "evalsha" and by_fcall._scripts.mode == "fcall"
        assert invariants.check(r, f"ev{seed}") == invariants.check(r, f"fc{seed}")
    finally:
        for lb in lbs:
            lb.close()


# -- Cluster -------------------------------------------------------------------------------


def test_functions_load_on_every_master_of_a_cluster_and_again_after_a_flush(binary):
    from .servers import LocalCluster

    def load(name: str) -> scripts.Script:  # as a default balancer composes it
        return scripts.load(name, frozenset(scripts.OPTIONAL))

    with LocalCluster(binary, masters=3) as cluster:
        nodes = [n.client(decode_responses=True) for n in cluster.nodes]
        functions = has_functions(nodes[0])
        names = [f"n{i}" for i in range(6)]  # spread over the slots of all three masters

        def run_all() -> None:
            for name in names:
                with RedisLoadBalancer(SERVERS, redis=cluster.url, name=name) as lb:
                    with lb.lease("x") as lease:
                        assert lease.server_id in SERVERS
                    assert lb._scripts.mode == ("fcall" if functions else "evalsha")

            async def main() -> None:
                async with AsyncRedisLoadBalancer(redis=cluster.url, name=names[0]) as alb:
                    async with alb.lease("y"):
                        pass
                    assert alb._scripts.mode == ("fcall" if functions else "evalsha")

            asyncio.run(main())

        for node in nodes:
            node.config_resetstat()
        run_all()
        # each call went straight to its slot's node: none asked a node for FCALL's keys first
        assert sum(stats(node, "command|getkeys") for node in nodes) == 0
        if functions:
            wanted = {load(n).function for n in ("acquire", "release", "add_servers")}
            for node in nodes:  # every master has them, not only those serving a balancer
                assert wanted <= loaded_functions(node), node
        for node in nodes:
            node.script_flush()
            if functions:
                node.function_flush()
        run_all()  # loaded again where they are gone
        if functions:
            for node in nodes:
                assert load("acquire").function in loaded_functions(node)
        for node in nodes:
            node.close()


def test_a_server_started_anew_without_its_functions_is_loaded_again(binary):
    """A restart (no persistence) loses the functions: the first call reloads them."""
    srv = LocalServer(binary).start()
    try:
        with RedisLoadBalancer(SERVERS, redis=srv.url, name="restart") as lb:
            lb.acquire("a").release()
            srv.restart()
            lb.add_servers(SERVERS)
            with lb.lease("b") as lease:
                assert lease.server_id in SERVERS
    finally:
        srv.close()


def test_over_maxmemory_releases_still_end_leases_and_acquires_are_refused(make_lb, r):
    """noeviction over maxmemory: a function without allow-oom would be refused outright, and
    FUNCTION LOAD is; a release (loaded or not) ends its lease on every path, as by EVALSHA."""
    lb = make_lb(SERVERS)
    loaded, unloaded = lb.acquire("loaded"), lb.acquire("unloaded")
    assert loaded.release()  # the release function (or script) is loaded now
    loaded = lb.acquire("loaded")
    if has_functions(r):
        r.function_flush()
    r.script_flush()
    lb.release_server(lb.acquire_server("warm")[0], "warm")  # release loaded again
    lb._run(lb._core.heartbeat())  # and the heartbeat
    policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(RedisOutOfMemory, match="out of memory"):
            lb.acquire("refused")
        assert loaded.release()  # a loaded function: allow-oom lets it run
        if has_functions(r):  # a live holder's heartbeat too (EVALSHA refuses it: its first
            lb._run(lb._core.heartbeat())  # write may add memory), so live leases stay alive
        r.script_flush()
        if has_functions(r):
            r.function_flush()
        assert unloaded.release()  # FUNCTION LOAD refused: sent with EVAL, which runs
    finally:
        r.config_set("maxmemory", 0)
        r.config_set("maxmemory-policy", policy)
    assert invariants.check(r, lb._core.name) == dict.fromkeys(SERVERS, 0)


def test_read_only_calls_run_on_a_replica_that_cannot_load_their_function(server, r):
    """`status` and friends on a replica (the command line pointed at one): FCALL_RO runs
    there; a function missing on it cannot be loaded (READONLY), so the call goes by EVAL."""
    from redis_router.cli.common import Balancer

    with RedisLoadBalancer(SERVERS, redis=server.url, name="replicated") as lb:
        lease = lb.acquire("r1")
        replica = LocalServer(server.binary, args=["--replicaof", server.host, str(server.port)])
        replica.start()
        try:
            rc = replica.client(decode_responses=True)
            deadline = time.monotonic() + 30
            while rc.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica never synced"
                time.sleep(0.05)
            while (
                rc.zscore(invariants.prefix("replicated") + "held:" + lease.server_id, lease.token)
                is None
            ):
                assert time.monotonic() < deadline, "the lease never reached the replica"
                time.sleep(0.05)
            if has_functions(r):
                r.function_flush()  # replicated: the replica has none either
            on_replica = Balancer(rc, "replicated", replica.url)
            status = on_replica.status()
            assert status["servers"][lease.server_id] == 1 and status["total_inflight"] == 1
            assert on_replica.status()["total_inflight"] == 1  # again, by the same path
            if has_functions(r):
                assert stats(rc, "eval") >= 2 and stats(rc, "fcall_ro") >= 2
            rc.close()
        finally:
            replica.close()
        assert lease.release()


def test_after_a_sentinel_failover_calls_go_on_with_the_functions_replicated(binary):
    """FUNCTION LOAD replicates: the promoted replica runs the functions without a reload,
    and a worker's calls go on by the same path, with no error reaching it."""
    from .servers import LocalSentinelGroup

    with (
        LocalSentinelGroup(binary, service_name="rr-fn", sentinels=3) as group,
        RedisLoadBalancer(SERVERS, redis=group.url, name="fo") as lb,
    ):
        with lb.lease("before"):
            pass
        path = lb._scripts.mode
        with group.master.client() as c:
            assert c.execute_command("WAIT", 1, 5000) == 1
        group.failover()
        with group.master.client() as c:  # the new master
            c.config_resetstat()
            deadline = time.monotonic() + 30
            while True:  # a call may meet the demoted master until its connections drop
                try:
                    with lb.lease("after") as lease:
                        assert lease.server_id in SERVERS
                    break
                except RedisUnavailable:
                    assert time.monotonic() < deadline, "no call succeeded after the failover"
                    time.sleep(0.2)
            assert lb._scripts.mode == path
            if path == "fcall":
                assert stats(c, "fcall") >= 2 and stats(c, "function|load") == 0
            assert lb.get_status()["total_inflight"] == 0
