"""What the HTTP front reads from a request before it takes a lease: no I/O, no HTTP stack.

Shared by ``redis-router serve`` (aiohttp) and the httpx transports, so both route a request
alike: the same balancer request id (the session, else the client's request id, else a fresh
one), the same policy fields (the prompt as token ids), the same 400s for malformed bodies,
which are found here, before anything is sent to Redis.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import validation
from ..errors import (
    NoCapacity,
    NoServersAvailable,
    PoolExhausted,
    RedisConfigError,
    RedisUnavailable,
    ReplicaEjected,
)

# The generation endpoints (OpenAI's and SGLang's); every other path is forwarded unparsed.
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
GENERATION_PATHS = (CHAT, COMPLETIONS, GENERATE)

DEFAULT_SESSION_HEADER = "X-Session-ID"
REQUEST_ID_HEADER = "X-Request-Id"
GROUP_HEADER = "X-Group-ID"
# Earlier versions ran attempt k > 0 of a request under "<id>~r<k>", to balance it anew away
# from the replica that failed; retries now keep the id and exclude the replicas that failed
# (acquire(exclude=...)), and an abort still looks for those ids (see retry_ids) while such
# instances share the balancer.
RETRY_MARK = "~r"
MAX_RETRIES = 10
# Room left in a request id (512 bytes) for the retry mark.
MAX_ID_BYTES = validation.MAX_REQUEST_ID_BYTES - 8
# Sampling options of OpenAI's API, passed as ``sampling_params`` to a policy that asks.
OPENAI_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class BadRequest(ValueError):
    """A malformed request: answered 400 with OpenAI's error shape, no lease taken."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(
    message: str, kind: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Route:
    """How one request is routed: the balancer request id and the policy's fields."""

    request_id: str  # the session, else the client's request id, else a fresh one
    session: str | None  # the session key, when the request named one
    client_rid: str | None  # the request id the client gave (X-Request-Id or the body's rid)
    stream: bool
    # Token ids, or a text (made pseudo-token ids only if the policy asks for prompt_ids)
    prompt: list[int] | str | None
    body: dict[str, Any] = field(default_factory=dict)
    group: str | None = None

    def fields(self, declared: Sequence[str]) -> dict[str, Any]:
        """The fields the balancer's policy declared, filled from the request (a field the
        request cannot supply is left out: the policy's own default applies)."""
        out: dict[str, Any] = {}
        for name in declared:
            if name == "prompt_ids":
                if self.prompt is not None:
                    p = self.prompt
                    out[name] = text_ids(p) if isinstance(p, str) else p
            elif name == "group_id":
                if self.group is not None:
                    out[name] = self.group
            elif name == "sampling_params":
                out[name] = sampling_params(self.body)
            elif name in self.body:
                out[name] = self.body[name]
        return out


@dataclass(frozen=True)
class SessionRule:
    """Where a request names its session: a header, or a body field (None: headers only)."""

    header: str = DEFAULT_SESSION_HEADER
    body_field: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.header, str) or not self.header.strip():
            raise ValueError(f"session header must be a non-empty header name, got {self.header!r}")
        if self.body_field is not None and (
            not isinstance(self.body_field, str) or not self.body_field
        ):
            raise ValueError(
                f"session field must be a non-empty body key or None, got {self.body_field!r}"
            )


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or BadRequest saying why not."""
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8 JSON") from None
    except ValueError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def route_request(
    path: str,
    raw: bytes,
    headers: Mapping[str, str],
    rule: SessionRule,
) -> Route:
    """Check a request and say how to route it. Generation endpoints must carry a JSON body
    of their API's shape; any other path is routed by its headers alone."""
    body = parse_json(raw) if path in GENERATION_PATHS else {}
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {_kind(stream)}", "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {_kind(model)}", "model")
    prompt = _prompt_source(path, body)
    session = _session(body, headers, rule)
    client_rid = _client_rid(body, headers)
    group = headers.get(GROUP_HEADER)
    if group is not None:
        group = _id(group, f"header {GROUP_HEADER}", "group")
    rid = session or client_rid or fresh_id()
    return Route(rid, session, client_rid, stream, prompt, body, group)


class _Ids:
    """Fresh request ids: a random prefix per process (drawn again in a forked child) and a
    counter, unique across processes as uuid4 is, at a fraction of its cost per request."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = f"http-{os.urandom(12).hex()}-"
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter)}"


fresh_id = _Ids()


def retry_ids(request_id: str, retries: int) -> list[str]:
    """The balancer request ids a request's attempts may hold: its own, then those earlier
    versions gave their retries."""
    return [request_id] + [f"{request_id}{RETRY_MARK}{k}" for k in range(1, retries + 1)]


def prompt_of(path: str, body: Mapping[str, Any]) -> list[int] | None:
    """The prompt as token ids: given ids as they are, a text (or chat messages rendered to
    one) as pseudo-token ids, see :func:`text_ids`. Checks the endpoint's required field."""
    got = _prompt_source(path, body)
    return text_ids(got) if isinstance(got, str) else got


def _prompt_source(path: str, body: Mapping[str, Any]) -> list[int] | str | None:
    """What :func:`prompt_of` reads, checked, with a text left as it is (the conversion is
    made only for a policy that asks for ``prompt_ids``)."""
    if path == CHAT:
        return render_chat(body.get("messages"))
    if path == COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required (a string, strings, or token ids)", "prompt")
        return _prompt(body["prompt"], "prompt")
    if path == GENERATE:
        if body.get("input_ids") is not None:
            return _prompt(body["input_ids"], "input_ids", text=False)
        if body.get("text") is not None:
            return _prompt(body["text"], "text", ids=False)
        raise BadRequest("/generate needs 'text' or 'input_ids'", "text")
    return None


