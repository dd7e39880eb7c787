"""Argument checks shared by the sync and async balancers.

Every check runs before anything is sent to Redis, so bad input changes nothing (I8).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any, SupportsIndex

MAX_REQUEST_ID_BYTES = 512
MAX_SERVER_ID_BYTES = 256
MAX_BATCH = 10_000
NAME_RE = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
# Lease tokens are listed space-separated inside Redis: no white space, nothing to escape.
TOKEN_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Durations: Redis keeps times in integer milliseconds and Lua in doubles (exact to 2**53),
# so every duration has an upper bound far inside both.
MAX_TTL = 366 * 86400.0  # a year: sticky_ttl, max_lease_age
MAX_LEASE_TTL = 86400.0  # a day: how long a silent holder is still taken for alive
MIN_LEASE_TTL = 0.1  # heartbeats go out every lease_ttl / 4
# Control characters are refused: U+001F separates fields inside Redis, and they make keys
# unreadable in redis-cli.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_id(value: object, arg: str, limit: int) -> str:
    # The usual id (a uuid, a name): printable ASCII, one byte a character. Checked without
    # a regular expression or an encode, as every acquire and release checks one or two.
    if type(value) is str and value.isascii() and value.isprintable() and 0 < len(value) <= limit:
        return value
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{arg} must be a non-empty string")
    if _CONTROL.search(value):
        raise ValueError(f"{arg} must not contain control characters (U+0000-U+001F, U+007F)")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{arg} must be valid Unicode (no lone surrogates)") from None
    if size > limit:
        raise ValueError(f"{arg} must be at most {limit} bytes in UTF-8, got {size}")
    return value


def request_id(value: object, arg: str = "request_id") -> str:
    return _check_id(value, arg, MAX_REQUEST_ID_BYTES)


def server_id(value: object, arg: str = "server_id") -> str:
    return _check_id(value, arg, MAX_SERVER_ID_BYTES)


def server_ids(values: object, arg: str = "server_ids") -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{arg} must be a list of server id strings, got {type(values).__name__}")
    return [server_id(v, f"{arg}[{i}]") for i, v in enumerate(values)]


def exclusion(values: object, arg: str = "exclude") -> tuple[str, ...]:
    """Server ids an acquire must not route to (a set, list or tuple of them), each checked
    as a server id, in order and once each; () for None."""
    if values is None:
        return ()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(
            f"{arg} must be a collection of server id strings (a set, list or tuple), got "
            f"{type(values).__name__}"
        )
    out = tuple(dict.fromkeys(server_id(v, f"each server id in {arg}") for v in values))
    if len(out) > MAX_BATCH:
        raise ValueError(f"{arg} holds {len(out)} server ids; at most {MAX_BATCH}")
    return out


def request_ids(values: object, arg: str = "request_ids") -> list[str]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{arg} must be a list of request id strings, got {type(values).__name__}")
    out = [request_id(v, f"{arg}[{i}]") for i, v in enumerate(values)]
    if len(out) > MAX_BATCH:
        raise ValueError(f"{arg} holds {len(out)} ids; at most {MAX_BATCH} per call")
    return out


def servers_mapping(values: object, arg: str = "servers") -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise TypeError(
            f"{arg} must be a mapping {{server_id: value}}, got {type(values).__name__}"
        )
    return {server_id(k, f"{arg} key {k!r}"): v for k, v in values.items()}


URL_SCHEMES = ("http://", "https://")


def metadata(value: Any) -> Any:
    """A replica's metadata as every reader sees it (health, load, serve, status): a plain URL
    string (``add_servers({"s0": "http://..."})``, ``servers add --meta http://...``, or a pool
    stored so by an earlier version) is ``{"url": that string}``; anything else is as stored.
    The handle a worker gets stays the value registered."""
    if isinstance(value, str) and value.startswith(URL_SCHEMES):
        return {"url": value}
    return value


def stored_metadata(raw: str | bytes | None) -> Any:
    """A replica's metadata as stored in Redis (JSON), as readers see it (:func:`metadata`);
    None when absent or not JSON."""
    if raw is None:
        return None
    try:
        return metadata(json.loads(raw))
    except ValueError:
        return None


def name(value: object) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(
            f"name must be 1-64 characters from A-Z a-z 0-9 . _ : / -, got {value!r} "
            "(braces are reserved for the Redis Cluster hash tag)"
        )
    return value


def token(value: object, arg: str = "token") -> str:
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__}")
    if not TOKEN_RE.fullmatch(value):
        raise ValueError(
            f"{arg} must be 1-128 characters from A-Z a-z 0-9 . _ : - (a lease's .token), "
            f"got {value[:140]!r}"
        )
    return value


def seconds(value: object, arg: str, maximum: float = MAX_TTL, minimum: float = 0.001) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise ValueError(
            f"{arg} must be a number of seconds from {minimum:g} to {maximum:g}, got {value!r}"
        )
    return float(value)


def flag(value: object, arg: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__}")
    return value


def release(
    server_id_: object, request_id_: object, failed: object
) -> tuple[str, str | None, bool]:
    """A release by replica's arguments (``release_server``), checked before anything is
    looked up or sent."""
    sid = server_id(server_id_)  # first, as the balancers always checked it
    rid = request_id(request_id_) if request_id_ is not None else None
    return sid, rid, flag(failed, "failed")


# A lease's weight (a weighing policy's unit, e.g. tokens) travels as a Lua number (a double):
# integers are exact far beyond any prompt or output length.
MAX_WEIGHT = 2**40


def weight(value: object, arg: str) -> int:
    """A non-negative integer count of tokens (or of a policy's weight units), at most
    MAX_WEIGHT; a bool is refused (True is no count)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{arg} must be an int >= 0 (tokens), got {type(value).__name__}")
    n = operator.index(value)  # int, or an integer type such as numpy's
    if not 0 <= n <= MAX_WEIGHT:
        raise ValueError(f"{arg} must be an int from 0 to {MAX_WEIGHT} (tokens), got {n}")
    return n
