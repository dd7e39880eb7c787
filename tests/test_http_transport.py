"""The in-process httpx transports, driven by the real ``openai`` clients (sync and asyncio)
against fake replicas in subprocesses, on every server binary: the same session, lease and
failure rules as `redis-router serve`, without the hop."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer
from redis_router.http import AsyncRouterTransport, RouterTransport

from .test_http_serve import CHAT, Procs, register, state, stats, until

pytestmark = pytest.mark.slow


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.stop()


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return f"tr-{request.node.name[:40]}".replace("[", "-").replace("]", "")


def total(server, name) -> int:
    return int(state(server, name)["total_inflight"])


def released(server, name) -> None:
    """Wait (bounded) until no lease is counted: a release is queued, not waited for, and a
    reader on another connection may get to Redis before it."""
    until(lambda: total(server, name) == 0, "every lease released")


@pytest.mark.quick  # the module's test in the quick tier
def test_async_openai_client_keeps_sessions_and_releases_after_each_response(server, procs, name):
    replicas = procs.replicas(3)
    register(server, name, replicas)

    async def main() -> dict[str, set[str]]:
        # Seeded: each session is new while nothing is in flight, a three-way tie each time;
        # a fixed draw keeps "spread over more than one" from failing 1 run in 243.
        rng = random.Random(5)
        async with AsyncRedisLoadBalancer(redis=server.url, name=name, rng=rng) as lb:
            client = openai.AsyncOpenAI(
                base_url="http://router/v1",
                api_key="unused",
                max_retries=0,
                http_client=httpx.AsyncClient(transport=AsyncRouterTransport(lb), timeout=30),
            )
            served: dict[str, set[str]] = {}
            for turn in range(3):
                for s in range(6):
                    session = f"agent-{s}"
                    headers = {"X-Session-ID": session}
                    if turn % 2 == 0:
                        raw = await client.chat.completions.with_raw_response.create(
                            model="m", messages=CHAT, extra_headers=headers
                        )
                        answer = raw.parse()
                        replica = answer.model_extra["replica"]
                        assert "x-replica-id" not in raw.headers  # no router hop in between
                    else:
                        stream = await client.chat.completions.create(
                            model="m", messages=CHAT, stream=True, extra_headers=headers
                        )
                        text, replica = "", ""
                        async for chunk in stream:
                            replica = chunk.model_extra["replica"]
                            text += chunk.choices[0].delta.content or ""
                            assert await asyncio.to_thread(total, server, name) == 1
                        assert text.startswith(f"{replica}-w0")
                    served.setdefault(session, set()).add(replica)
                    await asyncio.to_thread(released, server, name)
            await client.close()
            return served

    served = asyncio.run(main())
    assert all(len(w) == 1 for w in served.values()), served
    assert len({next(iter(w)) for w in served.values()}) > 1
    snap = state(server, name)
    assert sum(r["sticky_hits"] for r in snap["replicas"].values()) == 6 * 2


def test_sync_openai_client_streams_and_completes_through_the_transport(
    server, procs, name, make_lb
):
    replicas = procs.replicas(2)
    register(server, name, replicas)
    lb = make_lb(name=name)
    client = openai.OpenAI(
        base_url="http://router/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=RouterTransport(lb), timeout=30),
    )
    done = client.completions.create(model="m", prompt="The capital of France is")
    assert done.choices[0].text.startswith(done.model_extra["replica"])
    words = []
    for chunk in client.chat.completions.create(model="m", messages=CHAT, stream=True):
        words.append(chunk.choices[0].delta.content)
        assert total(server, name) == 1
    assert len(words) == 4
    released(server, name)
    assert sum(r["acquires"] for r in state(server, name)["replicas"].values()) == 2
    client.close()


def test_a_stream_closed_early_frees_its_lease(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)

    async def main() -> None:
        async with AsyncRedisLoadBalancer(redis=server.url, name=name) as lb:
            transport = AsyncRouterTransport(lb)
            async with httpx.AsyncClient(transport=transport, timeout=30) as client:
                body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 500}
                async with client.stream(
                    "POST", "http://router/v1/chat/completions", json=body,
                    headers={"X-Fake-Delay": "0.05"},
                ) as resp:  # fmt: skip
                    async for _ in resp.aiter_bytes():
                        break
                    assert await asyncio.to_thread(total, server, name) == 1
                await asyncio.to_thread(released, server, name)  # closed: released

    asyncio.run(main())
    until(lambda: stats(replicas["r0"])["broken_off"] == 1, "the replica to see the close")


def test_a_dead_replica_is_reported_and_its_requests_retried_elsewhere(
    server, procs, name, make_lb
):
    replicas = procs.replicas(2)
    register(server, name, replicas)
    procs.kill("r1")
    lb = make_lb(name=name, eject_after=1, eject_for=120.0)
    with httpx.Client(transport=RouterTransport(lb), timeout=30) as client:
        for _ in range(12):
            resp = client.post("http://router/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 200 and resp.json()["replica"] == "r0"
    r1 = state(server, name)["replicas"]["r1"]
    assert r1["failures"] == 1 and r1["ejected_until"]  # the first failure ejected it
    assert stats(replicas["r0"])["served"] == {"/v1/completions": 12}
    released(server, name)


def test_malformed_requests_and_an_empty_pool_get_openai_errors(server, procs, name, make_lb):
    lb = make_lb(name=name)
    client = openai.OpenAI(
        base_url="http://router/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=RouterTransport(lb), timeout=30),
    )
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        client.chat.completions.create(model="m", messages=[{"content": "x"}])  # type: ignore
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="m", prompt="x")
    assert exc.value.status_code == 503
    assert exc.value.response.headers["Retry-After"] == "1"
    assert exc.value.body["type"] == "no_servers_available"
    client.close()
    with pytest.raises(TypeError, match="sync balancer"):
        RouterTransport(AsyncRedisLoadBalancer(redis=server.url, name=name))
    with pytest.raises(TypeError, match="asyncio balancer"):
        AsyncRouterTransport(RedisLoadBalancer(redis=server.url, name=name))


def test_a_replica_that_dies_mid_stream_is_reported_to_the_balancer(server, procs, name, make_lb):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    lb = make_lb(name=name)
    body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 500}
    with httpx.Client(transport=RouterTransport(lb), timeout=30) as client, client.stream(
        "POST", "http://router/v1/chat/completions", json=body,
        headers={"X-Fake-Delay": "0.05"},
    ) as resp:  # fmt: skip
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        procs.kill("r0")
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in lines:
                pass
    r0 = state(server, name)["replicas"]["r0"]
    assert r0["failures"] == 1 and r0["inflight"] == 0


def test_a_timeout_is_reported_and_raised_not_retried(server, procs, name, make_lb):
    replicas = procs.replicas(2)
    register(server, name, replicas)
    lb = make_lb(name=name)
    transport = RouterTransport(lb)
    client = httpx.Client(transport=transport, timeout=httpx.Timeout(30, read=0.5))
    with client, pytest.raises(httpx.ReadTimeout):
        client.post(
            "http://router/v1/completions",
            json={"prompt": "x", "max_tokens": 100},
            headers={"X-Fake-Delay": "0.1"},  # 10 s of generation
        )
    snap = state(server, name)
    assert sum(r["failures"] for r in snap["replicas"].values()) == 1
    assert snap["total_inflight"] == 0
    assert sum(stats(u)["served"].get("/v1/completions", 0) for u in replicas.values()) == 1


def test_serve_and_the_transport_are_one_balancer(server, procs, name, make_lb):
    """A session begun through a serve instance goes on through an in-process transport to
    the same replica, and back: they share the balancer's state in Redis, nothing else."""
    replicas = procs.replicas(3)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    lb = make_lb(name=name)
    direct = httpx.Client(transport=RouterTransport(lb), base_url="http://router", timeout=30)
    via = httpx.Client(base_url=front, timeout=30)
    with direct, via:
        for s in range(6):
            headers = {"X-Session-ID": f"mixed-{s}"}
            body = {"model": "m", "messages": CHAT}
            where = {
                client.post("/v1/chat/completions", json=body, headers=headers).json()["replica"]
                for client in (via, direct, via, direct)
            }
            assert len(where) == 1, where
    snap = state(server, name)
    assert sum(r["sticky_hits"] for r in snap["replicas"].values()) == 6 * 3


