"""The README's quick start and the plugin example of docs/plugins.md are real code: extracted
from the page, run as a user would (the two workers as two processes on the test's server; the
plugin loaded from its YAML), the plugin proven to be used by every acquire path of both
balancers."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from redis_router import AsyncRedisLoadBalancer, RouterClient, get_router_handle

from . import invariants
from .commandstats import script_calls

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PLUGINS = (ROOT / "docs" / "plugins.md").read_text()
SERVERS = {f"s{i}": f"http://10.0.0.{i}" for i in range(4)}


def _block(first_line: str, page: str = PLUGINS) -> str:
    """The fenced code block of ``page`` whose first line is ``first_line``."""
    for body in re.findall(r"```[a-z]*\n(.*?)```", page, flags=re.S):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"no code block starting with {first_line!r}")


def test_the_quick_start_workers_share_one_balancer_through_redis_url(server, tmp_path):
    """worker_a.py and worker_b.py as written, each its own process, reading REDIS_URL: B's
    acquire of A's session lands on the replica A printed."""
    env = {**os.environ, "REDIS_URL": server.url}

    def run(name: str) -> list[str]:
        script = tmp_path / name
        script.write_text(_block(f"# {name}", README))
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    a, b = run("worker_a.py"), run("worker_b.py")
    assert a[:2] == ["worker", "A:"] and b[:2] == ["worker", "B:"], (a, b)
    assert a[2] in ("s0", "s1") and b[2:] == a[2:], (a, b)  # the same replica and its URL
    with server.client(decode_responses=True) as r:
        assert invariants.check(r, "rollout") == {"s0": 0, "s1": 0}  # both released
        assert int(r.hget("rr:{rollout}:sticky_hits", a[2]) or 0) == 1  # B's turn was sticky


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[str]:
    """The page's three files, as the user's package ``my_routers`` on sys.path; the config
    as the page loads it, by ``pkg://``."""
    package = tmp_path / "my_routers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "preferred.lua").write_text(_block("-- my_routers/preferred.lua"))
    (package / "preferred.py").write_text(_block("# my_routers/preferred.py"))
    (package / "preferred.yaml").write_text(_block("# my_routers/preferred.yaml"))
    assert 'get_router_handle(servers, "pkg://my_routers/preferred.yaml")' in PLUGINS
    sys.path.insert(0, str(tmp_path))
    yield "pkg://my_routers/preferred.yaml"
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("my_routers")]:
        del sys.modules[name]


def test_a_plugin_written_from_the_docs_is_used_by_every_sync_path(plugin, server, r):
    lb = get_router_handle(SERVERS, plugin, redis=server.url, name="readme")
    assert lb.policy.name == "preferred" and lb.require_acquire_fields() == ["prefer"]
    assert lb.acquire_server("a", prefer="s2")[0] == "s2"
    assert lb.acquire("b", prefer="s3").server_id == "s3"
    with lb.lease("c", prefer="s1") as held:
        assert held.server_id == "s1"
    placed = lb.acquire_many(["d", "e", "f"], prefer=["s0", "s0", "s3"])
    assert [sid for sid, _ in placed] == ["s0", "s0", "s3"]
    with RouterClient(lb).session_sync("g", prefer="s2", other="dropped") as (sid, _):
        assert sid == "s2"
    assert lb.acquire_server("a", prefer="s0")[0] == "s2"  # a later turn stays sticky
    assert invariants.check(r, "readme") == {"s0": 2, "s1": 0, "s2": 2, "s3": 2}
    with pytest.raises(TypeError, match="prefer"):
        lb.acquire_server("h", prefer=3)  # the policy checks its field before any write
    lb.close()


def test_a_plugin_written_from_the_docs_is_used_by_coalesced_asyncio_calls(plugin, server, r):
    async def main() -> dict[str, int]:
        lb = get_router_handle(
            SERVERS, plugin, redis=server.url, name="readme-aio"
        )  # the YAML's class is sync; the asyncio twin takes the same policy
        alb = AsyncRedisLoadBalancer(redis=server.url, name="readme-aio", policy=lb.policy)
        await (await alb.acquire("warm", prefer="s0")).release()  # scripts loaded
        wanted = [f"s{i % 4}" for i in range(24)]
        calls = script_calls(r)
        got: list[Any] = await asyncio.gather(
            *(alb.acquire_server(f"q{i}", prefer=w) for i, w in enumerate(wanted))
        )
        assert script_calls(r) - calls == 1  # one loop turn: one coalesced script call
        assert [sid for sid, _ in got] == wanted
        lease = await alb.acquire("z", prefer="s1")
        assert lease.server_id == "s1" and await lease.release()
        many = await alb.acquire_many(["m1", "m2"], prefer=["s3", "s0"])
        assert [sid for sid, _ in many] == ["s3", "s0"]
        counts = invariants.check(r, "readme-aio")
        await alb.close()
        lb.close()
        return counts

    assert asyncio.run(main()) == {"s0": 7, "s1": 6, "s2": 6, "s3": 7}


@pytest.mark.parametrize("path", ["auto", "eval"])
def test_a_plugin_in_the_form_before_the_context_still_routes_least_loaded(
    plugin, server, r, tmp_path, monkeypatch, path
):
    """``choose(i)`` calling ``least_loaded(rand)``, as plugins were written before procedures
    took the call's context, routes as the current form does, by Functions and by EVALSHA."""
    if path == "eval":
        monkeypatch.setenv("REDIS_ROUTER_SCRIPTS", "eval")
    lua = tmp_path / "my_routers" / "preferred.lua"
    old = lua.read_text().replace("function(i, cx)", "function(i)")
    old = old.replace("least_loaded(cx, ", "least_loaded(")
    assert "cx" not in old.split("return acquire_all")[1]  # the earlier form, whole
    lua.write_text(old)
    lb = get_router_handle(SERVERS, plugin, redis=server.url, name=f"earlier-{path}")
    first = lb.acquire_server("n0", prefer="gone")[0]  # no such replica: least loaded
    for i in range(1, 8):
        lb.acquire_server(f"n{i}", prefer="gone")
    lb.acquire_many([f"m{i}" for i in range(4)], prefer=["gone"] * 4)
    assert invariants.check(r, f"earlier-{path}") == {f"s{i}": 3 for i in range(4)}
    assert lb.acquire_server("n0", prefer="gone")[0] == first  # a later turn stays sticky
    lb.close()
