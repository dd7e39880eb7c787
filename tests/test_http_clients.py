"""`redis-router serve` against clients that leave, stall or hold connections, and what its
answers show: leases end whatever moment a client goes away, a half-sent request or an idle
crowd cannot hold the front's connections, a replica's credentials never show, and methods
and the pool's admin calls are answered as docs/http.md says.

Serve runs as deployed (CLI subprocesses, fake replicas), except where its logs are read
(in-process, with caplog).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import select
import socket
import time

import httpx
import pytest

from redis_router.aio import AsyncRedisLoadBalancer
from redis_router.http.handlers import ServeOptions
from redis_router.http.metrics import Metrics
from redis_router.http.server import Front, running

from .test_http_serve import POLL_TIMEOUT, inflight, register, state, stats, until
from .test_http_serve import name as name  # the fixtures
from .test_http_serve import procs as procs

pytestmark = pytest.mark.slow


def _address(front: str) -> tuple[str, int]:
    host, port = front.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


# -- leases follow the client --------------------------------------------------------------


async def _client(host: str, port: int, rng: random.Random, body: bytes) -> None:
    """One client: sends its request, then mostly goes away at a random moment (a reset or
    a close), else reads the answer to its end."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    if rng.random() < 0.85:
        # Most while their acquire is in flight (the burst's first batches), the rest later:
        # while forwarded, mid-stream, after the answer.
        await asyncio.sleep(rng.uniform(0, 0.15 if rng.random() < 0.75 else 1.0))
        if rng.random() < 0.5:
            writer.transport.abort()
        else:
            writer.close()
        return
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(), 60)
    writer.close()