def test_closing_a_response_does_not_wait_for_redis(private, procs, name):
    """The release is queued when the response closes and answered in the background: with
    the server stopped (SIGSTOP) right after the response arrived, reading and closing it
    still returns (bounded by the stall, never by it), and once the server goes on the lease
    ends: the count is back to 0."""
    replicas = procs.replicas(1)
    register(private, name, replicas)
    assert private.pid is not None

    async def main() -> float:
        async with AsyncRedisLoadBalancer(redis=private.url, name=name) as lb:
            transport = AsyncRouterTransport(lb)
            async with httpx.AsyncClient(transport=transport, timeout=30) as client:
                body = {"model": "m", "prompt": "x", "max_tokens": 1}
                await client.post("http://router/v1/completions", json=body)  # warm
                async with client.stream("POST", "http://router/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    os.kill(private.pid, signal.SIGSTOP)
                    try:
                        started = time.monotonic()
                        await resp.aread()
                        # (the with block closes the response: its release is queued there)
                    except BaseException:
                        os.kill(private.pid, signal.SIGCONT)
                        raise
                closed_after = time.monotonic() - started
                stopped_for = 2.0
                await asyncio.sleep(stopped_for)  # the release waits in the pipe meanwhile
                os.kill(private.pid, signal.SIGCONT)
                assert closed_after < stopped_for
                return closed_after

    asyncio.run(main())
    until(lambda: total(private, name) == 0, "the queued release to end the lease")
