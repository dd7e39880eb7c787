"""The Lua scripts, shipped as package data in ``redis_router/lua``.

``lib.lua`` is prepended to every script, so the lease and sticky logic has one copy.
Scripts run by EVALSHA; only when a server answers NOSCRIPT (first use, restart, failover) is
the source sent with SCRIPT LOAD, so no call pays for an existence check.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
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
    "heartbeat",
    "retire",
)


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


@cache
def lua_dir() -> Path:
    """The package's ``lua`` folder: in a checkout or an editable install a symlink to the
    repository's top-level ``lua/``, in a wheel a copy of it (the build follows the symlink)."""
    folder = resources.files("redis_router") / "lua"
    if not isinstance(folder, Path) or not (folder / "lib.lua").is_file():
        raise FileNotFoundError(
            f"redis_router's Lua scripts are missing from {folder}; reinstall the package "
            "(in a checkout, restore the symlink: git checkout redis_router/lua)"
        )
    return folder


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
