"""Sending a script call: FCALL where the server has Redis Functions, EVALSHA where it has not.

The first call of a :class:`Sender` probes: a server that answers "unknown command" to FCALL
(Redis 6.2), or a user whose ACL does not allow Functions, gets EVALSHA from then on. A call
whose function or script the server lacks (first use, ``FUNCTION FLUSH``, ``SCRIPT FLUSH``, a
restart or failover to a server without them) loads it and is sent again, up to ``ATTEMPTS``
times; the last attempt sends the source itself with EVAL, which no flush can race, so a
caller never sees NOSCRIPT or "Function not found". Each of those replies proves the call did
not run, so sending it again is safe. A library is loaded without REPLACE: its name is its
version, so one already there is the same code and nobody's library is ever replaced.

``REDIS_ROUTER_SCRIPTS`` (read when a sender is made, i.e. when a balancer is constructed)
chooses: ``auto`` (the default), ``function`` (FCALL from the first call; a server without
Functions still gets EVALSHA) or ``eval`` (EVALSHA only).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any, Literal

from redis import exceptions as rx

from .connection import transient
from .scripts import Script

ENV = "REDIS_ROUTER_SCRIPTS"
MODES = ("auto", "function", "eval")
ATTEMPTS = 4  # sends of one call, the last one by EVAL

Mode = Literal["auto", "function", "eval"]
# Sent by a Cluster client straight to the node of the key prefix's slot: redis-py's Cluster
# clients would ask a node for FCALL's keys (COMMAND GETKEYS) before every call. They retry
# only what they route themselves, so a send that meets a failover is routed by them again.
_ROUTED = ("FCALL", "FCALL_RO")
_ROUTE_AGAIN = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterDownError,
    rx.TryAgainError,
    rx.RedisClusterException,
)
Command = tuple[Any, ...]
# A recovery plan yields the commands to send and receives each one's reply (or its error,
# thrown in); it returns the call's result.
Plan = Generator[Command, Any, Any]


def configured_mode() -> Mode:
    """The mode ``REDIS_ROUTER_SCRIPTS`` asks for (``auto`` when unset)."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value == "auto":
        return "auto"
    if value == "function":
        return "function"
    if value == "eval":
        return "eval"
    raise ValueError(f"{ENV}={value!r}: expected auto, function or eval")


def unsent(exc: Exception) -> bool:
    """True for an error reply proving the call did not run, which a send the ordinary way
    (:class:`Sender`, the balancers' retries) may get through: the script or function is
    missing, or the server is in a transient state (READONLY after a failover, LOADING)."""
    return isinstance(exc, rx.NoScriptError) or _missing_function(exc) or transient(exc)


def _missing_function(exc: Exception) -> bool:
    return "function not found" in str(exc).lower()


def _no_functions(exc: Exception) -> bool:
    """The server (6.2) or the user's ACL refuses FCALL or FUNCTION itself (a command refused
    inside a script says so otherwise: "Unknown Redis command called from script")."""
    text = str(exc).lower()
    named = "fcall" in text or "function" in text
    return named and (isinstance(exc, rx.NoPermissionError) or "unknown command" in text)


