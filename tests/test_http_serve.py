"""`redis-router serve` as deployed: real CLI subprocesses on one Redis, in front of small
OpenAI-compatible replicas (``redis_router.http.fake_replica``, subprocesses the tests start
and SIGKILL), driven by the real ``openai`` and ``httpx`` clients, on every server binary.

What the balancer did is read from Redis (``cli.common.Balancer``: reads only, pins nothing);
what each replica served from its ``/stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from redis_router.cli.common import Balancer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 60.0  # a loaded machine may take long to import aiohttp in 6 processes
POLL_TIMEOUT = 15.0
CHAT = [{"role": "user", "content": "hello"}]


def until(check: Callable[[], Any], what: str, timeout: float = POLL_TIMEOUT) -> Any:
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` after
    ``timeout`` seconds (never a timing assertion: a bound on a wait)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


class Procs:
    """Subprocesses that print their URL as the last word of their first line."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []
        self.banners: list[str] = []  # the first line each printed
        self.by_id: dict[str, subprocess.Popen[str]] = {}  # replicas by id, to kill
        self.logs: dict[subprocess.Popen[str], Any] = {}  # stderr, in a file: never blocks

    def start(
        self, *args: str, env: dict[str, str] | None = None, pipe_stderr: bool = False
    ) -> subprocess.Popen[str]:
        env = {**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, **(env or {})}
        log = None if pipe_stderr else tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if log is None else log,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.started.append(proc)
        if log is not None:
            self.logs[proc] = log
        return proc

    def stderr_of(self, proc: subprocess.Popen[str]) -> str:
        log = self.logs.get(proc)
        if log is None:
            assert proc.stderr is not None
            return proc.stderr.read()
        log.seek(0)
        return str(log.read())

    def url_of(self, proc: subprocess.Popen[str]) -> str:
        lines: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=START_TIMEOUT)
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"{proc.args} printed nothing in {START_TIMEOUT:g}s") from None
        if not line:
            proc.wait(10)
            raise AssertionError(f"{proc.args} exited: {self.stderr_of(proc)}")
        self.banners.append(line)
        return line.split()[-1]

    def replicas(self, n: int, *extra: str, prefix: str = "r") -> dict[str, str]:
        """n fake replicas started at once: {id: url}."""
        procs = {
            f"{prefix}{i}": self.start(
                "-m", "redis_router.http.fake_replica", "--id", f"{prefix}{i}", *extra
            )
            for i in range(n)
        }
        self.by_id.update(procs)
        return {rid: self.url_of(p) for rid, p in procs.items()}

    def fronts(
        self, url: str, name: str, n: int, *extra: str, env: dict[str, str] | None = None
    ) -> list[str]:
        """n `redis-router serve` instances on one balancer: their base URLs."""
        command = ["-m", "redis_router", "--redis", url, "--name", name, "serve", "--port", "0"]
        procs = [self.start(*command, *extra, env=env) for _ in range(n)]
        return [self.url_of(p) for p in procs]

    def kill(self, replica_id: str) -> None:
        proc = self.by_id[replica_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.terminate()
        for p in self.started:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            for stream in (p.stdout, p.stderr, self.logs.get(p)):
                if stream is not None:
                    stream.close()


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    yield p
    p.stop()


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return f"http-{request.node.name[:40]}".replace("[", "-").replace("]", "")


def register(server: Any, name: str, replicas: dict[str, str], **caps: int) -> None:
    """`servers add` each replica, with its url (and a capacity) in its metadata."""
    for rid, url in replicas.items():
        meta = {"url": url, **({"capacity": caps[rid]} if rid in caps else {})}
        subprocess.run(
            [sys.executable, "-m", "redis_router", "--redis", server.url, "--name", name,
             "servers", "add", rid, "--meta", json.dumps(meta)],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip


def state(server: Any, name: str) -> dict[str, Any]:
    """get_status() of the balancer, read the way `redis-router status` reads it."""
    client = redis.Redis.from_url(server.url)
    try:
        return Balancer(client, name, server.url).status()
    finally:
        client.close()


def inflight(server: Any, name: str) -> dict[str, int]:
    return {sid: r["inflight"] for sid, r in state(server, name)["replicas"].items()}


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/stats", timeout=10).json()


def metric(front: str, name: str) -> float:
    """The sum of one counter's samples on a serve instance's /metrics."""
    text = httpx.get(f"{front}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def chat(front: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=30)


# -- sessions and balance ------------------------------------------------------------------


@pytest.mark.quick  # the module's test in the quick tier
def test_a_session_stays_on_one_replica_whichever_instance_its_turns_reach(server, procs, name):
    replicas = procs.replicas(3)
    register(server, name, replicas)
    fronts = procs.fronts(server.url, name, 3, "--session-field", "user")
    clients = [chat(f) for f in fronts]
    served: dict[str, set[str]] = {}
    for turn in range(4):
        for s in range(12):
            session = f"conv-{s}"
            client = clients[(s + turn) % 3]  # every turn through another instance
            messages = [{"role": "user", "content": f"{session} turn {t}"} for t in range(turn + 1)]
            if s % 2:  # half name their session by the header, half by the body field
                raw = client.chat.completions.with_raw_response.create(
                    model="m", messages=messages, extra_headers={"X-Session-ID": session}
                )
            else:
                raw = client.chat.completions.with_raw_response.create(
                    model="m", messages=messages, user=session
                )
            answer = raw.parse()
            replica = raw.headers["x-replica-id"]
            assert answer.choices[0].message.content.startswith(f"{replica}-w0")
            served.setdefault(session, set()).add(replica)
    assert all(len(where) == 1 for where in served.values()), served
    assert len({next(iter(w)) for w in served.values()}) > 1  # sessions spread over replicas
    # Each release is sent after the response's last byte, in the background.
    snap = until(
        lambda: (s := state(server, name))["total_inflight"] == 0 and s, "every lease released"
    )
    assert sum(r["sticky_hits"] for r in snap["replicas"].values()) == 12 * 3


def test_concurrent_requests_over_three_instances_balance_as_the_library(server, procs, name):
    replicas = procs.replicas(3)
    register(server, name, replicas)
    fronts = procs.fronts(server.url, name, 3)
    n = 9
    seen: list[dict[str, int]] = []

    async def one(i: int, client: httpx.AsyncClient) -> str:
        body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 40}
        async with client.stream(
            "POST", f"{fronts[i % 3]}/v1/chat/completions", json=body,
            headers={"X-Fake-Delay": "0.1"},
        ) as resp:  # fmt: skip
            assert resp.status_code == 200
            async for _ in resp.aiter_bytes():
                pass
            return resp.headers["x-replica-id"]

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.ensure_future(one(i, client)) for i in range(n)]
            deadline = time.monotonic() + POLL_TIMEOUT
            while True:
                counts = await asyncio.to_thread(inflight, server, name)
                if sum(counts.values()) == n:
                    seen.append(counts)
                    break
                assert time.monotonic() < deadline, f"never {n} in flight at once: {counts}"
                await asyncio.sleep(0.02)
            return list(await asyncio.gather(*tasks))

    where = asyncio.run(main())
    counts = seen[0]
    # Least loaded at the instant of each atomic acquire, whichever instance sent it.
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    assert sorted(where.count(r) for r in replicas) == [3, 3, 3]
    assert until(lambda: sum(inflight(server, name).values()) == 0, "every lease released")
    assert all(stats(u)["peak"] == 3 for u in replicas.values())


# -- leases follow the response ------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_lease(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 500}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{front}/v1/chat/completions", json=body, headers={"X-Fake-Delay": "0.05"}
        ) as resp,
    ):
        lines = resp.iter_lines()  # held: a dropped iterator would close the stream
        assert next(lines).startswith("data: ")
        assert inflight(server, name) == {"r0": 1}
        gone = time.monotonic()
    # The connection is closed: the lease goes at once, and the replica stops generating.
    until(lambda: inflight(server, name) == {"r0": 0}, "the lease to be released")
    freed = time.monotonic() - gone
    until(lambda: stats(replicas["r0"])["broken_off"] == 1, "the upstream request to be closed")
    assert stats(replicas["r0"])["inflight"] == 0
    snap = state(server, name)
    assert snap["replicas"]["r0"]["live_leases"] == 0
    assert snap["replicas"]["r0"]["failures"] == 0  # a client leaving is not a replica failure
    print(f"lease freed {freed * 1000:.0f} ms after the client closed")


