"""Least privilege: a Redis ACL user that can run only the library's scripts on its own keys.

The rule below is the one docs/operations.md documents. Redis checks every command a script
runs against the caller's ACL, keys included, so the user needs the scripts' own commands and
nothing else; it cannot read or write keys outside ``rr:{NAME}:*``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from redis_router import EngineLoad, RedisLoadBalancer
from redis_router.scripts import lua_dir

# Refusals differ by version: NOPERM (7.x, Valkey) or "can't run this command" (6.2, and 7.0
# inside a script), so match any of them.
REFUSED = r"(?i)noperm|permission|can't run|acl failure"


def script_commands() -> set[str]:
    """Every command the library's Lua scripts call, read from lua/*.lua: literal
    ``redis.call('CMD', ...)`` plus lib.lua's ``flat_call('CMD', ...)``, which calls its
    ``cmd`` argument. Any other call by variable fails here, to be checked by hand."""
    called: set[str] = set()
    for path in Path(lua_dir()).rglob("*.lua"):
        text = path.read_text()
        by_variable = set(re.findall(r"redis\.p?call\(\s*([^'\s,]+)", text)) - {"cmd"}
        assert not by_variable, f"{path.name} calls {by_variable}: check its ACL by hand"
        literal = re.findall(r"(?:redis\.p?call|flat_call)\(\s*'(\w+)'", text)
        called |= {c.lower() for c in literal}
    return called


def acl_rule(name: str, password: str) -> list[str]:
    """The documented ACL rule: EVALSHA, SCRIPT LOAD (after NOSCRIPT), PING, and the scripts'
    own commands, on the balancer's key pattern only."""
    commands = " ".join(f"+{c}" for c in sorted(script_commands()))
    rule = f"on >{password} resetkeys ~rr:{{{name}}}:* resetchannels -@all"
    return f"{rule} +evalsha +script|load +ping {commands}".split()


def test_the_documented_acl_lists_every_command_the_scripts_call() -> None:
    docs = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"\+(\w+)", docs.split("ACL SETUSER", 1)[1].split("```")[0]))
    assert script_commands() <= documented, "update the ACL rule in docs/operations.md"


def test_library_works_under_the_acl_user_and_cannot_touch_other_keys(
    server, r: redis.Redis
) -> None:
    r.execute_command("ACL", "SETUSER", "router", *acl_rule("jobs", "pw"))
    r.set("rr:{billing}:servers", "precious")
    url = f"redis://router:pw@127.0.0.1:{server.port}/0"
    r.script_flush()  # the first call must load the scripts itself, as after a restart
    with RedisLoadBalancer(
        {"a": None, "b": None}, redis=url, name="jobs", spread_sessions=True
    ) as lb:
        lease = lb.acquire("r1")  # a tie: the pinned sessions are counted (HGETALL)
        lb.acquire_many(["r2", "r3"])
        assert lb.end_session("r3") == 1
        lb.drain_servers(["a"])
        lb.undrain_servers(["a"])
        assert lb.get_status()["total_inflight"] == 3
        assert lease.renew() and lease.release()
        lb.clear_sticky_cache()
        lb.reap()
        assert lb.report_engine_load({"b": EngineLoad(1, 0, 0.5)}) == 1
        lb.remove_servers(["b"])
        assert lb.get_all_servers() == ["a"]
        assert lb.destroy() > 0
    with pytest.raises(redis.ResponseError, match=REFUSED):
        RedisLoadBalancer({"a": None}, redis=url, name="billing")  # another balancer's keys
    user = redis.Redis.from_url(url, decode_responses=True)
    for attempt in (
        lambda: user.get("rr:{billing}:servers"),
        lambda: user.hset("rr:{billing}:servers", "x", "1"),
        lambda: user.flushall(),
        lambda: user.keys("*"),
        lambda: user.eval("return redis.call('GET', 'rr:{billing}:servers')", 0),
    ):
        with pytest.raises(redis.ResponseError, match=REFUSED):
            attempt()
    user.close()
    assert r.keys("*") == ["rr:{billing}:servers"] and r.get("rr:{billing}:servers") == "precious"


def test_the_rule_with_functions_appended_runs_the_library_by_fcall(server, r: redis.Redis) -> None:
    """The documented rule selects EVALSHA by itself (FCALL refused), as does a rule that lets
    the user call functions but not load them; with `+fcall +fcall_ro +function|load` appended
    (Redis 7+ and Valkey) the same user goes by Functions."""
    try:
        r.function_list()
    except redis.ResponseError:
        pytest.skip("Redis 6.2 has no Functions: the documented rule alone applies")
    calls = ["+fcall", "+fcall_ro"]
    users = {
        "plain": (acl_rule("jobs", "pw"), "jobs", "evalsha"),
        "callonly": ([*acl_rule("co", "pw"), *calls], "co", "evalsha"),
        "functions": ([*acl_rule("fn", "pw"), *calls, "+function|load"], "fn", "fcall"),
    }
    r.function_flush()
    for user, (rule, name, path) in users.items():  # in this order: only the last may load
        r.execute_command("ACL", "SETUSER", user, *rule)
        url = f"redis://{user}:pw@127.0.0.1:{server.port}/0"
        with RedisLoadBalancer({"a": None, "b": None}, redis=url, name=name) as lb:
            with lb.lease("r1") as lease:
                assert lease.server_id in {"a", "b"}
            assert lb.get_status()["total_inflight"] == 0
            assert lb._scripts.mode == path, user
