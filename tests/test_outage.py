"""Outages: Redis killed under load and restarted, replies lost in flight, retried acquires.

During an outage calls fail fast with RedisUnavailable (naming the URL, never its password);
afterwards the same balancer objects work again (scripts are reloaded on NOSCRIPT). A server
without persistence comes back empty: NoServersAvailable until the replicas are registered
again. A resent acquire carries its lease token, so it is never counted twice.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from redis_router import NoServersAvailable, RedisLoadBalancer, RedisUnavailable
from redis_router.core import new_token
from redis_router.local_server import LocalServer, ServerBinary

from . import invariants

PASSWORD = "pw-Secret-42"
LEASE_TTL = 0.5


@pytest.fixture
def secured(binary: ServerBinary) -> Iterator[LocalServer]:
    with LocalServer(binary, password=PASSWORD) as s:
        yield s


class Load:
    """Threads that acquire and release in a loop, recording what each call raised."""

    def __init__(self, lb: RedisLoadBalancer, threads: int = 2) -> None:
        self.lb, self.stop = lb, threading.Event()
        self.ok = 0
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, index: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                self.lb.acquire(f"t{index}-{i % 20}").release()
                self.ok += 1
            except (RedisUnavailable, NoServersAvailable) as exc:
                self.errors.append(exc)
                time.sleep(0.01)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def progress(self, timeout: float = 10.0) -> float:
        """Wait until some call succeeds from now on; return how long that took."""
        start, before = time.monotonic(), self.ok
        while self.ok < before + 5:
            assert time.monotonic() - start < timeout, "no progress"
            time.sleep(0.005)
        return time.monotonic() - start


@pytest.mark.slow
def test_outage_fails_fast_without_the_password_and_an_empty_restart_needs_registration(
    secured: LocalServer,
) -> None:
    lb = RedisLoadBalancer({"a": None, "b": None}, redis=secured.url, name="out", lease_ttl=1)
    assert PASSWORD not in lb.url and PASSWORD not in repr(lb)
    with Load(lb) as load:
        load.progress()
        secured.kill()
        t0 = time.monotonic()
        with pytest.raises(RedisUnavailable) as caught:
            lb.acquire("during-outage")
        failed_in = time.monotonic() - t0
        message = str(caught.value)
        assert f"127.0.0.1:{secured.port}" in message and ":***@" in message
        assert PASSWORD not in message
        deadline = time.monotonic() + 10  # the load threads fail as fast, on a busy machine too
        while not load.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert load.errors and all(PASSWORD not in str(e) for e in load.errors)
        assert {type(e) for e in load.errors} == {RedisUnavailable}

        t1 = time.monotonic()
        secured.restart()  # same port, no persistence: comes back empty
        restarted_in = time.monotonic() - t1
        with pytest.raises(NoServersAvailable, match="add_servers"):
            lb.acquire("after-restart")
        # The process that owns the replica list registers them again; the same balancer
        # objects (and the load threads) carry on, no worker restarted.
        t2 = time.monotonic()
        lb.add_servers({"a": None, "b": None})
        resumed_in = load.progress() + (time.monotonic() - t2)
    with invariants.settled(secured.client(decode_responses=True)) as r:
        assert invariants.check(r, "out") == {"a": 0, "b": 0}
    lb.close()
    print(
        f"\n{secured.binary.label}: call during outage failed in {failed_in * 1000:.0f} ms; "
        f"restart took {restarted_in:.2f}s; load resumed {resumed_in:.3f}s after re-registering"
    )


@pytest.mark.slow
def test_a_persistent_server_keeps_replicas_and_leases_across_a_crash(binary: ServerBinary) -> None:
    with LocalServer(binary, persistent=True) as srv:
        lb = RedisLoadBalancer({"a": None, "b": None}, redis=srv.url, name="p", lease_ttl=LEASE_TTL)
        held = [lb.acquire(f"held-{i}") for i in range(4)]
        with Load(lb) as load:
            load.progress()
            srv.kill()  # SIGKILL: only what the AOF (fsync always) has survives
            time.sleep(0.1)
            t0 = time.monotonic()
            srv.restart()
            resumed_in = load.progress()
            total = time.monotonic() - t0
        assert not [e for e in load.errors if isinstance(e, NoServersAvailable)]
        with invariants.settled(srv.client(decode_responses=True)) as r:
            counts = invariants.check(r, "p")
            # The 4 held leases survived; a lease in flight at the kill may too (its release
            # was lost), held by this process until it closes.
            assert sum(counts.values()) >= 4
            assert all(lease.release() for lease in held)  # the process lived: so did they
            lb.close()  # its leftover leases are reclaimable at once
            with RedisLoadBalancer(redis=srv.url, name="p") as reaper:
                reaper.reap()
            assert invariants.check(r, "p") == {"a": 0, "b": 0}
    print(f"\n{binary.label}: persistent restart + first calls {total:.2f}s ({resumed_in:.2f}s)")


def test_acquire_with_the_same_token_twice_is_one_lease(server: LocalServer) -> None:
    lb = RedisLoadBalancer({"a": None, "b": None}, redis=server.url, name="tok")
    token = new_token()
    first = lb.acquire("req", token=token)
    again = lb.acquire("req", token=token)
    assert (again.server_id, again.token) == (first.server_id, token)
    assert lb.get_total_inflight() == 1
    assert lb.get_status()["replicas"][first.server_id]["acquires"] == 1
    assert first.release() and not again.release()
    lb.close()


class DropReplyProxy:
    """A TCP proxy to Redis that, when armed, forwards the next request containing `marker`
    and then closes the client's connection instead of passing the reply back: the server
    ran the command, the client never heard."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.armed: bytes | None = None
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            lost = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, lost), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, lost), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, lost: threading.Event) -> None:
        while data := _recv(client):
            if self.armed is not None and self.armed in data:
                self.armed = None
                lost.set()
            upstream.sendall(data)
        _hang_up(upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, lost: threading.Event) -> None:
        while data := _recv(upstream):
            if lost.is_set():  # the reply to the marked request: swallow it and hang up
                self.dropped += 1
                break
            client.sendall(data)
        _hang_up(client)
        _hang_up(upstream)

    def close(self) -> None:
        self.listener.close()


