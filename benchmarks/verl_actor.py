"""The baseline users run today: verl's GlobalRequestLoadBalancer, hosted in one Ray actor.

Faithful to verl's own balancer (verl/workers/rollout/llm_server.py after the random tie-break fix):
a sticky dict request id -> server id, an in-flight count per server, least-loaded with
``random.choice`` among the equal minima; every AgentLoopWorker calls the one actor.
Like verl's client, workers await the acquire and send the release fire-and-forget.
Imported only when Ray is installed.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import ray


@ray.remote(num_cpus=0)
class GlobalRequestLoadBalancer:
    """One actor shared by every worker: its methods run one at a time."""

    def __init__(self, servers: dict[str, Any]) -> None:
        self._servers = dict(servers)
        self._inflight_requests = dict.fromkeys(servers, 0)
        self._request_id_to_server: dict[str, str] = {}

    def acquire_server(self, request_id: str) -> tuple[str, Any]:
        if request_id in self._request_id_to_server:
            server_id = self._request_id_to_server[request_id]
            if server_id in self._inflight_requests:
                self._inflight_requests[server_id] += 1
                return server_id, self._servers[server_id]
            del self._request_id_to_server[request_id]
        if not self._inflight_requests:
            raise RuntimeError("No available servers in load balancer")
        min_count = min(self._inflight_requests.values())
        candidates = [sid for sid, c in self._inflight_requests.items() if c == min_count]
        server_id = random.choice(candidates)
        self._request_id_to_server[request_id] = server_id
        self._inflight_requests[server_id] += 1
        return server_id, self._servers[server_id]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        if server_id in self._inflight_requests:
            self._inflight_requests[server_id] = max(0, self._inflight_requests[server_id] - 1)

    def get_total_inflight(self) -> int:
        return sum(self._inflight_requests.values())


@ray.remote(num_cpus=0)
class AgentLoopWorker:
    """A worker process with `concurrency` asyncio sessions, as verl's AgentLoopWorker."""

    def __init__(self, balancer: Any) -> None:
        self._lb = balancer

    async def ready(self) -> bool:
        sid, _ = await self._lb.acquire_server.remote(uuid.uuid4().hex)
        self._lb.release_server.remote(server_id=sid)
        return True

    async def run(self, start_at: float, seconds: float, concurrency: int) -> int:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = start_at + seconds

        async def session() -> int:
            pairs = 0
            while time.time() < deadline:
                sid, _ = await self._lb.acquire_server.remote(uuid.uuid4().hex)
                self._lb.release_server.remote(server_id=sid)
                pairs += 1
            return pairs

        return sum(await asyncio.gather(*(session() for _ in range(concurrency))))
