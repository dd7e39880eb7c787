"""Command packing in C for redis-py's connections.

redis-py packs commands with hiredis (C) on its sync connections when hiredis is installed,
but before 8.2 in Python on its asyncio ones. A batched acquire of 8 requests sends ~50
arguments: Python packs them in ~29 us, hiredis in ~3 us (this machine), and that is a large
part of what an asyncio worker spends per routed request. The balancer's own asyncio clients
make their connections from a subclass that packs with hiredis; its sync and asyncio clients'
connections hand a script call's strings and integers to hiredis directly, skipping the
serializer's copy and checks in Python. Without hiredis nothing changes at all.

The same subclass writes a command without a task of its own. redis-py bounds a write by its
socket timeout with ``asyncio.wait_for``, which before Python 3.12 runs the write in a new
task: one more event-loop turn and ~15 us for every command, although the write almost always
completes at once (the transport sends what it can immediately). Here the bytes go to the
transport directly; only when they could not all be sent does the writer wait, bounded by the
same timeout (``asyncio.timeout``, Python 3.11+), with redis-py's errors. On 3.10 redis-py's
own write is used.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from redis import exceptions as rx
from redis.utils import HIREDIS_AVAILABLE

_TIMEOUT_CONTEXT = sys.version_info >= (3, 11)
# Argument types hiredis packs exactly as redis-py's serializer does (bool is not int here).
_PLAIN = frozenset({str, bytes, int})
if HIREDIS_AVAILABLE:
    from hiredis import pack_command as _hiredis_pack


def pack_in_c(pool: Any, *, asyncio: bool = True) -> bool:
    """Make the connections ``pool`` creates from now on pack commands with hiredis (when
    installed) and, asyncio ones, write without a task. Returns whether it did (not for a pool
    without a ``connection_class``)."""
    base = getattr(pool, "connection_class", None)
    if not isinstance(base, type):
        return False
    pool.connection_class = packed_in_c(base) if asyncio else packed_sync(base)
    return True


def _packing_in_c(base: type) -> Callable[..., list[bytes]]:
    """A ``pack_command`` for a subclass of ``base``. A script call's arguments are strings and
    integers: straight to hiredis. Anything else (a float, a view, a command name of two words,
    a value redis-py refuses) goes through ``base``'s own packer, which converts, splits or
    refuses it as that redis-py version does."""
    redis_py_pack: Callable[..., list[bytes]] = getattr(base, "pack_command")  # noqa: B009

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        if type(args[0]) is str and " " not in args[0] and _PLAIN.issuperset(map(type, args)):
            return [_hiredis_pack(args)]
        return redis_py_pack(self, *args)

    return pack_command


@cache
def packed_sync(base: type) -> type:
    """``base`` (a redis-py sync connection class) packing a script call's arguments with
    hiredis directly. Its own serializer already packs in C, but first copies and checks the
    arguments in Python (~4 us for an acquire's 22, about as much as hiredis takes)."""
    if not HIREDIS_AVAILABLE or getattr(base, "packs_in_c", False):
        return base
    attrs = {"pack_command": _packing_in_c(base), "packs_in_c": True, "__module__": __name__}
    return type(base.__name__, (base,), attrs)


@cache
def packed_in_c(base: type) -> type:
    """``base`` (a redis-py asyncio connection class) packing its commands with hiredis
    (when installed) and writing them without a task."""
    if getattr(base, "writes_without_task", False):
        return base
    parent_send: Any = getattr(base, "send_packed_command")  # noqa: B009

    async def send_packed_command(
        self: Any, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        writer = getattr(self, "_writer", None)
        if (
            not _TIMEOUT_CONTEXT
            or writer is None
            or not self.is_connected
            or (check_health and bool(getattr(self, "health_check_interval", 0)))
        ):
            await parent_send(self, command, check_health)
            return
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        try:
            writer.writelines(command)
            if writer.transport.get_write_buffer_size():  # not all sent yet: wait, bounded
                async with asyncio.timeout(self.socket_timeout):
                    await writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise rx.TimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await self.disconnect(nowait=True)
            raise rx.ConnectionError(f"Error while writing to socket. {e}.") from e
        except BaseException:
            await self.disconnect(nowait=True)
            raise

    def write_now(self: Any, command: list[bytes]) -> None:
        """Hand packed bytes to the transport now, without waiting (redis_router.direct's
        release pipe: a release goes out before anything its process does next)."""
        self._writer.writelines(command)

    methods: dict[str, Any] = {"send_packed_command": send_packed_command, "write_now": write_now}
    if HIREDIS_AVAILABLE:
        methods["pack_command"] = _packing_in_c(base)
    marks = {"packs_in_c": HIREDIS_AVAILABLE, "writes_without_task": True}
    return type(base.__name__, (base,), {**methods, **marks, "__module__": __name__})