def _hang_up(sock: socket.socket) -> None:
    """Close now, also while another thread is blocked reading it (close alone would not)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


@pytest.fixture
def proxy(server: LocalServer) -> Iterator[DropReplyProxy]:
    p = DropReplyProxy(server.port)
    yield p
    p.close()


def script_verb(lb: RedisLoadBalancer) -> bytes:
    """The command the balancer's write scripts go by on this server (after its first call)."""
    return b"FCALL" if lb._scripts.mode == "fcall" else b"EVALSHA"


def test_a_lost_reply_is_retried_with_the_same_token_and_counted_once(
    server: LocalServer, proxy: DropReplyProxy, r: redis.Redis
) -> None:
    lb = RedisLoadBalancer({"a": None, "b": None}, redis=f"redis://127.0.0.1:{proxy.port}/0")
    assert lb.acquire("warm-up").release().result()  # scripts loaded, reply read
    proxy.armed = script_verb(lb)
    lease = lb.acquire("req")  # redis-py resends the same EVALSHA on a new connection
    assert proxy.dropped == 1
    assert lb.get_total_inflight() == 1
    replicas = lb.get_status()["replicas"].values()
    assert sum(x["acquires"] for x in replicas) == 2  # warm-up and req, once each
    proxy.armed = script_verb(lb)
    routed = lb.acquire_many(["m1", "m2", "m3"])
    assert proxy.dropped == 2 and len(routed) == 3
    assert sum(invariants.check(r, "default").values()) == 4
    assert lease.release()
    lb.close()


def test_without_client_retries_the_caller_retries_with_its_token(
    server: LocalServer, proxy: DropReplyProxy, r: redis.Redis
) -> None:
    client = redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0), decode_responses=True)
    lb = RedisLoadBalancer({"a": None, "b": None}, redis=client)
    assert lb.acquire("warm-up").release().result()  # answered: the drop is the acquire's
    proxy.armed = script_verb(lb)
    token = new_token()
    with pytest.raises(RedisUnavailable):
        lb.acquire("req", token=token)  # granted by Redis, but the reply was lost
    assert lb.get_total_inflight() == 1
    lease = lb.acquire("req", token=token)  # the retry finds the grant: code 2, not doubled
    assert lb.get_total_inflight() == 1
    assert invariants.check(r, "default")[lease.server_id] == 1
    assert lease.release() and lb.get_total_inflight() == 0
    client.close()
