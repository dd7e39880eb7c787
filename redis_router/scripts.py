"""The Lua scripts: found in the wheel (``redis_router/lua``) or in a source checkout (``lua/``).

``lib.lua`` is prepended to every script, so the lease and sticky logic has one copy.
Scripts run by EVALSHA; only when a server answers NOSCRIPT (first use, restart, failover) is
the source sent with SCRIPT LOAD, so no call pays for an existence check.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

NAMES = (
    "acquire",
    "release",
    "renew",
    "add_servers",
    "remove_servers",
    "drain",
    "undrain",
    "reap",
    "clear_sticky",
    "configure",
    "destroy",
    "status",
    "counts",
)


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


@cache
def lua_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "lib.lua").is_file():
            return candidate
    raise FileNotFoundError(
        f"redis_router's Lua scripts are missing: looked in {here / 'lua'} (wheel) and "
        f"{here.parent / 'lua'} (source checkout); reinstall the package"
    )


@cache
def load(name: str) -> Script:
    base = lua_dir()
    source = (base / "lib.lua").read_text() + "\n" + (base / f"{name}.lua").read_text()
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> dict[str, Script]:
    return {n: load(n) for n in NAMES}
