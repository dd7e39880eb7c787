"""Every router in the library and in plugins/ is a RequestLoadBalancer (structural typing)."""

from __future__ import annotations

import asyncio
import importlib
from pathlib import Path

import pytest

from redis_router import (
    AsyncRedisLoadBalancer,
    AsyncRequestLoadBalancer,
    RedisLoadBalancer,
    RequestLoadBalancer,
    VerlRouter,
)
from redis_router.protocol import CLIENT_METHODS, METHODS, missing_methods

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def test_protocol_has_verls_ten_methods():
    assert len(METHODS) == 10
    for name in METHODS:
        assert callable(getattr(RequestLoadBalancer, name))
    assert set(CLIENT_METHODS) < set(METHODS)


def test_clear_sticky_cache_returns_verls_report_on_both_balancers(server):
    """verl's fully-async rollouter reads result["cleared_entries"], result["server_loads"]."""
    servers = {"s0": None, "s1": None}
    sync = RedisLoadBalancer(servers, redis=server.url, name="report")
    placed = sync.acquire_server("a")[0]
    sync.release_server(placed, "a")
    held = sync.acquire_server("b")[0]  # still in flight
    assert sync.clear_sticky_cache() == {
        "cleared_entries": 2,
        "server_loads": {sid: int(sid == held) for sid in servers},
    }
    assert sync.clear_sticky_cache()["cleared_entries"] == 0

    async def main() -> None:
        lb = AsyncRedisLoadBalancer(redis=server.url, name="report")
        await lb.acquire_server("c")
        report = await lb.clear_sticky_cache()
        assert report["cleared_entries"] == 1 and sum(report["server_loads"].values()) == 2
        await lb.close()

    asyncio.run(main())
    sync.close()


@pytest.mark.parametrize("cls", [RedisLoadBalancer, AsyncRedisLoadBalancer, VerlRouter])
def test_library_routers_satisfy_the_protocol(cls, server):
    lb = cls({"s0": None}, router_kwargs={"redis": server.url, "name": "proto"})
    assert isinstance(lb, RequestLoadBalancer)
    assert missing_methods(lb) == []


def test_async_balancer_satisfies_the_async_protocol(server):
    assert isinstance(AsyncRedisLoadBalancer(redis=server.url), AsyncRequestLoadBalancer)


def test_every_plugin_class_satisfies_the_protocol(server):
    """Each router class a plugin module defines (a class with acquire_server), constructed
    from its YAML arguments, is a RequestLoadBalancer."""
    found = 0
    for path in sorted(PLUGINS.glob("*.py")):
        module = importlib.import_module(f"redis_router.plugins.{path.stem}")
        for obj in vars(module).values():
            mine = isinstance(obj, type) and obj.__module__ == module.__name__
            if mine and hasattr(obj, "acquire_server"):
                assert missing_methods(obj) == [], obj
                lb = obj({"s0": None}, router_kwargs={"redis": server.url, "name": "p"})
                assert isinstance(lb, RequestLoadBalancer), obj
                found += 1
    assert found >= 2  # at least least_tokens' sync and async routers


def test_an_object_missing_a_method_is_not_a_balancer():
    class Partial:
        def acquire_server(self, request_id):
            return "s0", None

    assert not isinstance(Partial(), RequestLoadBalancer)
    assert "release_server" in missing_methods(Partial)