def test_a_killed_replica_is_ejected_for_every_instance_and_unsent_requests_go_elsewhere(
    server, procs, name
):
    replicas = procs.replicas(3)
    register(server, name, replicas)
    fronts = procs.fronts(server.url, name, 3, "--eject-after", "1", "--eject-for", "120")
    procs.kill("r1")
    retried, sent = 0.0, 0
    for i in range(60):  # until some request met the dead replica (random among the idle)
        front = fronts[i % 3]
        body = {"model": "m", "messages": CHAT, "stream": bool(i % 2)}
        resp = httpx.post(f"{front}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text  # served elsewhere, nothing streamed before
        assert resp.headers["x-replica-id"] != "r1"
        sent += 1
        retried = sum(metric(f, "redis_router_http_retries_total") for f in fronts)
        if retried:
            break
    assert retried == 1
    r1 = state(server, name)["replicas"]["r1"]
    assert r1["ejected_until"] and r1["failures"] == 1
    # Ejected for all: no instance sends anything to r1 any more, so nothing is retried.
    for i in range(30):
        body = {"model": "m", "messages": CHAT, "stream": bool(i % 2)}
        resp = httpx.post(f"{fronts[i % 3]}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200
    assert sum(metric(f, "redis_router_http_retries_total") for f in fronts) == 1
    served = sum(sum(stats(replicas[r])["served"].values()) for r in ("r0", "r2"))
    assert served == sent + 30  # every request was answered by a live replica
    assert until(lambda: sum(inflight(server, name).values()) == 0, "every lease released")


def test_an_upstream_5xx_is_passed_on_and_reported_as_a_failure(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    resp = httpx.post(
        f"{front}/v1/completions",
        json={"model": "m", "prompt": "hi"},
        headers={"X-Fake-Status": "500"},
        timeout=30,
    )
    assert resp.status_code == 500
    until(lambda: state(server, name)["replicas"]["r0"]["failures"] == 1, "the failure report")
    assert inflight(server, name) == {"r0": 0}


def test_requests_and_answers_pass_through_without_headers_or_cookies_of_the_front(
    server, procs, name
):
    """The front adds no Accept-Encoding, Accept or User-Agent the client did not send (a
    replica would compress for a client that never asked), and a replica's Set-Cookie goes to
    its client only: later requests of other clients carry no cookie. The replica is named by
    host name, whose cookies a client's jar would keep."""
    replicas = procs.replicas(1)
    register(server, name, {k: v.replace("127.0.0.1", "localhost") for k, v in replicas.items()})
    (front,) = procs.fronts(server.url, name, 1)
    host, port = front.removeprefix("http://").rsplit(":", 1)
    sent = json.dumps({"model": "m", "prompt": "hi"})
    answers = []
    for extra in ({"X-Fake-Set-Cookie": "replica=r0; Path=/"}, {}):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.putrequest("POST", "/v1/completions", skip_host=False, skip_accept_encoding=True)
            for k, v in {"Content-Type": "application/json", **extra}.items():
                conn.putheader(k, v)
            conn.putheader("Content-Length", str(len(sent)))
            conn.endheaders(sent.encode())
            resp = conn.getresponse()
            answers.append((resp.status, resp.getheader("Set-Cookie"), resp.read()))
        finally:
            conn.close()
    assert [a[0] for a in answers] == [200, 200]
    assert answers[0][1] == "replica=r0; Path=/" and answers[1][1] is None
    seen = stats(replicas["r0"])["headers"]
    assert len(seen) == 2
    for names in seen:
        assert not {"accept", "accept-encoding", "user-agent", "cookie"} & set(names), names
        assert "content-type" in names


# -- errors --------------------------------------------------------------------------------

MALFORMED = [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "must be a JSON object"),
    ("/v1/chat/completions", b'{"model": "m"}', "'messages'"),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": "hello"}', "'messages'"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream": "yes"}', "'stream'"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "model": 7}', "'model'"),
    ("/v1/completions", b'{"model": "m"}', "'prompt'"),
    ("/v1/completions", b'{"prompt": 12}', "'prompt'"),
    ("/v1/completions", b'{"prompt": [1, -2]}', "'prompt'"),
    ("/generate", b'{"sampling_params": {}}', "'text' or 'input_ids'"),
    ("/generate", b'{"input_ids": "abc"}', "'input_ids'"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "user": 5}', "'user'"),
]


