"""The verl drop-in, run the way verl runs it: a Ray actor called from two worker actors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from redis_router import RequestLoadBalancer, VerlRouter

from . import invariants

ray = pytest.importorskip("ray")

VERL_YAML = Path(__file__).resolve().parents[1] / "plugins" / "verl.yaml"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Replica:
    """Stands in for a vLLM/SGLang server actor: proves the handle crosses Ray intact."""

    def __init__(self, sid: str) -> None:
        self.sid = sid

    def generate(self, request_id: str) -> str:
        return self.sid


@ray.remote(num_cpus=0)
class Worker:
    """verl's LLMServerClient, reduced to its router calls (agent_loop.py): the declarations
    asked once and concurrently, only declared fields sent, release fired without waiting."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.acquire_fields: list[str] | None = None
        self.release_fields: list[str] = []

    async def generate(self, request_id: str, prompt_ids: list[int]) -> tuple[str, str]:
        if self.acquire_fields is None:
            self.acquire_fields, self.release_fields = await asyncio.gather(
                self.router.require_acquire_fields.remote(),
                self.router.require_release_fields.remote(),
            )
        extra = {"prompt_ids": prompt_ids, "sampling_params": {}}
        fields = {k: extra[k] for k in self.acquire_fields if k in extra}
        server_id, server = await self.router.acquire_server.remote(request_id=request_id, **fields)
        try:
            answered_by = await server.generate.remote(request_id)
        finally:
            pool = {"request_id": request_id}
            rel = {k: pool[k] for k in self.release_fields if k in pool}
            self.router.release_server.remote(server_id=server_id, **rel)
        return server_id, answered_by

    async def try_acquire(self, request_id: str) -> str:
        try:
            await self.router.acquire_server.remote(request_id=request_id)
        except RuntimeError as exc:  # verl's FullyAsyncLLMServerClient matches this text
            return str(exc)
        return "granted"


def verl_config(server: Any, name: str, **extra: Any) -> dict[str, Any]:
    """plugins/verl.yaml read the way verl reads it (OmegaConf, resolved), on our server."""
    cfg = OmegaConf.to_container(OmegaConf.load(VERL_YAML), resolve=True)
    assert isinstance(cfg, dict)
    return {**cfg, "redis": server.url, "name": name, **extra}


def wait_idle(r: Any, name: str) -> dict[str, int]:
    """verl fires releases without awaiting them: wait (up to 30 s) until they have landed."""
    deadline = time.monotonic() + 30
    while True:
        counts = invariants.check(r, name)
        if sum(counts.values()) == 0 or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def test_verl_yaml_names_this_class_and_takes_the_url_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:6380/2")
    cfg = OmegaConf.to_container(OmegaConf.load(VERL_YAML), resolve=True)
    assert cfg["router_class"] == "redis_router.verl.VerlRouter"
    assert cfg["redis"] == "redis://example:6380/2"
    assert cfg["name"]


def test_two_ray_workers_share_one_router_actor(ray_session, server, r):
    servers = {f"s{i}": Replica.remote(f"s{i}") for i in range(3)}
    router = ray.remote(VerlRouter).remote(
        servers=servers, router_kwargs=verl_config(server, "verl-a")
    )
    workers = [Worker.remote(router), Worker.remote(router)]
    calls = [workers[i % 2].generate.remote(f"req-{i}", [1, 2, 3]) for i in range(40)]
    results = ray.get(calls)
    assert all(sid == answered for sid, answered in results)  # the handle reached the replica
    assert {sid for sid, _ in results} == set(servers)
    # Sticky across workers: a session's later turn from the other worker hits the same replica.
    first = ray.get(workers[0].generate.remote("session-x", [1]))
    again = ray.get(workers[1].generate.remote("session-x", [1, 2]))
    assert first[0] == again[0]
    assert wait_idle(r, "verl-a") == dict.fromkeys(servers, 0)
    assert ray.get(router.get_total_inflight.remote()) == 0
    status = ray.get(router.get_status.remote())
    assert sum(rep["acquires"] for rep in status["replicas"].values()) == 42


def test_least_tokens_under_verl_gets_prompt_ids(ray_session, server, r):
    servers = {f"s{i}": Replica.remote(f"s{i}") for i in range(2)}
    cfg = verl_config(
        server, "verl-lt", balancer_class="redis_router.plugins.least_tokens.AsyncLeastTokensRouter"
    )
    router = ray.remote(VerlRouter).remote(servers, cfg)  # verl's positional form
    assert ray.get(router.require_acquire_fields.remote()) == ["prompt_ids"]
    assert ray.get(router.require_release_fields.remote()) == ["request_id"]
    sid, handle = ray.get(router.acquire_server.remote(request_id="big", prompt_ids=[0] * 500))
    assert ray.get(handle.generate.remote("big")) == sid
    assert r.zscore("rr:{verl-lt}:weighted", sid) == 500
    worker = Worker.remote(router)
    ray.get([worker.generate.remote(f"w{i}", [0] * 10) for i in range(6)])
    ray.get(router.release_server.remote(server_id=sid, request_id="big"))
    assert wait_idle(r, "verl-lt") == dict.fromkeys(servers, 0)
    assert r.exists("rr:{verl-lt}:weights") == 0


def test_newer_config_form_and_empty_pool_error_text(ray_session, server):
    router = ray.remote(VerlRouter).remote(
        servers={}, config={"redis": server.url, "name": "verl-empty", "full_determinism": True}
    )
    assert ray.get(router.get_status.remote())["full_determinism"] is True
    message = ray.get(Worker.remote(router).try_acquire.remote("r"))
    assert "No available servers in load balancer" in message


def test_satisfies_the_protocol_locally(server):
    router = VerlRouter({"s0": None}, {"router_class": "x", "redis": server.url, "name": "vl"})
    assert isinstance(router, RequestLoadBalancer)

    async def main() -> None:
        assert await router.acquire_server("a") == ("s0", None)
        assert await router.release_server("s0")
        await router.close()

    asyncio.run(main())


def test_config_given_twice_is_refused():
    with pytest.raises(TypeError, match="not both"):
        VerlRouter({}, router_kwargs={}, config={})
