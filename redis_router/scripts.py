"""The Lua scripts, shipped as package data in ``redis_router/lua``.

Each script names on its ``-- Uses`` header line the shared parts it needs (``lib/base``,
``lib/holders``, ``lib/leases``, ``lib/picking``, ``lib/acquiring``; a plugin's own parts by
file name beside it); the loader prepends exactly those, in that order, so there is one copy
of the lease and sticky logic and a script pays only for what it uses. Each assembled script
is also one Redis Functions library of one function, named after the script and a hash of its
source (``invoke.py`` sends it with FCALL where the server has Functions, else EVALSHA).

A script sent by EVALSHA defines every function of its parts again on each call, which costs
more server time than most of its Redis commands (tens of closures made and collected per
call). A Functions library defines the ``lib/`` parts once, when it is loaded. A call's
state lives in its context, a table the script makes and passes to the procedures; the few
top-level lines marked ``-- per call`` (the key prefix from ``KEYS[1]`` and names made from
it) are declared there and set again on entry to each call, in source order. Any other
top-level ``local`` of a ``lib/`` part must be a literal, which the loader checks, so no state
outlives its call. A plugin's own parts, and the script
itself, still run inside the call, as they do under EVALSHA.
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
    "end_session",
    "bump",
    "enqueue",
    "leave",
    "report",
    "engine_report",
)


@dataclass(frozen=True)
class Script:
    """An assembled script. ``function`` names both its Functions library and the one function
    in it: the script's name and the first 16 hex digits of the source's SHA-1, so two versions
    of the client load side by side and never replace each other's code. ``read_only``
    scripts (header ``-- Keeps    read only``) carry the ``no-writes`` flag and go by FCALL_RO;
    ``allow_oom`` ones (those that end leases or keep them alive) run while the server is over
    ``maxmemory``."""

    name: str
    source: str
    sha: str
    function: str = ""  # made from name and sha when not given
    read_only: bool = False
    allow_oom: bool = False
    # The source split for a Functions library (empty: the whole source runs per call):
    # the lib/ parts, defined once at load, and the rest (plugin parts, the script's text).
    shared: str = ""
    body: str = ""

    def __post_init__(self) -> None:
        if not self.function:
            sha = self.sha
            if self.shared:  # the library's shape is part of its version
                sha = hashlib.sha1(f"{_HOISTED}\n{self.source}".encode()).hexdigest()
            object.__setattr__(self, "function", function_name(self.name, sha))

    def library(self) -> str:
        """The source as a Functions library. With ``shared`` parts, those are defined once
        at load and each call first sets KEYS, ARGV and the parts' per-call state; else the
        whole source runs in a callback whose parameters are named KEYS and ARGV, so the body
        reads them as it reads EVAL's globals."""
        flags = "'no-writes'" if self.read_only else "'allow-oom'" if self.allow_oom else ""
        head = f"#!lua name={self.function}\n"
        register = f"redis.register_function{{function_name='{self.function}', flags={{{flags}}}, "
        if not self.shared:
            return f"{head}{register}callback=function(KEYS, ARGV)\n{self.source}\nend}}\n"
        declared, resets = hoist(self.shared)
        enter = "\n".join(resets)
        return (
            f"{head}local KEYS, ARGV\n{declared}\n"
            f"local function {_HOISTED}(keys, argv)\nKEYS, ARGV = keys, argv\n{enter}\nend\n"
            f"{register}callback=function(keys, argv)\n{_HOISTED}(keys, argv)\n"
            f"{self.body}\nend}}\n"
        )


_HOISTED = "rr_enter_call"
# A top-level declaration of a lib/ part: names, values, and the trailing comment if any.
_TOP_LOCAL = re.compile(r"^local (?!function\b)([A-Za-z_][\w, ]*?)\s*=\s*(.*?)\s*(--.*)?$")
_CONSTANT = re.compile(r"^(-?\d+(\.\d+)?|'[^']*'|\"[^\"]*\")$")


def hoist(shared: str) -> tuple[str, list[str]]:
    """The lib/ parts as a library's top level: each line marked ``-- per call`` becomes a
    bare declaration, and its assignment a statement run on entry to each call (returned in
    source order). A top-level ``local`` that is neither marked nor a literal constant is
    refused: defined once, it would carry one call's state into the next (and a library's
    load sees no standard library: ``string.format`` too is taken per call). A ``nil`` marked
    ``-- once per library`` is kept as it is: a cache of procedures made on first use, which
    keep a call's state only in per-call variables, so every later call reuses them."""
    out, resets = [], []
    for line in shared.splitlines():
        m = _TOP_LOCAL.match(line)
        if m is None:
            if line.startswith("local ") and not line.startswith("local function "):
                raise ValueError(f"lib/ top-level line not of one line's form: {line!r}")
            out.append(line)
            continue
        names, values, comment = m.group(1), m.group(2), m.group(3) or ""
        if comment.startswith("-- per call"):
            out.append(f"local {names}")
            resets.append(f"{names} = {values}")
        elif _kept_once(values, comment) or all(
            _CONSTANT.match(v.strip()) for v in values.split(",")
        ):
            out.append(line)
        else:
            raise ValueError(
                f"lib/ top-level state must be marked '-- per call' (set on each call) or be "
                f"a constant: {line!r}"
            )
    return "\n".join(out), resets