def test_a_malformed_request_gets_a_400_naming_what_is_wrong_and_takes_no_lease(
    server, procs, name
):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1, "--session-field", "user")
    for path, raw, needle in MALFORMED:
        resp = httpx.post(
            f"{front}{path}", content=raw, headers={"Content-Type": "application/json"}
        )
        assert resp.status_code == 400, (path, raw, resp.text)
        error = resp.json()["error"]
        assert needle in error["message"], (raw, error)
        assert error["type"] == "invalid_request_error" and error["code"] == 400
    long_session = {"X-Session-ID": "s" * 600}
    resp = httpx.post(f"{front}/v1/chat/completions", json={"messages": CHAT}, headers=long_session)
    assert resp.status_code == 400 and "X-Session-ID" in resp.json()["error"]["message"]
    snap = state(server, name)
    assert snap["replicas"]["r0"]["acquires"] == 0 and snap["total_inflight"] == 0
    assert stats(replicas["r0"])["served"] == {}
    # The openai client surfaces the 400 as its own error, with the message.
    with pytest.raises(openai.BadRequestError, match="'stream' must be a boolean"):
        chat(front).chat.completions.create(model="m", messages=CHAT, extra_body={"stream": 1})


def test_an_empty_pool_gets_503_and_a_full_one_503_with_retry_after(server, procs, name):
    (front,) = procs.fronts(server.url, name, 1)
    resp = httpx.post(f"{front}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "no_servers_available"
    assert resp.headers["Retry-After"] == "1"
    replicas = procs.replicas(1)
    register(server, name, replicas, r0=1)
    body = {"prompt": "hi", "stream": True, "max_tokens": 200}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{front}/v1/completions", json=body, headers={"X-Fake-Delay": "0.05"}
        ) as held,
    ):
        lines = held.iter_lines()
        next(lines)
        full = client.post(f"{front}/v1/completions", json={"prompt": "hi"})
        assert full.status_code == 503
        assert full.json()["error"]["type"] == "no_capacity"
        assert int(full.headers["Retry-After"]) >= 1
    until(lambda: inflight(server, name) == {"r0": 0}, "the held lease released")
    assert httpx.post(f"{front}/v1/completions", json={"prompt": "hi"}).status_code == 200


