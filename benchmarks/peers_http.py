"""Fake OpenAI-compatible replicas and the stdlib HTTP/1.1 clients of the peers benchmark.

Standard library only, so the benchmark and its test need no HTTP package: the replicas are one
asyncio server per port in one process of their own; the clients are ``http.client`` (sync) and a
small keep-alive asyncio client. A replica answers ``/v1/completions`` and
``/v1/chat/completions`` after ``service_ms + ms_per_token * max_tokens`` (at once at 0), and
``/health``, ``/v1/models`` and any other GET with 200. It counts, for the benchmark (``GET
/stats``, ``POST /reset``, ``POST /config``): its time-weighted in-flight requests and a prefix
cache of the prompt's whitespace-separated tokens, in blocks of ``BLOCK`` tokens hashed as
whole prefixes (unbounded), so a prompt's cached tokens are the ones its longest cached prefix
covers, as an engine's automatic prefix caching would reuse.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
BLOCK = 16  # tokens per prefix-cache block, as vLLM's default --block-size
MODEL = "fake-model"


@dataclass
class _Replica:
    """What one replica counts between two resets."""

    config: dict[str, float]
    inflight: int = 0
    area: float = 0.0  # integral of in-flight over time (request-seconds)
    since: float = field(default_factory=time.monotonic)
    mark: float = field(default_factory=time.monotonic)
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    blocks: set[int] = field(default_factory=set)

    def _tick(self) -> None:
        now = time.monotonic()
        self.area += self.inflight * (now - self.mark)
        self.mark = now

    def reset(self) -> None:
        self._tick()
        self.area, self.since, self.requests = 0.0, self.mark, 0
        self.prompt_tokens = self.cached_tokens = 0
        self.blocks.clear()

    def stats(self) -> dict[str, float]:
        self._tick()
        return {
            "inflight_area": self.area,
            "seconds": self.mark - self.since,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }

    def cache(self, prompt: str) -> None:
        """Count the cached tokens of prompt (its longest cached block prefix), then cache it."""
        tokens = prompt.split()
        self.prompt_tokens += len(tokens)
        h, hit, missed = 0, 0, False
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            h = hash((h, tuple(tokens[end - BLOCK : end])))
            if not missed and h in self.blocks:
                hit = end
            else:
                missed = True
                self.blocks.add(h)
        self.cached_tokens += hit

    async def complete(self, body: dict[str, Any]) -> None:
        self.requests += 1
        if "messages" in body:
            prompt = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            prompt = str(body.get("prompt", ""))
        self.cache(prompt)
        self._tick()
        self.inflight += 1
        try:
            delay = self.config["service_ms"] + self.config["ms_per_token"] * float(
                body.get("max_tokens") or 0
            )
            if delay > 0:
                await asyncio.sleep(delay / 1e3)
        finally:
            self._tick()
            self.inflight -= 1


def _completion(chat: bool) -> bytes:
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
    else:
        choice = {"index": 0, "text": "ok"}
    choice["finish_reason"] = "stop"
    return json.dumps(
        {
            "id": "cmpl-0",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


_CHAT, _TEXT = _completion(True), _completion(False)
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
).encode()
_INFO = json.dumps(
    {"model_path": MODEL, "tokenizer_path": None, "is_generation": True, "status": "ok"}
).encode()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    n = int(headers.get("content-length", "0"))
    return await reader.readexactly(n) if n else b""


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers


def _response(status: int, body: bytes) -> bytes:
    reason = {200: "OK", 404: "Not Found", 400: "Bad Request"}.get(status, "OK")
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _route(rep: _Replica, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    path = path.split("?", 1)[0]
    if method == "POST" and path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        await rep.complete(json.loads(body or b"{}"))
        return 200, _CHAT if "chat" in path else _TEXT
    if path == "/stats":
        return 200, json.dumps(rep.stats()).encode()
    if method == "POST" and path == "/reset":
        rep.reset()
        return 200, b"{}"
    if method == "POST" and path == "/config":
        rep.config.update({k: float(v) for k, v in json.loads(body).items()})
        return 200, b"{}"
    if path == "/v1/models":
        return 200, _MODELS
    if method == "GET":  # /health, /health_generate, /get_model_info, /get_server_info, ...
        return 200, _INFO
    return 404, b"{}"


async def _serve_conn(
    rep: _Replica, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, headers = _parse_head(head)
            parts = line.split(" ")
            if len(parts) < 3:  # not HTTP/1.x (an HTTP/2 preface, a probe): hang up
                return
            method, path = parts[0], parts[1]
            body = await _read_body(reader, headers)
            status, out = await _route(rep, method, path, body)
            writer.write(_response(status, out))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
        pass
    finally:
        writer.close()


async def _serve(ports: list[int], ready: Any) -> None:
    servers = []
    for port in ports:
        rep = _Replica({"service_ms": 0.0, "ms_per_token": 0.0})

        async def handle(
            r: asyncio.StreamReader, w: asyncio.StreamWriter, rep: _Replica = rep
        ) -> None:
            await _serve_conn(rep, r, w)

        servers.append(await asyncio.start_server(handle, HOST, port, backlog=1024))
    ready.put(True)
    await asyncio.Event().wait()


def _replicas_main(ports: list[int], ready: Any) -> None:
    asyncio.run(_serve(ports, ready))


class FakeReplicas:
    """N replicas on the given loopback ports, served by one child process."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.urls = [f"http://{HOST}:{p}" for p in ports]
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        self._proc = ctx.Process(target=_replicas_main, args=(ports, ready), daemon=True)
        self._proc.start()
        if not ready.get(timeout=30):
            raise RuntimeError("the fake replicas did not start")

    def _post(self, path: str, body: dict[str, Any]) -> None:
        for port in self.ports:
            status, _ = sync_request(HOST, port, "POST", path, body)
            if status != 200:
                raise RuntimeError(f"replica {port}: {path} answered {status}")

    def configure(self, service_ms: float = 0.0, ms_per_token: float = 0.0) -> None:
        self._post("/config", {"service_ms": service_ms, "ms_per_token": ms_per_token})

    def reset(self) -> None:
        self._post("/reset", {})

    def stats(self) -> list[dict[str, float]]:
        out = []
        for port in self.ports:
            _, body = sync_request(HOST, port, "GET", "/stats", None)
            out.append(json.loads(body))
        return out

    def close(self) -> None:
        self._proc.terminate()
        self._proc.join(10)