async def _burst(front: str, n: int, seed: int) -> None:
    host, port = _address(front)
    rng = random.Random(seed)
    plain = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
    stream = json.dumps({"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}).encode()
    await asyncio.gather(
        *(
            _client(host, port, random.Random(rng.random()), stream if i % 2 else plain)
            for i in range(n)
        )
    )


@pytest.mark.parametrize("pool", ["free", "full"])
def test_clients_that_go_away_at_any_moment_leave_no_lease_counted(server, procs, name, pool):
    """Bursts of clients that disconnect at seeded random moments: while their request waits
    for its acquire (in a full pool, for a place), as it is granted, while it is forwarded,
    mid-stream, after the answer. Once every client is gone, no lease of theirs stays
    counted."""
    replicas = procs.replicas(4, "--delay", "0.3")
    if pool == "full":  # 80 places for 250 clients: most wait their turn
        register(server, name, replicas, **dict.fromkeys(replicas, 20))
        (front,) = procs.fronts(server.url, name, 1, "--wait-timeout", "5")
    else:
        register(server, name, replicas)
        (front,) = procs.fronts(server.url, name, 1)
    for seed in range(5):
        asyncio.run(_burst(front, 250, seed))
    until(
        lambda: state(server, name)["total_inflight"] == 0,
        f"no lease left counted (left: {inflight(server, name)})",
    )
    snap = state(server, name)
    assert all(r["live_leases"] == 0 for r in snap["replicas"].values()), snap["replicas"]
    until(
        lambda: all(stats(u)["inflight"] == 0 for u in replicas.values()),
        "every upstream request closed",
    )
    # The front still serves.
    assert (
        httpx.post(f"{front}/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 200
    )


# -- connections a client holds ------------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed (or reset) the connection within ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            try:
                if sock.recv(65536) == b"":
                    return True
            except ConnectionError:
                return True
    return False


REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\n"
    b'Content-Length: 15\r\n\r\n{"prompt": "x"}'
)


def _answered(sock: socket.socket, sent: int = 0) -> bytes:
    """Send a request (its first ``sent`` bytes were sent already) on an open connection,
    kept alive, and read its answer's head."""
    sock.sendall(REQUEST[sent:])
    sock.settimeout(30)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_half_a_request_line_is_closed_after_the_header_timeout(server, procs, name):
    register(server, name, procs.replicas(1))
    (front,) = procs.fronts(server.url, name, 1, "--header-timeout", "1")
    address = _address(front)
    with socket.create_connection(address) as slow, socket.create_connection(address) as ok:
        sent = time.monotonic()
        slow.sendall(b"POST /v1/chat/compl")
        # A client that sends its headers in parts within the bound is served.
        ok.sendall(REQUEST[:20])
        time.sleep(0.5)
        assert _answered(ok, 20).startswith(b"HTTP/1.1 200")
        assert _closed_within(slow, 1 + 9), "half a request line still held 10 s on"
        held = time.monotonic() - sent
        assert held >= 0.9  # not before the bound
    print(f"half a request line held its connection {held:.2f} s (--header-timeout 1)")


def test_past_max_idle_connections_the_oldest_idle_are_closed(server, procs, name):
    register(server, name, procs.replicas(1))
    (front,) = procs.fronts(server.url, name, 1, "--max-idle-connections", "4")
    address = _address(front)
    socks = []
    try:
        for i in range(6):
            sock = socket.create_connection(address)
            socks.append(sock)
            if i == 1:  # one that served a request and was kept alive counts as idle too
                assert _answered(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.05)
        # 6 idle, 4 allowed: the first two went idle first and are closed.
        assert _closed_within(socks[0], POLL_TIMEOUT)
        assert _closed_within(socks[1], POLL_TIMEOUT)
        for sock in socks[2:]:
            assert not _closed_within(sock, 0.2)
        for sock in socks[2:]:  # still served
            assert _answered(sock).startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--header-timeout", "0", "header_timeout must be > 0 seconds"),
        ("--keepalive-timeout", "-1", "keepalive_timeout must be > 0 seconds"),
        ("--max-idle-connections", "0", "max_idle_connections must be an int >= 1"),
    ],
)
def test_connection_bounds_out_of_range_are_refused(server, procs, name, flag, value, named):
    proc = procs.start(
        "-m", "redis_router", "--redis", server.url, "--name", name, "serve", "--port", "0",
        flag, value, pipe_stderr=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == ""
    assert named in err and len(err.strip().splitlines()) == 1, err


# -- methods -------------------------------------------------------------------------------


@pytest.mark.quick  # the module's test in the quick tier
def test_a_method_a_path_does_not_take_is_405_naming_those_it_takes(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/abort_request"):
        resp = httpx.get(f"{front}{path}")
        assert resp.status_code == 405, path
        assert resp.headers["Allow"] == "POST"
        error = resp.json()["error"]
        assert error["type"] == "method_not_allowed_error" and "POST" in error["message"]
    resp = httpx.delete(f"{front}/v1/models")
    assert resp.status_code == 405 and resp.headers["Allow"] == "GET, HEAD"
    resp = httpx.put(f"{front}/workers")
    assert resp.status_code == 405 and resp.headers["Allow"] == "GET, HEAD, POST"
    assert httpx.get(f"{front}/nowhere").status_code == 404
    assert httpx.get(f"{front}/v1/chat/completions/x").status_code == 404
    assert inflight(server, name) == {"r0": 0} and stats(replicas["r0"])["served"] == {}


# -- the pool ------------------------------------------------------------------------------


def test_post_workers_registers_a_replica_by_its_data_parallel_ranks(server, procs, name):
    replicas = procs.replicas(1)
    (front,) = procs.fronts(server.url, name, 1)
    with httpx.Client(base_url=front, timeout=30) as client:
        for bad, param in (
            ({"dp_size": 0}, "dp_size"),
            ({"dp_size": 1025}, "dp_size"),
            ({"dp_size": "2"}, "dp_size"),
            ({"dp_size": True}, "dp_size"),
            ({"dp_size": 2.0}, "dp_size"),
            ({"id": "moe#dp1", "dp_size": 2}, "id"),
        ):
            resp = client.post("/workers", json={"id": "moe", "url": replicas["r0"], **bad})
            assert resp.status_code == 400, bad
            error = resp.json()["error"]
            assert error["param"] == param and param in error["message"], error
        assert state(server, name)["replicas"] == {}  # nothing written
        resp = client.post("/workers", json={"id": "moe", "url": replicas["r0"], "dp_size": 2})
        assert resp.status_code == 200
        assert resp.json() == {
            "id": "moe",
            "url": replicas["r0"],
            "capacity": None,
            "dp_size": 2,
            "added": True,
        }
        assert sorted(state(server, name)["replicas"]) == ["moe#dp0", "moe#dp1"]
        granted = []
        for _ in range(4):
            resp = client.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 200
            granted.append(resp.headers["x-replica-id"].rpartition("#dp")[2])
        # Each request named the rank its lease was granted, in vLLM's header and SGLang's field.
        assert stats(replicas["r0"])["dp_ranks"] == [[k, int(k)] for k in granted]


# -- credentials ---------------------------------------------------------------------------

SECRET = "s3cr3t-pw"


def test_a_replicas_credentials_never_show(server, procs, name, caplog):
    """A replica registered as http://user:password@host:port gets them as its Basic
    authorization (in place of the client's own Authorization), and no answer, log line or
    metric of serve shows the password: not /workers, not a failure's error body."""
    (url,) = procs.replicas(1, "--auth", f"ops:{SECRET}").values()
    with socket.socket() as s:  # a port nothing listens on: the second replica is down
        s.bind(("127.0.0.1", 0))
        dead = f"http://ops:{SECRET}@127.0.0.1:{s.getsockname()[1]}"
    live = url.replace("http://", f"http://ops:{SECRET}@")
    caplog.set_level(logging.DEBUG)

    async def main() -> list[str]:
        lb = AsyncRedisLoadBalancer(redis=server.url, name=name)
        shown: list[str] = []
        async with lb:
            front = Front(lb, ServeOptions(admin_token="t0ken", retries=0), Metrics())
            async with running(front, "127.0.0.1", 0) as (host, port):
                base = f"http://{host}:{port}"
                admin = {"Authorization": "Bearer t0ken"}
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    resp = await client.post(
                        "/workers", json={"id": "r0", "url": live}, headers=admin
                    )
                    assert resp.status_code == 200
                    shown.append(resp.text)
                    assert resp.json()["url"] == url.replace("http://", "http://ops:***@")
                    # The client's own Authorization (the openai client always sends one).
                    resp = await client.post(
                        "/v1/completions",
                        json={"prompt": "x"},
                        headers={"Authorization": "Bearer sk-client"},
                    )
                    assert resp.status_code == 200, resp.text  # the replica's auth reached it
                    assert resp.headers["x-replica-id"] == "r0"
                    resp = await client.post(
                        "/workers", json={"id": "r1", "url": dead}, headers=admin
                    )
                    shown.append(resp.text)
                    await client.delete("/workers/r0", headers=admin)
                    resp = await client.post("/v1/completions", json={"prompt": "x"})
                    assert resp.status_code == 502
                    shown.append(resp.text)
                    for path in ("/workers", "/metrics", "/health", "/v1/models"):
                        shown.append((await client.get(path)).text)
                    shown.append(json.dumps(dict(resp.headers)))
        return shown

    shown = asyncio.run(main())
    assert "ops:***@127.0.0.1" in shown[-5]  # /workers lists r1, without its password
    for text in [*shown, caplog.text]:
        assert SECRET not in text, text