def test_a_full_pool_waits_for_a_place_with_wait_timeout(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas, r0=1)
    (front,) = procs.fronts(server.url, name, 1, "--wait-timeout", "30")

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "hi", "max_tokens": 5}
            slow = {"X-Fake-Delay": "0.1"}
            sent = [client.post(f"{front}/v1/completions", json=body, headers=slow)
                    for _ in range(3)]  # fmt: skip
            return [r.status_code for r in await asyncio.gather(*sent)]

    assert asyncio.run(main()) == [200, 200, 200]
    assert stats(replicas["r0"])["peak"] == 1  # the capacity held; the others waited
    assert state(server, name)["waiting"]["served"] >= 2


# -- the rest of the API -------------------------------------------------------------------


def test_abort_goes_only_to_the_replica_serving_the_request(server, procs, name):
    replicas = procs.replicas(3)
    register(server, name, replicas)
    fronts = procs.fronts(server.url, name, 2)
    body = {"text": "long job", "stream": True, "sampling_params": {}, "max_tokens": 400}
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST", f"{fronts[0]}/generate", json=body,
            headers={"X-Request-Id": "job-7", "X-Fake-Delay": "0.05"},
        ) as resp:  # fmt: skip
            lines = resp.iter_lines()
            next(lines)
            owner = resp.headers["x-replica-id"]
            aborted = client.post(f"{fronts[1]}/abort_request", json={"rid": "job-7"})
            assert aborted.status_code == 200, aborted.text
            assert aborted.json() == {"aborted": "job-7", "replica": owner}
        missing = client.post(f"{fronts[1]}/abort_request", json={"rid": "nobody"})
        assert missing.status_code == 404 and "nobody" in missing.json()["error"]["message"]
        session = {"X-Session-ID": "sess-9", "X-Fake-Delay": "0.05"}
        with client.stream(
            "POST", f"{fronts[1]}/generate", json={**body, "rid": "job-8"}, headers=session
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            by_session = resp.headers["x-replica-id"]
            aborted = client.post(
                f"{fronts[0]}/abort_request",
                json={"rid": "job-8"},
                headers={"X-Session-ID": "sess-9"},  # the balancer knows the session
            )
            assert aborted.json() == {"aborted": "job-8", "replica": by_session}
        bad = client.post(f"{fronts[1]}/abort_request", json={"rid": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
    for rid, url in replicas.items():
        expected = (["job-7"] if rid == owner else []) + (["job-8"] if rid == by_session else [])
        assert stats(url)["aborted"] == expected, rid


def test_workers_register_drain_and_remove_replicas(server, procs, name):
    replicas = procs.replicas(2)
    (front,) = procs.fronts(server.url, name, 1, env={"REDIS_ROUTER_ADMIN_TOKEN": "t0ken"})
    refused = httpx.post(f"{front}/workers", json={"id": "r0", "url": replicas["r0"]})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert httpx.delete(f"{front}/workers/r0").status_code == 401
    assert state(server, name)["replicas"] == {}
    admin = {"Authorization": "Bearer t0ken"}
    with httpx.Client(base_url=front, timeout=30, headers=admin) as client:
        for rid, url in replicas.items():
            resp = client.post("/workers", json={"id": rid, "url": url, "capacity": 4})
            assert resp.status_code == 200 and resp.json()["added"] is True
        snap = state(server, name)["replicas"]
        assert {sid: (r["metadata"]["url"], r["capacity"]) for sid, r in snap.items()} == {
            rid: (url, 4) for rid, url in replicas.items()
        }
        listed = client.get("/workers").json()["workers"]
        assert [w["id"] for w in listed] == ["r0", "r1"]
        assert client.delete("/workers/r0", params={"drain": "1"}).json() == {
            "id": "r0",
            "draining": True,
        }
        for _ in range(4):  # new requests go only to the replica not draining
            resp = client.post("/v1/completions", json={"prompt": "x"})
            assert resp.headers["x-replica-id"] == "r1"
        assert client.delete("/workers/r0").json() == {"id": "r0", "removed": True}
        assert sorted(state(server, name)["replicas"]) == ["r1"]
        gone = client.delete("/workers/r0")
        assert gone.status_code == 404
        for bad, param in (
            ({"id": "r5"}, "url"),
            ({"id": "", "url": "http://h:1"}, "id"),
            ({"id": "r5", "url": "ftp://h"}, "url"),
            ({"id": "r5", "url": "http://h:1", "capacity": "4"}, "capacity"),
        ):
            resp = client.post("/workers", json=bad)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param
        assert sorted(state(server, name)["replicas"]) == ["r1"]


def test_models_health_and_metrics(server, procs, name):
    a = procs.replicas(1, "--model", "alpha", prefix="a")
    b = procs.replicas(1, "--model", "beta", prefix="b")
    register(server, name, {**a, **b})
    (front,) = procs.fronts(server.url, name, 1)
    models = chat(front).models.list()
    assert sorted(m.id for m in models.data) == ["alpha", "beta"]
    health = httpx.get(f"{front}/health").json()
    assert health == {"status": "ok", "balancer": name, "replicas": 2}
    assert httpx.post(f"{front}/v1/completions", json={"prompt": "x"}).status_code == 200
    assert httpx.post(f"{front}/v1/completions", content=b"[").status_code == 400
    assert metric(front, "redis_router_http_requests_total") == 3  # models, 200, 400
    assert metric(front, "redis_router_http_errors_total") == 1
    assert metric(front, "redis_router_http_upstream_seconds_count") == 1
    assert metric(front, "redis_router_http_inflight") == 0
    assert httpx.get(f"{front}/nowhere").json()["error"]["type"] == "not_found_error"


# -- options -------------------------------------------------------------------------------


def test_the_prompt_feeds_the_policy_of_a_router_yaml(server, procs, name):
    """prefix_cache routes on the text of the prompt: a GRPO group (one prompt, many request
    ids) lands on one replica while the pool stays balanced."""
    replicas = procs.replicas(3)
    register(server, name, replicas)
    fronts = procs.fronts(
        server.url, name, 3, "--router-config", "plugins/prefix_cache.yaml",
        "--option", "block_size=4",
    )  # fmt: skip
    prompt = "You are a careful solver. Problem 17: how many primes are below 100? " * 4
    where = set()
    for i in range(8):
        resp = httpx.post(
            f"{fronts[i % 3]}/v1/completions",
            json={"model": "m", "prompt": prompt},
            headers={"X-Request-Id": f"p17-s{i}"},
            timeout=30,
        )
        assert resp.status_code == 200
        where.add(resp.headers["x-replica-id"])
    assert len(where) == 1  # least-loaded would scatter them: (1/3)**7 to land so
    assert all("policy prefix_cache" in b for b in procs.banners[-3:]), procs.banners


def test_serve_refuses_settings_that_disagree_with_the_pinned_ones(server, procs, name, make_lb):
    lb = make_lb({"r0": {"url": "http://127.0.0.1:1"}}, name=name, sticky_ttl=60)
    lb.release_server(*lb.acquire_server("pin")[:1], "pin")  # the first acquire pins
    proc = procs.start(
        "-m", "redis_router", "--redis", server.url, "--name", name, "serve", "--port", "0",
        "--sticky-ttl", "120", pipe_stderr=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == ""
    assert "sticky_ttl=120s" in err and "60s" in err


def test_a_replica_that_dies_mid_stream_cuts_the_answer_short_and_is_reported(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 500}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{front}/v1/chat/completions", json=body, headers={"X-Fake-Delay": "0.05"}
        ) as resp,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        procs.kill("r0")
        with pytest.raises(httpx.RemoteProtocolError):  # not a clean end: the client can tell
            for _ in lines:
                pass
    until(lambda: state(server, name)["replicas"]["r0"]["failures"] == 1, "the failure report")
    assert inflight(server, name) == {"r0": 0}


def test_serve_never_shows_the_redis_password(procs):
    proc = procs.start(
        "-m",
        "redis_router",
        "--redis",
        "redis://:hunter2@127.0.0.1:1/0",
        "serve",
        "--port",
        "0",
        pipe_stderr=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == ""
    assert "hunter2" not in err and "127.0.0.1:1" in err
    assert len(err.strip().splitlines()) == 1, err


def test_settings_pinned_after_serve_started_are_a_500_naming_them(server, procs, name, make_lb):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)  # nothing pinned yet: it starts
    lb = make_lb(name=name, sticky_ttl=60)
    lb.release_server(lb.acquire_server("pin")[0], "pin")  # a worker pins sticky_ttl=60
    resp = httpx.post(f"{front}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert error["type"] == "config_mismatch" and "sticky_ttl" in error["message"]
    assert stats(replicas["r0"])["served"] == {}


def test_a_client_that_gives_up_on_a_slow_answer_frees_its_lease(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{front}/v1/completions",
            json={"prompt": "x", "max_tokens": 100},
            headers={"X-Fake-Delay": "0.1"},  # 10 s of generation
            timeout=httpx.Timeout(30, read=0.5),
        )
    until(lambda: inflight(server, name) == {"r0": 0}, "the lease to be released")
    until(lambda: stats(replicas["r0"])["inflight"] == 0, "the upstream request to be closed")


def test_an_upstream_timeout_is_a_504_reported_and_not_retried(server, procs, name):
    replicas = procs.replicas(2)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1, "--upstream-timeout", "0.5")
    resp = httpx.post(
        f"{front}/v1/completions",
        json={"prompt": "x", "max_tokens": 100},
        headers={"X-Fake-Delay": "0.1"},  # 10 s of generation
        timeout=30,
    )
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "upstream_timeout"
    assert sum(stats(u)["served"].get("/v1/completions", 0) for u in replicas.values()) == 1
    until(
        lambda: sum(r["failures"] for r in state(server, name)["replicas"].values()) == 1,
        "the failure report",
    )
    assert sum(inflight(server, name).values()) == 0
    assert metric(front, "redis_router_http_retries_total") == 0


def test_least_tokens_weighs_text_prompts_through_serve(server, procs, name):
    """With --policy least_tokens a long text prompt outweighs two short ones: a new request
    goes to the replica with more requests but fewer prompt tokens in flight."""
    replicas = procs.replicas(2)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1, "--policy", "least_tokens")
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as streams:

        def held(prompt: str) -> str:
            body = {"prompt": prompt, "stream": True, "max_tokens": 400}
            resp = streams.enter_context(
                client.stream(
                    "POST",
                    f"{front}/v1/completions",
                    json=body,
                    headers={"X-Fake-Delay": "0.05"},
                )
            )
            assert resp.status_code == 200
            return str(resp.headers["x-replica-id"])

        heavy = held("a long document. " * 2500)  # about 10k pseudo-tokens
        light = {held(f"short question number {i}") for i in range(2)}
        assert light == {"r0", "r1"} - {heavy}  # both short ones went to the other replica
        resp = client.post(f"{front}/v1/completions", json={"prompt": "one more question"})
        assert resp.headers["x-replica-id"] in light  # 2 in flight there, but fewer tokens
    until(lambda: sum(inflight(server, name).values()) == 0, "every lease released")


def _turn(front: str, session: str, turn: int) -> str:
    messages = [{"role": "user", "content": f"{session} turn {t}"} for t in range(turn + 1)]
    resp = httpx.post(
        f"{front}/v1/chat/completions",
        json={"model": "m", "messages": messages},
        headers={"X-Session-ID": session},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return str(resp.headers["x-replica-id"])


@pytest.mark.parametrize("eject", [True, False], ids=["ejecting", "not-ejecting"])
def test_the_sessions_of_a_dead_replica_move_to_one_replica_each_for_every_instance(
    server, procs, name, eject
):
    replicas = procs.replicas(3)
    register(server, name, replicas)
    flags = ("--eject-after", "1", "--eject-for", "120") if eject else ()
    fronts = procs.fronts(server.url, name, 3, *flags)
    first: dict[str, str] = {}
    for s in range(40):  # sessions until some are on r1 (idle replicas tie: random)
        first[f"s{s}"] = _turn(fronts[s % 3], f"s{s}", 0)
        if s >= 5 and list(first.values()).count("r1") >= 2:
            break
    orphans = [s for s, where in first.items() if where == "r1"]
    assert len(orphans) >= 2
    procs.kill("r1")
    later: dict[str, list[str]] = {s: [] for s in first}
    for turn in (1, 2, 3):
        for k, session in enumerate(first):
            later[session].append(_turn(fronts[(k + turn) % 3], session, turn))
    for session, where in later.items():
        assert len(set(where)) == 1, (session, where)  # one replica for the rest, any instance
        if session not in orphans:
            assert where[0] == first[session]  # the living replicas' sessions never moved
        else:
            assert where[0] != "r1"
    retries = sum(metric(f, "redis_router_http_retries_total") for f in fronts)
    r1 = state(server, name)["replicas"]["r1"]
    if eject:  # the first failure ejected r1: every other turn went straight to the new place
        assert retries == 1 and r1["failures"] == 1 and r1["ejected_until"]
    else:  # an orphan's first turn fails on r1; its retry, excluding r1, moves the session
        assert retries == len(orphans) == r1["failures"] and not r1["ejected_until"]


def test_sigterm_lets_the_streams_in_flight_finish_then_stops(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    proc = procs.started[-1]
    body = {"model": "m", "messages": CHAT, "stream": True, "max_tokens": 20}
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", f"{front}/v1/chat/completions", json=body, headers={"X-Fake-Delay": "0.05"}
        ) as resp,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and len(rest) == 20  # 19 more words, then the end
    assert proc.wait(30) == 0
    assert inflight(server, name) == {"r0": 0}
    assert state(server, name)["holders"]["live"] == 0  # its holder retired on the way out


def test_redis_out_of_reach_is_a_503_and_an_unhealthy_instance(server, procs, name):
    replicas = procs.replicas(1)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1)
    assert httpx.post(f"{front}/v1/completions", json={"prompt": "x"}).status_code == 200
    server.stop()  # a real outage (the fixture starts a fresh server for the next test)
    resp = httpx.post(f"{front}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    error = resp.json()["error"]
    assert error["type"] == "redis_unavailable" and str(server.port) in error["message"]
    health = httpx.get(f"{front}/health", timeout=30)
    assert health.status_code == 503 and health.json()["error"]["type"] == "redis_unavailable"
    assert stats(replicas["r0"])["served"] == {"/v1/completions": 1}


def test_requests_to_a_data_parallel_replica_carry_the_granted_rank_for_both_engines(
    server, procs, name
):
    """A replica registered with dp_size is routed per rank: every request forwarded to it
    names the lease's rank in vLLM's header and SGLang's body field, a session's turns keep
    their rank, and a plain replica beside it gets neither."""
    replicas = procs.replicas(2)
    meta = json.dumps({"url": replicas["r0"], "dp_size": 4})
    subprocess.run(
        [sys.executable, "-m", "redis_router", "--redis", server.url, "--name", name,
         "servers", "add", "r0", "--meta", meta],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    register(server, name, {"r1": replicas["r1"]})
    (front,) = procs.fronts(server.url, name, 1)
    where: dict[str, set[str]] = {}
    with httpx.Client(base_url=front, timeout=30) as client:
        for turn in range(3):
            for s in range(10):
                session = {"X-Session-ID": f"conv-{s}"}
                if s % 2:
                    body = {"model": "m", "messages": CHAT * (turn + 1)}
                    resp = client.post("/v1/chat/completions", json=body, headers=session)
                else:
                    body = {"text": f"conv-{s} turn {turn}", "sampling_params": {}}
                    resp = client.post("/generate", json=body, headers=session)
                assert resp.status_code == 200, resp.text
                where.setdefault(f"conv-{s}", set()).add(resp.headers["x-replica-id"])
    assert all(len(units) == 1 for units in where.values()), where
    seen = stats(replicas["r0"])
    units = {u for w in where.values() for u in w if u.startswith("r0#dp")}
    assert len(seen["dp_ranks"]) == 3 * sum(
        1 for w in where.values() if next(iter(w)).startswith("r0#")
    )
    assert len(units) > 1  # sessions spread over the ranks
    for (header, field), session in zip(seen["dp_ranks"], seen["sessions"], strict=True):
        unit = next(iter(where[session]))
        assert header == str(field) and unit == f"r0#dp{field}"
    assert sorted(state(server, name)["dp_replicas"]["r0"]["units"]) == [
        f"r0#dp{k}" for k in range(4)
    ]
    with httpx.Client(base_url=front, timeout=30) as client:  # drained and removed by its id
        assert client.delete("/workers/r0", params={"drain": "1"}).status_code == 200
        assert state(server, name)["draining_servers"] == [f"r0#dp{k}" for k in range(4)]
        resp = client.post("/v1/completions", json={"prompt": "x"})
        assert resp.headers["x-replica-id"] == "r1"
        plain = stats(replicas["r1"])["dp_ranks"]
        assert plain and all(ranks == [None, None] for ranks in plain)
        assert client.delete("/workers/r0").json() == {"id": "r0", "removed": True}
    assert sorted(state(server, name)["replicas"]) == ["r1"]


# -- one instance, several processes -------------------------------------------------------


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _owners(server: Any, name: str) -> dict[str, int]:
    """Leases in flight per holder (each serving process has its balancer client)."""
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        owned = client.keys(f"rr:{{{name}}}:owned:*")
        return {k.rsplit(":", 1)[-1]: int(client.zcard(k)) for k in owned}
    finally:
        client.close()


def test_processes_serve_one_port_as_one_instance(server, procs, name):
    """serve --processes 2: two processes, each with its balancer client, answer on one port,
    connections spread over both; /metrics sums both; SIGTERM stops both and the instance."""
    replicas = procs.replicas(2)
    register(server, name, replicas)
    (front,) = procs.fronts(server.url, name, 1, "--processes", "2")
    parent = procs.started[-1]
    banner = (
        r"redis-router serve \(2 processes\): balancer '\S+' at redis\S+, policy least_loaded, on "
    )
    assert re.fullmatch(banner + r"http://127\.0\.0\.1:\d+\n", procs.banners[-1]), procs.banners
    kids = _children(parent.pid)
    assert len(kids) == 2
    n = 16
    body = {"model": "m", "prompt": "x", "max_tokens": 1}

    async def one(client: httpx.AsyncClient) -> int:
        resp = await client.post(
            f"{front}/v1/completions", json=body, headers={"X-Fake-Delay": "3"}
        )
        return resp.status_code

    async def main() -> tuple[list[int], dict[str, int]]:
        # A connection each: the kernel spreads connections over the processes by their ports
        # (all 16 on one of two processes: probability 2**-15).
        clients = [httpx.AsyncClient(timeout=30) for _ in range(n)]
        try:
            sent = [asyncio.ensure_future(one(c)) for c in clients]
            deadline = time.monotonic() + POLL_TIMEOUT
            owners = _owners(server, name)
            while sum(owners.values()) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                owners = _owners(server, name)
            return list(await asyncio.gather(*sent)), owners
        finally:
            for c in clients:
                await c.aclose()

    codes, owners = asyncio.run(main())
    assert codes == [200] * n
    assert sum(owners.values()) == n, owners
    assert len([k for k, v in owners.items() if v]) == 2, owners  # both processes served
    assert state(server, name)["holders"]["live"] == 2
    for _ in range(4):  # whichever process answers the scrape, it counts both
        assert metric(front, "redis_router_http_requests_total") == n
        assert metric(front, "redis_router_http_inflight") == 0
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == 0
    assert all(_gone(k) for k in kids)
    assert procs.stderr_of(parent).count("redis-router serve: stopped") == 1
    assert state(server, name)["holders"]["live"] == 0  # each process left the balancer


def test_a_serving_process_that_dies_stops_the_instance(server, procs, name):
    """A process of an instance killed: the others are stopped and the instance fails, for a
    supervisor to restart it whole."""
    register(server, name, procs.replicas(1))
    procs.fronts(server.url, name, 1, "--processes", "2")
    parent = procs.started[-1]
    victim, other = _children(parent.pid)
    os.kill(victim, signal.SIGKILL)
    assert parent.wait(30) == 1
    assert _gone(other)
    assert f"serving process {victim} exited (-9); stopping the others" in procs.stderr_of(parent)


@pytest.mark.parametrize("processes", ["0", "65"])
def test_processes_out_of_range_are_refused(server, procs, name, processes):
    proc = procs.start(
        "-m", "redis_router", "--redis", server.url, "--name", name, "serve", "--port", "0",
        "--processes", processes, pipe_stderr=True,
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == ""
    assert f"--processes must be in [1, 64], got {processes}" in err


def test_serve_in_front_of_a_sharded_pool_keeps_each_session_on_its_replica(server, procs, name):
    """`serve --name <a sharded pool>` serves the pool: turns of a session reach one replica
    whichever instance they go through, and sessions reach the replicas of every shard."""
    from redis_router import ShardedLoadBalancer

    replicas = procs.replicas(4)
    pool = ShardedLoadBalancer(
        {rid: {"url": url} for rid, url in replicas.items()}, shards=2, redis=server.url,
        name=name,
    )  # fmt: skip
    try:
        fronts = procs.fronts(server.url, name, 2, "--session-field", "user")
        assert all("balancer" in b for b in procs.banners[-2:])
        clients = [chat(f) for f in fronts]
        served: dict[str, set[str]] = {}
        for turn in range(3):
            for s in range(16):
                session = f"conv-{s}"
                messages = [
                    {"role": "user", "content": f"{session} turn {t}"} for t in range(turn + 1)
                ]
                raw = clients[(s + turn) % 2].chat.completions.with_raw_response.create(
                    model="m", messages=messages, user=session
                )
                served.setdefault(session, set()).add(raw.headers["x-replica-id"])
        assert all(len(where) == 1 for where in served.values()), served
        used = {next(iter(where)) for where in served.values()}
        # Both shards' replicas served: a tie between idle shards is broken at random, so all
        # 16 sessions on one shard has a chance of 2**-15.
        assert {pool._home(sid) for sid in used} == {0, 1}
        # Each release is sent after the response's last byte, in the background.
        status = until(
            lambda: (s := pool.get_status())["total_inflight"] == 0 and s, "every lease released"
        )
        assert sum(r["sticky_hits"] for r in status["replicas"].values()) == 16 * 2
    finally:
        pool.close()
