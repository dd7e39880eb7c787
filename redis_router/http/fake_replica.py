"""A tiny OpenAI-compatible replica for the docs' example, the demo and the tests: it
answers /v1/chat/completions, /v1/completions and SGLang's /generate (streamed as SSE or
not) with words that name it, so one can see where each request went.

    python -m redis_router.http.fake_replica --id r0 --port 8001 [--delay 0.05]

It generates ``max_tokens`` words (default 4), one every ``--delay`` seconds (a request's
``X-Fake-Delay`` header overrides it); ``X-Fake-Status: 503`` makes it answer that status;
``--auth USER:PASSWORD`` makes it answer 401 to a request without that Basic authorization.
``GET /stats`` says what it served: requests by path, in flight now, the most in flight at
once, streams the client broke off, the request ids it was asked to abort, and the
data-parallel rank each generation request named (vLLM's header, SGLang's body field).
``GET /metrics`` answers vLLM's load gauges as vLLM names them (requests in flight as running,
none waiting), for ``redis-router load``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import time
from typing import Any

from aiohttp import web

from ..dp import SGLANG_FIELD, VLLM_HEADER


class FakeReplica:
    def __init__(self, replica_id: str, delay: float, model: str, auth: str | None = None) -> None:
        self.id, self.delay, self.model = replica_id, delay, model
        self.auth = None if auth is None else "Basic " + base64.b64encode(auth.encode()).decode()
        self.served: dict[str, int] = {}
        self.inflight = self.peak = self.broken_off = 0
        self.aborted: list[str] = []
        self.sessions: list[str] = []
        self.headers: list[list[str]] = []  # the header names of each generation request
        # each generation request's data-parallel rank: [vLLM's header, SGLang's body field]
        self.dp_ranks: list[list[Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/abort_request", self.abort)
        return app

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.auth is not None and request.headers.get("Authorization") != self.auth:
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        forced = request.headers.get("X-Fake-Status")
        if forced:
            return web.json_response({"error": {"message": "forced"}}, status=int(forced))
        self.served[request.path] = self.served.get(request.path, 0) + 1
        self.sessions.append(request.headers.get("X-Session-ID", ""))
        self.headers.append(sorted(k.lower() for k in request.headers))
        self.dp_ranks.append([request.headers.get(VLLM_HEADER), body.get(SGLANG_FIELD)])
        cookie = request.headers.get("X-Fake-Set-Cookie")  # answered with Set-Cookie: <it>
        words = [f"{self.id}-w{i}" for i in range(int(body.get("max_tokens") or 4))]
        delay = float(request.headers.get("X-Fake-Delay", self.delay))
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            if body.get("stream"):
                return await self._stream(request, words, delay)
            await asyncio.sleep(delay * len(words))
            extra = {"Set-Cookie": cookie} if cookie else None
            return web.json_response(self._answer(request.path, " ".join(words)), headers=extra)
        finally:
            self.inflight -= 1

    async def _stream(
        self, request: web.Request, words: list[str], delay: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, word in enumerate(words):
                await asyncio.sleep(delay)
                chunk = self._chunk(request.path, word + (" " if i < len(words) - 1 else ""))
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.broken_off += 1
            raise
        return resp

    def _answer(self, path: str, text: str) -> dict[str, Any]:
        base = {"id": f"cmpl-{time.monotonic_ns()}", "model": self.model, "replica": self.id}
        if path == "/generate":
            return {"text": text, "meta_info": {"replica": self.id}}
        if path == "/v1/completions":
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            return {**base, "object": "text_completion", "created": 0, "choices": [choice]}
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return {
            **base,
            "object": "chat.completion",
            "created": 0,
            "choices": [choice],
            "usage": usage,
        }

    def _chunk(self, path: str, text: str) -> dict[str, Any]:
        if path == "/generate":
            return {"text": text, "meta_info": {"replica": self.id}}
        base = {"id": "chunk", "model": self.model, "created": 0, "replica": self.id}
        if path == "/v1/completions":
            choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
            return {**base, "object": "text_completion", "choices": [choice]}
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        return {**base, "object": "chat.completion.chunk", "choices": [choice]}

    async def models(self, _request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": self.id}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "id": self.id,
                "served": self.served,
                "inflight": self.inflight,
                "peak": self.peak,
                "broken_off": self.broken_off,
                "aborted": self.aborted,
                "sessions": self.sessions,
                "headers": self.headers,
                "dp_ranks": self.dp_ranks,
            }
        )

    async def metrics(self, _request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{self.model}"}}'
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(self.inflight)}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} 0.0\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def abort(self, request: web.Request) -> web.Response:
        rid = (await request.json()).get("rid")
        self.aborted.append(str(rid))
        return web.json_response({"aborted": rid, "replica": self.id})


async def serve(replica: FakeReplica, host: str, port: int) -> None:
    runner = web.AppRunner(replica.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    print(f"fake replica {replica.id} on http://{bound[0]}:{bound[1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--id", required=True, help="the replica id it names itself by")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free one (printed)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds per generated word")
    p.add_argument("--model", default="fake-model", help="the model name it serves")
    p.add_argument("--auth", metavar="USER:PASSWORD", help="Basic authorization it requires")
    args = p.parse_args(argv)
    replica = FakeReplica(args.id, args.delay, args.model, args.auth)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(replica, args.host, args.port))


if __name__ == "__main__":
    main()