class Sender:
    """Sends script calls to one client, sync or asyncio (``send`` and ``send_async``).

    ``functions`` is None until the first call has probed the server (``auto``), then True
    (FCALL) or False (EVALSHA). On a Cluster, FUNCTION LOAD goes to every primary.
    """

    __slots__ = ("_cluster", "client", "functions")

    def __init__(self, client: Any, mode: Mode | None = None) -> None:
        mode = mode or configured_mode()
        self.client = client
        self.functions: bool | None = None if mode == "auto" else mode == "function"
        self._cluster = callable(getattr(client, "get_node_from_key", None))

    @property
    def mode(self) -> str:
        """What calls are sent with: ``"fcall"``, ``"evalsha"``, or ``"probe"`` before the
        first call."""
        return "probe" if self.functions is None else "fcall" if self.functions else "evalsha"

    # -- the commands ----------------------------------------------------------------------

    def command(self, script: Script, prefix: str, args: tuple[Any, ...]) -> Command | None:
        """The command a call is written as by a caller that sends it and reads its reply
        itself (redis_router.outbox); None before the first call has probed the server, and
        on a Cluster (the call goes to its slot's node the ordinary way)."""
        if self.functions is None or self._cluster:
            return None
        return self._first(script, prefix, args)

    def _first(self, script: Script, prefix: str, args: tuple[Any, ...]) -> Command:
        if self.functions is False:
            return ("EVALSHA", script.sha, 1, prefix, *args)
        verb = "FCALL_RO" if script.read_only else "FCALL"
        return (verb, script.function, 1, prefix, *args)

    def _plan(self, script: Script, prefix: str, args: tuple[Any, ...], error: Exception) -> Plan:
        """What to send after the first attempt failed with ``error``."""
        for attempt in range(1, ATTEMPTS):
            if _no_functions(error):
                self.functions = False  # Redis 6.2, or Functions not allowed: EVALSHA for good
            elif _missing_function(error):
                if self.functions is not False:  # (else another call found no Functions)
                    try:
                        yield ("FUNCTION LOAD", script.library())
                        self.functions = True
                    except (rx.OutOfMemoryError, rx.ReadOnlyError):
                        # FUNCTION LOAD is refused over maxmemory and on a replica, where
                        # SCRIPT LOAD and EVAL are not: a release must still end its lease
                        # over maxmemory, and a read-only call runs on a replica
                        return (yield ("EVAL", script.source, 1, prefix, *args))
                    except rx.ResponseError as exc:
                        if "already exists" in str(exc):
                            self.functions = True  # another process loaded it meanwhile
                        elif _no_functions(exc):
                            self.functions = False  # may call but not load: EVALSHA
                        else:
                            raise
            elif isinstance(error, rx.NoScriptError):
                yield ("SCRIPT LOAD", script.source)
            else:
                raise error
            try:
                if attempt == ATTEMPTS - 1:  # the last try: the source itself, which no flush races
                    return (yield ("EVAL", script.source, 1, prefix, *args))
                result = yield self._first(script, prefix, args)
            except rx.ResponseError as exc:
                error = exc
                continue
            if self.functions is None:
                self.functions = True
            return result
        raise error  # the last attempt (EVAL) failed too: the script's own error

    def _load_command(self, script: Script) -> Command | None:
        if self.functions is None or self._cluster:
            return None
        if self.functions:
            return ("FUNCTION LOAD", script.library())
        return ("SCRIPT LOAD", script.source)

    def preload(self, script: Script) -> None:
        """Load a script before calls of it are written directly (redis_router.outbox): a
        first call that met NOSCRIPT would go again the ordinary way, behind calls made after
        it. Best effort: what fails here, the call's own recovery does."""
        command = self._load_command(script)
        if command is not None:
            # Already there ("already exists"), or not allowed: the call recovers.
            with contextlib.suppress(rx.RedisError):
                self.client.execute_command(*command)

    async def preload_async(self, script: Script) -> None:
        """:meth:`preload` with an asyncio client."""
        command = self._load_command(script)
        if command is not None:
            with contextlib.suppress(rx.RedisError):
                await self.client.execute_command(*command)

    # -- sync and asyncio drivers ----------------------------------------------------------

    def send(self, script: Script, prefix: str, args: tuple[Any, ...]) -> Any:
        """The script's reply, sent with a sync client."""
        command = self._first(script, prefix, args)
        try:
            if self._cluster:
                result = self._execute(command, prefix)
            else:
                result = self.client.execute_command(*command)
        except rx.ResponseError as exc:
            return self._drive(self._plan(script, prefix, args, exc), prefix)
        if self.functions is None:
            self.functions = True
        return result

    def _execute(self, command: Command, prefix: str) -> Any:
        client = self.client
        if not self._cluster:
            return client.execute_command(*command)
        if command[0] == "FUNCTION LOAD":  # to each primary: one that has it must not stop it
            for node in client.get_primaries():
                try:
                    client.execute_command(*command, target_nodes=node)
                except rx.ResponseError as exc:
                    if "already exists" not in str(exc):
                        raise
            return None
        if command[0] in _ROUTED:
            try:
                node = client.get_node_from_key(prefix)
                return client.execute_command(*command, target_nodes=node)
            except _ROUTE_AGAIN:
                pass  # redis-py retries and follows the topology only for what it routes
        return client.execute_command(*command)

    def _drive(self, plan: Plan, prefix: str) -> Any:
        command = next(plan)
        while True:
            try:
                reply = self._execute(command, prefix)
            except rx.ResponseError as exc:
                try:
                    command = plan.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                command = plan.send(reply)
            except StopIteration as stop:
                return stop.value

    async def send_async(self, script: Script, prefix: str, args: tuple[Any, ...]) -> Any:
        """The script's reply, sent with an asyncio client."""
        command = self._first(script, prefix, args)
        try:
            if self._cluster:
                result = await self._execute_async(command, prefix)
            else:
                result = await self.client.execute_command(*command)
        except rx.ResponseError as exc:
            return await self._drive_async(self._plan(script, prefix, args, exc), prefix)
        if self.functions is None:
            self.functions = True
        return result

    async def _execute_async(self, command: Command, prefix: str) -> Any:
        client = self.client
        if not self._cluster:
            return await client.execute_command(*command)
        if getattr(client, "_initialize", False):  # asyncio clusters learn the slots lazily
            await client.initialize()
        if command[0] == "FUNCTION LOAD":
            for node in client.get_primaries():
                try:
                    await client.execute_command(*command, target_nodes=node)
                except rx.ResponseError as exc:
                    if "already exists" not in str(exc):
                        raise
            return None
        if command[0] in _ROUTED:
            try:
                node = client.get_node_from_key(prefix)
                return await client.execute_command(*command, target_nodes=node)
            except _ROUTE_AGAIN:
                pass
        return await client.execute_command(*command)

    async def _drive_async(self, plan: Plan, prefix: str) -> Any:
        command = next(plan)
        while True:
            try:
                reply = await self._execute_async(command, prefix)
            except rx.ResponseError as exc:
                try:
                    command = plan.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                command = plan.send(reply)
            except StopIteration as stop:
                return stop.value


def loaded_functions(client: Any) -> set[str]:
    """Names of the redis-router libraries loaded on a sync client's server (``FUNCTION
    LIST``), for operators and tests."""
    names = set()
    for library in client.function_list(library="rr_*"):
        if not isinstance(library, dict):  # RESP2: a flat list of field, value
            library = dict(zip(library[::2], library[1::2], strict=True))
        name = library.get("library_name", library.get(b"library_name"))
        names.add(name.decode() if isinstance(name, bytes) else str(name))
    return names