def sync_request(
    host: str, port: int, method: str, path: str, body: dict[str, Any] | None
) -> tuple[int, bytes]:
    """One request on a fresh connection (control calls, not timed)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class SyncClient:
    """Keep-alive ``http.client`` connections, one per base URL, as a sync worker would hold."""

    def __init__(self) -> None:
        self._conns: dict[str, http.client.HTTPConnection] = {}

    def post(self, base: str, path: str, body: bytes) -> bytes:
        conn = self._conns.get(base)
        if conn is None:
            host, port = base.removeprefix("http://").split(":")
            conn = self._conns[base] = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{base}{path} answered {resp.status}: {out[:200]!r}")
        return out

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


class AsyncClient:
    """A keep-alive HTTP/1.1 client for asyncio: a pool of idle connections per base URL."""

    def __init__(self) -> None:
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def post(
        self, base: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> bytes:
        idle = self._idle.setdefault(base, [])
        if idle:
            reader, writer = idle.pop()
        else:
            host, port = base.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        writer.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: {base[7:]}\r\nContent-Type: application/json\r\n"
                f"{extra}Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, headers = _parse_head(head)
            out = await _read_body(reader, headers)
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            idle.append((reader, writer))
        status = int(line.split(" ")[1])
        if status != 200:
            raise RuntimeError(f"{base}{path} answered {status}: {out[:200]!r}")
        return out

    async def close(self) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()


def completion_body(prompt: str, max_tokens: int = 1) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": False}
    ).encode()