def _kept_once(values: str, comment: str) -> bool:
    """A cache of procedures made on first use (``local X = nil -- once per library``)."""
    return values == "nil" and comment.startswith("-- once per library")


# Scripts that end leases, or keep live ones alive, must run during a noeviction out-of-memory
# spell (a function without ``allow-oom`` is refused outright there, where EVAL let a script
# whose first write frees memory go on): releasing is how memory comes back.
ALLOW_OOM = frozenset(
    {"release", "retire", "forget", "leave", "reap", "remove_servers", "destroy", "heartbeat"}
)
_READ_ONLY = re.compile(r"^-- Keeps +read only", re.MULTILINE)
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_]")


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
def load(name: str, leave_out: frozenset[str] = frozenset()) -> Script:
    """One of the library's scripts, by name (see NAMES); ``leave_out``: see from_source."""
    return load_file(lua_dir() / f"{name}.lua", leave_out)


_USES = re.compile(r"^-- Uses +(.+)$", re.MULTILINE)
# part -> the part it goes before wherever that one is used: least loaded is engine-aware, and
# breaks ties by pinned sessions, when pinned so, in every policy's script, including plugins
# written before the parts existed.
_IMPLIED = {"lib/scoring": "lib/picking", "lib/pinning": "lib/picking"}
# The parts an acquire needs only while a pinned setting is on (part -> its field in
# core.PINNED_SETTINGS, "" = off): a balancer composes its acquire script without those its
# settings leave off (core.BalancerCore), so a pool that never turns them on sends no code
# of theirs; the procedures that call them do so only while the setting is on.
OPTIONAL = {"lib/scoring": "engine", "lib/pinning": "spread"}


def left_out(pinned: dict[str, str]) -> frozenset[str]:
    """The optional parts that settings pinned so (field -> value, "" = off) leave out."""
    return frozenset(part for part, field in OPTIONAL.items() if not pinned[field])


@cache
def load_file(path: Path, leave_out: frozenset[str] = frozenset()) -> Script:
    """A script file with the parts its ``-- Uses`` line names prepended. Router plugins ship
    theirs beside their module and use ``lib/acquiring``, so leases and stickiness behave as in
    the core's acquire."""
    path = Path(path)
    return from_source(path.stem, path.read_text(), path.parent, leave_out)


def from_source(
    name: str, text: str, here: Path | None = None, leave_out: frozenset[str] = frozenset()
) -> Script:
    """A script from its text, with the parts its ``-- Uses`` line names prepended (a part
    that is not ``lib/...`` is looked up in ``here``) and those they imply, less the implied
    optional ones in ``leave_out`` (keys of OPTIONAL; a part the line names stays)."""
    unknown = sorted(set(leave_out) - set(OPTIONAL))
    if unknown:
        raise ValueError(
            f"leave_out: {unknown} are not optional parts; only {sorted(OPTIONAL)} may be left out"
        )
    uses = _USES.search(text)
    if uses is None:
        raise ValueError(f"script {name!r} has no '-- Uses' header line naming its parts")
    parts: list[str] = []
    shared: list[str] = []
    refs = [r.strip() for r in uses.group(1).split(",")]
    for needed, before in _IMPLIED.items():  # parts a named part cannot do without
        if before in refs and needed not in refs and needed not in leave_out:
            refs.insert(refs.index(before), needed)
    for ref in refs:
        folder = lua_dir() if ref.startswith("lib/") else here
        part = folder / f"{ref}.lua" if folder is not None else None
        if part is None or not part.is_file():
            raise FileNotFoundError(f"script {name!r} uses {ref!r}, which does not exist")
        (shared if ref.startswith("lib/") and not parts else parts).append(part.read_text())
    source = "\n".join([*shared, *parts, text])
    sha = hashlib.sha1(source.encode()).hexdigest()
    read_only = _READ_ONLY.search(text) is not None
    allow_oom = name in ALLOW_OOM and not read_only
    lib = "\n".join(shared)
    hoist(lib)  # refuses a lib/ part whose state would outlive a call
    return Script(name, source, sha, "", read_only, allow_oom, lib, "\n".join([*parts, text]))


def function_name(name: str, sha: str) -> str:
    """The name of a script's Functions library and function: its version is in it."""
    return f"rr_{_NOT_A_NAME.sub('_', name)}_{sha[:16]}"


def all_scripts() -> dict[str, Script]:
    return {n: load(n) for n in NAMES}


def compositions(name: str) -> list[Script]:
    """Every form of one of the library's scripts a balancer may send: one per set of
    optional parts its settings leave out (a script that uses none has one form)."""
    optional = sorted(OPTIONAL)
    subsets = [
        frozenset(p for k, p in enumerate(optional) if mask >> k & 1)
        for mask in range(2 ** len(optional))
    ]
    return list({s.sha: s for s in (load(name, left) for left in subsets)}.values())
