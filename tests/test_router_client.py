"""RouterClient: declared fields asked once, only those sent, release always."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from redis_router import AsyncRedisLoadBalancer, RouterClient, RouterConfigError
from redis_router.plugins.least_tokens import LeastTokensRouter

from . import invariants

SERVERS = {f"s{i}": None for i in range(3)}


class Fake:
    """A sync balancer that records every call (the protocol, nothing more)."""

    def __init__(self, acquire: list[str], release: list[str]) -> None:
        self.declared = acquire, release
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.asked = 0

    def require_acquire_fields(self) -> list[str]:
        self.asked += 1
        return self.declared[0]

    def require_release_fields(self) -> list[str]:
        return self.declared[1]

    def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Any]:
        self.calls.append(("acquire", {"request_id": request_id, **fields}))
        return "s0", "handle-0"

    def release_server(self, server_id: str, request_id: str | None = None, **fields: Any) -> bool:
        self.calls.append(("release", {"server_id": server_id, "request_id": request_id, **fields}))
        return True

    def add_servers(self, servers: Any) -> int:
        return 0

    def remove_servers(self, server_ids: Any) -> int:
        return 0

    def get_all_servers(self) -> list[str]:
        return ["s0"]

    def get_status(self) -> dict[str, Any]:
        return {}

    def clear_sticky_cache(self) -> None:
        return None

    def get_total_inflight(self) -> int:
        return 0


class Legacy(Fake):
    """The older signature: release_server(server_id) only."""

    def release_server(self, server_id: str) -> None:  # type: ignore[override]
        self.calls.append(("release", {"server_id": server_id}))


class AsyncFake(Fake):
    """Async methods; both declarations must be in flight at once, or neither returns."""

    def __init__(self, acquire: list[str], release: list[str]) -> None:
        super().__init__(acquire, release)
        self.a_in, self.r_in = asyncio.Event(), asyncio.Event()

    async def require_acquire_fields(self) -> list[str]:  # type: ignore[override]
        self.asked += 1
        self.a_in.set()
        await self.r_in.wait()
        return self.declared[0]

    async def require_release_fields(self) -> list[str]:  # type: ignore[override]
        self.r_in.set()
        await self.a_in.wait()
        return self.declared[1]

    async def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Any]:  # type: ignore[override]
        await asyncio.sleep(0)
        return Fake.acquire_server(self, request_id, **fields)

    async def release_server(  # type: ignore[override]
        self, server_id: str, request_id: str | None = None, **fields: Any
    ) -> bool:
        return Fake.release_server(self, server_id, request_id, **fields)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))  # a deadlock fails instead of hanging


def test_only_declared_fields_are_sent():
    fake = Fake(["prompt_ids"], ["request_id"])
    client = RouterClient(fake)

    async def main() -> None:
        async with client.session("r1", prompt_ids=[1, 2], sampling_params={"t": 1}) as got:
            assert got == ("s0", "handle-0")

    run(main())
    assert fake.calls == [
        ("acquire", {"request_id": "r1", "prompt_ids": [1, 2]}),
        ("release", {"server_id": "s0", "request_id": "r1"}),
    ]


def test_a_router_declaring_nothing_gets_nothing_extra():
    fake = Fake([], [])
    with RouterClient(fake).session_sync("r1", prompt_ids=[1], sampling_params={}) as got:
        assert got[0] == "s0"
    assert fake.calls == [
        ("acquire", {"request_id": "r1"}),
        ("release", {"server_id": "s0", "request_id": None}),  # request_id not sent: default
    ]


def test_declared_field_that_was_not_given_is_left_out():
    fake = Fake(["prompt_ids", "image_data"], [])
    with RouterClient(fake).session_sync("r1", prompt_ids=[1]):
        pass
    assert fake.calls[0] == ("acquire", {"request_id": "r1", "prompt_ids": [1]})


def test_legacy_release_signature_still_works():
    fake = Legacy([], ["request_id"])
    client = RouterClient(fake)

    async def main() -> None:
        async with client.session("r1"):
            pass

    run(main())
    with client.session_sync("r2"):
        pass
    assert [c for c in fake.calls if c[0] == "release"] == [("release", {"server_id": "s0"})] * 2


def test_fields_are_asked_once_both_at_once_and_cached():
    fake = AsyncFake(["prompt_ids"], [])  # answers only if both questions are in flight together
    client = RouterClient(fake)

    async def main() -> None:
        await asyncio.gather(*(client.acquire(f"r{i}", prompt_ids=[i]) for i in range(20)))
        await client.acquire("later")

    run(main())
    assert fake.asked == 1
    assert len([c for c in fake.calls if c[0] == "acquire"]) == 21


def test_concurrent_first_sync_callers_ask_once():
    fake = Fake([], [])
    client = RouterClient(fake)

    async def main() -> None:  # a sync balancer driven from asyncio: calls run in threads
        await asyncio.gather(*(client.acquire(f"r{i}") for i in range(20)))

    run(main())
    assert fake.asked == 1


def test_a_failed_question_is_asked_again():
    fake = Fake([], [])
    boom = [RuntimeError("redis down")]

    def flaky() -> list[str]:
        fake.asked += 1
        if boom:
            raise boom.pop()
        return []

    fake.require_acquire_fields = flaky  # type: ignore[method-assign]
    client = RouterClient(fake)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="redis down"):
            await client.fields()
        assert await client.fields() == ((), ())

    run(main())
    assert fake.asked == 2


def test_release_runs_when_the_body_raises_or_is_cancelled():
    fake = AsyncFake([], ["request_id"])
    client = RouterClient(fake)

    async def main() -> None:
        with pytest.raises(ValueError):
            async with client.session("boom"):
                raise ValueError

        inside = asyncio.Event()

        async def worker() -> None:
            async with client.session("cancelled"):
                inside.set()
                await asyncio.Event().wait()

        task = asyncio.ensure_future(worker())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    released = [c[1]["request_id"] for c in fake.calls if c[0] == "release"]
    assert released == ["boom", "cancelled"]


def test_not_a_balancer_is_refused():
    with pytest.raises(RouterConfigError, match="release_server"):
        RouterClient(object())


class PreProtocol:
    """A router older than the protocol: the four methods a client calls, nothing more."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def require_acquire_fields(self) -> list[str]:
        return []

    def require_release_fields(self) -> list[str]:
        return []

    def acquire_server(self, request_id: str) -> tuple[str, Any]:
        return "s0", "handle-0"

    def release_server(self, server_id: str) -> None:
        self.released.append(server_id)