def render_chat(messages: Any) -> str:
    """Chat messages as one text, the same in every process: each message's role and content
    (text parts joined; other parts as their JSON) framed by separators, so the messages of a
    turn render to a prefix of the next turn's."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of message objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object, got {_kind(m)}", "messages")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"messages[{i}].role must be a non-empty string", "messages")
        if content is None or isinstance(content, str):
            text = content or ""
        elif isinstance(content, list):
            text = "".join(_part(p) for p in content)
        else:
            raise BadRequest(
                f"messages[{i}].content must be a string, an array of parts or null, got "
                f"{_kind(content)}",
                "messages",
            )
        out.append(f"\x1e{role}\x1f{text}")
    return "".join(out)


def text_ids(text: str) -> list[int]:
    """A text as pseudo-token ids: its UTF-8 bytes, four to an id (about a token's worth), so
    a prefix-cache policy's blocks cover texts as they cover token ids and a text's prefix
    maps to a prefix of ids (a trailing part of fewer than four bytes is dropped)."""
    data = text.encode("utf-8", "surrogatepass")
    ids = array("I")
    if ids.itemsize != 4:  # pragma: no cover - no mainstream platform
        return list(data)
    ids.frombytes(data[: len(data) // 4 * 4])
    if sys.byteorder != "little":  # the same ids on every machine
        ids.byteswap()
    return ids.tolist()


def sampling_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's ``sampling_params``, else OpenAI's sampling options of the body."""
    given = body.get("sampling_params")
    if isinstance(given, dict):
        return given
    return {k: body[k] for k in OPENAI_SAMPLING if k in body}


def replica_url(handle: Any) -> str | None:
    """A replica's base URL from its handle: the metadata's ``url``, or the metadata itself
    when it is a URL string; None when it has neither."""
    url = handle.get("url") if isinstance(handle, Mapping) else handle
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return url.rstrip("/")
    return None


def retry_after(seconds: float) -> str:
    """A Retry-After value (whole seconds, at least 1)."""
    return str(max(1, math.ceil(seconds))) if math.isfinite(seconds) else "1"


# What a 503 answers: the balancer could not route the request now (an empty or full pool, an
# ejected sticky replica), or could not reach Redis (down, refusing the credentials, its
# host unknown, or every connection of the pool busy).
NOT_ROUTED = (NoServersAvailable, RedisUnavailable, RedisConfigError, PoolExhausted)


def refusal(exc: Exception) -> tuple[str | None, str]:
    """A 503's Retry-After (None: retrying will not help) and error code for ``exc``."""
    if isinstance(exc, ReplicaEjected):
        return retry_after(exc.seconds_left), "replica_ejected"
    if isinstance(exc, NoCapacity):
        return "1", "no_capacity"
    if isinstance(exc, NoServersAvailable):
        return "1", "no_servers_available"
    if isinstance(exc, RedisConfigError):
        return None, "redis_config_error"
    if isinstance(exc, PoolExhausted):
        return "1", "pool_exhausted"
    return "1", "redis_unavailable"


def _part(p: Any) -> str:
    if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
        return str(p["text"])
    return json.dumps(p, sort_keys=True, separators=(",", ":"))


def _prompt(
    value: Any, name: str, *, text: bool = True, ids: bool = True, batch: bool = True
) -> list[int] | str:
    """A prompt field: a string, or token ids; in a batch (a list of them) the first one."""
    if batch and isinstance(value, list) and value and isinstance(value[0], (list, str)):
        for item in value[1:]:  # every prompt of the batch is checked; the first routes it
            _prompt(item, name, text=text, ids=ids, batch=False)
        value = value[0]
    if text and isinstance(value, str):
        return value
    if ids and isinstance(value, list) and all(_token(t) for t in value):
        return value
    allowed = "a string or a list of strings" if not ids else "token ids (a list of integers)"
    if text and ids:
        allowed = "a string, a list of strings, or token ids (a list of integers)"
    if not batch:
        allowed = f"one kind for every prompt of the batch: {allowed}"
    raise BadRequest(f"'{name}' must be {allowed}, got {_kind(value)}", name)


def _token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32


def _session(body: Mapping[str, Any], headers: Mapping[str, str], rule: SessionRule) -> str | None:
    value = headers.get(rule.header)
    if value is not None:
        return _id(value, f"header {rule.header}", "session")
    if rule.body_field is not None and body.get(rule.body_field) is not None:
        v = body[rule.body_field]
        if not isinstance(v, str):
            raise BadRequest(
                f"'{rule.body_field}' (the session key) must be a string, got {_kind(v)}",
                rule.body_field,
            )
        return _id(v, f"'{rule.body_field}'", rule.body_field)
    return None


def _client_rid(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    value = headers.get(REQUEST_ID_HEADER)
    if value is not None:
        return _id(value, f"header {REQUEST_ID_HEADER}", "rid")
    rid = body.get("rid")
    if isinstance(rid, str):
        return _id(rid, "'rid'", "rid")
    return None


def _id(value: str, what: str, param: str) -> str:
    try:
        validation.request_id(value, what)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc), param) from None
    if len(value.encode("utf-8")) > MAX_ID_BYTES:
        raise BadRequest(f"{what} must be at most {MAX_ID_BYTES} bytes in UTF-8", param)
    return value


def _kind(value: Any) -> str:
    """A JSON value's type, in JSON's words, with its article."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
