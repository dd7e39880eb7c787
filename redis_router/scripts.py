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
    """One of the library's scripts, by name (see NAMES)."""
    return load_file(lua_dir() / f"{name}.lua")


@cache
def load_file(path: Path) -> Script:
    """A script file with lib.lua prepended: router plugins ship theirs beside their module
    and build on lib.lua's acquire_all, so leases and stickiness behave as in the core."""
    source = (lua_dir() / "lib.lua").read_text() + "\n" + Path(path).read_text()
    return Script(Path(path).stem, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> dict[str, Script]:
    return {n: load(n) for n in NAMES}