def test_a_router_needs_only_the_methods_the_client_calls():
    router = PreProtocol()
    client = RouterClient(router)
    with client.session_sync("r1") as (sid, handle):
        assert (sid, handle) == ("s0", "handle-0")

    async def main() -> None:
        async with client.session("r2"):
            pass

    run(main())
    assert router.released == ["s0", "s0"]
    with pytest.raises(RouterConfigError, match=r"lacks \['release_server'\]"):
        RouterClient(
            type(
                "NoRelease",
                (),
                {k: v for k, v in vars(PreProtocol).items() if k != "release_server"},
            )()
        )


# -- against a real server --------------------------------------------------------------------


def test_drives_the_async_balancer_end_to_end(server, r):
    async def main() -> None:
        async with AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="rc-async") as alb:
            client = RouterClient(alb)
            async with client.session("chat", prompt_ids=[1, 2, 3]) as (sid, _):
                assert await alb.get_inflight_count(sid) == 1
                async with client.session("chat") as (again, _):
                    assert again == sid  # sticky
            assert await alb.get_total_inflight() == 0

    run(main())
    assert invariants.check(r, "rc-async") == dict.fromkeys(SERVERS, 0)


def test_drives_a_sync_plugin_from_asyncio_with_its_fields(server, r):
    lb = LeastTokensRouter(SERVERS, redis=server.url, name="rc-lt")
    client = RouterClient(lb)

    async def main() -> None:
        async with client.session("p", prompt_ids=list(range(40)), sampling_params={}) as (sid, _):
            weighted = r.zscore(invariants.prefix("rc-lt") + "weighted", sid)
            assert weighted == 40

    run(main())
    with client.session_sync("q", prompt_ids=[0] * 9):
        assert sum(s for _, s in r.zrange("rr:{rc-lt}:weighted", 0, -1, withscores=True)) == 9
    assert invariants.check(r, "rc-lt") == dict.fromkeys(SERVERS, 0)
    assert r.exists("rr:{rc-lt}:weights") == 0
    lb.close()


def test_session_sync_refuses_an_async_balancer(server):
    client = RouterClient(AsyncRedisLoadBalancer(redis=server.url))
    with pytest.raises(TypeError, match="async with"), client.session_sync("r"):
        pass
