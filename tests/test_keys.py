"""The key registry (redis_router/keys.py) is the one list of a balancer's keys: every key a
script or the library names is in it, what is generated from it is current, and destroy()
leaves nothing of a balancer that used every core feature."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from redis_router import keys
from redis_router.engine import EngineLoad

ROOT = Path(__file__).resolve().parent.parent


def test_every_key_a_script_names_is_in_the_registry() -> None:
    named = keys.named_in_scripts()
    assert named, "the scan found no key: the pattern no longer matches the scripts"
    unknown = {suffix: sorted(files) for suffix, files in named.items() if not keys.lookup(suffix)}
    assert unknown == {}, "add these keys to redis_router/keys.py"


def test_every_registered_key_is_named_by_a_script() -> None:
    named = keys.named_in_scripts()
    unused = [
        k.name for k in keys.REGISTRY if k.part != "earlier" and not keys.scripts_naming(k, named)
    ]
    assert unused == []


# Keys the Python side names: prefix + "suffix", f"{prefix}suffix", f"rr:{{{name}}}:suffix".
_PY_KEY = re.compile(
    r"""prefix\s*\+\s*["']([a-z_:]+)["']|\{(?:self\.|core\.)?prefix\}([a-z_:]+)|rr:\{\{\{\w+\}\}\}:([a-z_:]+)"""
)


def test_every_key_the_python_code_names_is_in_the_registry() -> None:
    found: dict[str, str] = {}
    for path in sorted((ROOT / "redis_router").rglob("*.py")):
        for m in _PY_KEY.finditer(path.read_text()):
            suffix = next(g for g in m.groups() if g)
            found[suffix] = str(path.relative_to(ROOT))
    assert {"config", "servers", "kv:stream", "wake:"} <= set(found), found
    assert {s: f for s, f in found.items() if not keys.lookup(s)} == {}


def test_generated_schema_and_destroy_list_are_current() -> None:
    assert keys.drift(ROOT) == [], "run: python -m redis_router.keys --write"


def test_the_pinned_settings_are_listed_once_and_pinned_by_name(make_lb: Any, r: Any) -> None:
    """The scripts take a balancer's settings as one map by name (core.config): its pinned
    part is core.PINNED_SETTINGS, which no script lists again, and the first acquire pins
    exactly those fields, with the values the process sent."""
    from redis_router.core import PINNED_SETTINGS

    lua = Path(keys.__file__).parent / "lua"
    for script in (*lua.glob("*.lua"), *lua.glob("lib/*.lua")):
        text = script.read_text()
        assert "'sticky_min_cached'" not in text and "'affinity_margin'" not in text, script
    lb = make_lb(servers={"a": "http://a"}, affinity_margin=2, group_cap=3, eject_after=2)
    sent = json.loads(lb._core.config)
    assert tuple(sent["pinned"]) == tuple(sorted(PINNED_SETTINGS))
    lb.acquire_server("s1")
    pinned = r.hgetall(f"{lb._core.prefix}config")
    assert pinned == sent["pinned"] == lb._core.settings()
    assert pinned["affinity_margin"] == "2" and pinned["group_cap"] == "3"


def test_the_registry_names_each_key_once_with_a_known_type() -> None:
    names = [k.name for k in keys.REGISTRY]
    assert len(names) == len(set(names))
    assert {k.type for k in keys.REGISTRY} <= {"hash", "zset", "set", "string", "list"}
    stems = [k.stem for k in keys.REGISTRY if k.family]
    assert len(stems) == len(set(stems))


def _registered(key: str, prefix: str) -> keys.Key | None:
    suffix = key[len(prefix) :]
    for k in keys.REGISTRY:
        if suffix == k.name or (k.family and suffix.startswith(k.stem)):
            return k
    return None


@pytest.mark.parametrize("spread", [False, True])
def test_destroy_leaves_nothing_and_every_key_written_is_registered(make_lb, r, spread) -> None:
    """A balancer that used capacity, groups, ejection, engine scoring, waits, remembered
    releases and spread sessions: every key it wrote is in the registry with its type, and
    destroy() deletes all of them."""
    lb = make_lb(
        {"a": {"url": "http://a", "capacity": 2}, "b": None, "c": None},
        eject_after=1,
        group_cap=2,
        engine_scoring=True,
        spread_sessions=spread,
    )
    prefix = f"rr:{{{lb.name}}}:"
    leases = [lb.acquire(f"s{i}", group_id=f"g{i % 2}") for i in range(5)]
    assert leases[0].release()
    assert leases[1].fail()
    lb.report_engine_load({"a": EngineLoad(running=1, waiting=0, kv_usage=0.5)})
    lb.drain_servers(["c"])
    lb.undrain_servers(["c"])
    lb.bump_weight_version()
    for lease in leases[2:]:
        lease.release()
    lb.acquire_server("s9")
    lb.get_status()
    written = r.keys(prefix + "*")
    assert len(written) >= 15, written
    unknown = [key for key in written if _registered(key, prefix) is None]
    assert unknown == [], "add these keys to redis_router/keys.py"
    wrong = {
        key: (r.type(key), reg.type)
        for key in written
        if (reg := _registered(key, prefix)) and r.type(key) != reg.type
    }
    assert wrong == {}
    lb.destroy()
    assert r.keys(prefix + "*") == []
