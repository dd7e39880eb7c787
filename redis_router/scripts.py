"""The Lua scripts, shipped as package data in ``redis_router/lua``.

Each script names on its ``-- Uses`` header line the shared parts it needs (``lib/base``,
``lib/holders``, ``lib/leases``, ``lib/picking``, ``lib/acquiring``; a plugin's own parts by
file name beside it); the loader prepends exactly those, in that order, so there is one copy
of the lease and sticky logic and a script pays only for what it uses. Scripts run by
EVALSHA; only when a server answers NOSCRIPT (first use, restart, failover) is the source
sent with SCRIPT LOAD, so no call pays for an existence check.
"""

from __future__ import annotations

import hashlib
import re
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
    "heal",
    "owned",
    "forget",
    "owner",
    "bump",
    "enqueue",
    "leave",
    "report",
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
    if not isinstance(folder, Path) or not (folder / "lib" / "base.lua").is_file():
        raise FileNotFoundError(
            f"redis_router's Lua scripts are missing from {folder}; reinstall the package "
            "(in a checkout, restore the symlink: git checkout redis_router/lua)"
        )
    return folder


@cache
def load(name: str) -> Script:
    """One of the library's scripts, by name (see NAMES)."""
    return load_file(lua_dir() / f"{name}.lua")


_USES = re.compile(r"^-- Uses +(.+)$", re.MULTILINE)


@cache
def load_file(path: Path) -> Script:
    """A script file with the parts its ``-- Uses`` line names prepended. Router plugins ship
    theirs beside their module and use ``lib/acquiring``, so leases and stickiness behave as in
    the core's acquire."""
    path = Path(path)
    return from_source(path.stem, path.read_text(), path.parent)


def from_source(name: str, text: str, here: Path | None = None) -> Script:
    """A script from its text, with the parts its ``-- Uses`` line names prepended (a part
    that is not ``lib/...`` is looked up in ``here``)."""
    uses = _USES.search(text)
    if uses is None:
        raise ValueError(f"script {name!r} has no '-- Uses' header line naming its parts")
    parts = []
    for ref in (r.strip() for r in uses.group(1).split(",")):
        folder = lua_dir() if ref.startswith("lib/") else here
        part = folder / f"{ref}.lua" if folder is not None else None
        if part is None or not part.is_file():
            raise FileNotFoundError(f"script {name!r} uses {ref!r}, which does not exist")
        parts.append(part.read_text())
    source = "\n".join([*parts, text])
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


def all_scripts() -> dict[str, Script]:
    return {n: load(n) for n in NAMES}
