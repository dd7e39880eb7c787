"""`redis-router serve --processes N`: N serving processes on one port.

Why: an aiohttp process serves from one core, and the front keeps no state, so more cores
need only more processes. The parent holds the port and forks N children that each run the
same front on it, each with its own balancer client (they share Redis as separate instances
do) and its own listening socket; the kernel hands each connection to one of them. The
parent serves nothing: it prints one line once every child serves, stops them all on SIGTERM
or SIGINT, and when one exits by itself stops the others and fails, for a supervisor to
restart the instance (a process that died with requests in flight leaves leases that its
balancer's lease ttl reclaims).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable

# prometheus_client's multiprocess mode: where each process keeps its samples for /metrics.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# A child that has not announced itself by then is taken as hung at start.
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0  # after SIGTERM, then SIGKILL

Serve = Callable[[socket.socket, Callable[[str], None]], None]


def run(host: str, port: int, processes: int, serve: Serve, url: str) -> int:
    """Serve on host:port from ``processes`` children; ``serve(sock, announce)`` runs one
    (announcing its banner line once it accepts). Returns the instance's exit code."""
    # The port is held by a bound socket that never listens (port 0 picks it once for all);
    # each child listens on a socket of its own bound to it with SO_REUSEPORT, so the kernel
    # spreads connections over the children evenly (a shared socket would hand a burst of
    # keep-alive connections to whichever process accepted first). Without SO_REUSEPORT, the
    # children share one listening socket.
    shared = not hasattr(socket, "SO_REUSEPORT")
    held = _socket(host, port, listen=shared)
    ready_r, ready_w = os.pipe()
    children: set[int] = set()  # pids
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:  # the child: serve until stopped, then leave without the parent's cleanup
            os.close(ready_r)
            code = _child(serve, held, shared, ready_w, url)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children.add(pid)
    os.close(ready_w)
    if shared:
        held.close()  # the children hold it
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, f: stopping.append(s)) for sig in _STOPS}
    try:
        code = _supervise(children, ready_r, processes, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(ready_r)
        held.close()
    print("redis-router serve: stopped", file=sys.stderr, flush=True)
    return code


_STOPS = (signal.SIGTERM, signal.SIGINT)


def _socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT where the system has it; listening
    (and non-blocking, for the event loop) when ``listen``."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        if listen:
            sock.listen(1024)
            sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _child(serve: Serve, held: socket.socket, shared: bool, ready: int, url: str) -> int:
    from . import exit_code

    for sig in _STOPS:  # the parent's handlers are not this process's
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)

    def announce(line: str) -> None:
        os.write(ready, (line + "\n").encode())
        os.close(ready)

    def one() -> int:
        if shared:
            sock = held
        else:
            host, port = held.getsockname()[:2]
            held.close()
            sock = _socket(host, port, listen=True)
        serve(sock, announce)
        return 0

    return exit_code(one, url)


def _supervise(children: set[int], ready: int, processes: int, stopping: list[int]) -> int:
    """Print the first banner once every child announced itself; wait for a stop signal or a
    child's exit; stop the rest. Returns the exit code."""
    banners: list[str] = []
    pending = b""
    deadline = time.monotonic() + START_TIMEOUT
    code = 0
    while children:
        if stopping:
            break
        if len(banners) < processes:
            if time.monotonic() > deadline:
                print(
                    f"redis-router: error: {processes - len(banners)} of {processes} serving "
                    f"processes did not start within {START_TIMEOUT:g}s",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
            readable, _, _ = select.select([ready], [], [], 0.1)
            if readable:
                chunk = os.read(ready, 65536)
                pending += chunk
                *lines, rest = pending.split(b"\n")
                pending = rest
                banners += [line.decode() for line in lines]
                if len(banners) == processes:
                    first = banners[0].replace("redis-router serve:", "", 1).strip()
                    print(f"redis-router serve ({processes} processes): {first}", flush=True)
        else:
            time.sleep(0.1)
        exited = _reap(children)
        if exited is not None:
            pid, status = exited
            if len(banners) == processes:  # a failure at start was printed by the child
                print(
                    f"redis-router: error: serving process {pid} exited "
                    f"({os.waitstatus_to_exitcode(status)}); stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
            code = max(os.waitstatus_to_exitcode(status), 1)
            break
    _stop(children)
    return code


def _reap(children: set[int]) -> tuple[int, int] | None:
    """A child that exited, taken off ``children`` (and off the metrics' live processes)."""
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return None
    if pid == 0 or pid not in children:
        return None
    children.discard(pid)
    _forget_metrics(pid)
    return pid, status


def _stop(children: set[int]) -> None:
    for pid in children:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while children and time.monotonic() < deadline:
        if _reap(children) is None:
            time.sleep(0.05)
    for pid in children:
        _signal(pid, signal.SIGKILL)
    for pid in list(children):
        os.waitpid(pid, 0)
        children.discard(pid)
        _forget_metrics(pid)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _forget_metrics(pid: int) -> None:
    """A process's live gauges no longer count toward the instance's (prometheus_client)."""
    if not os.environ.get(METRICS_DIR_ENV):
        return
    try:
        from prometheus_client import multiprocess
    except ImportError:
        return
    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
