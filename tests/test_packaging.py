"""The Lua scripts are the single source: shipped in the wheel, found from a source checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from redis_router import scripts
from redis_router.local_server import LocalServer, first_server_binary

ROOT = Path(__file__).resolve().parent.parent
LUA = sorted(p.name for p in (ROOT / "lua").glob("*.lua"))


def test_editable_install_reads_the_repository_scripts():
    assert scripts.lua_dir() == ROOT / "lua"
    for name in scripts.NAMES:
        assert f"-- {name}.lua:" in scripts.load(name).source  # every script has its header


def test_every_lua_script_opens_with_its_contract():
    for name in LUA:
        head = (ROOT / "lua" / name).read_text().splitlines()[:12]
        text = "\n".join(head)
        assert head[0].startswith(f"-- {name}"), name
        if name != "lib.lua":
            for part in ("KEYS[1]", "Returns", "Keeps"):
                assert part in text, f"{name} header lacks {part}"


ROUTE = """
import sys, redis_router
from redis_router import RedisLoadBalancer, scripts
lb = RedisLoadBalancer({"s0": "http://a"}, redis=sys.argv[1], name="wheel")
print(redis_router.__file__, scripts.lua_dir(), lb.acquire_server("r1"), sep="|")
"""


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_ships_scripts_and_routes(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("redis_router-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"redis_router/lua/{n}" for n in LUA} <= set(names)
    assert "redis_router/py.typed" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    with LocalServer(first_server_binary()).start() as srv:
        out = subprocess.run(
            [str(py), "-c", ROUTE, srv.url],
            cwd=tmp_path,
            check=True,
            timeout=60,
            capture_output=True,
            text=True,
        ).stdout.strip()
    module, lua_dir, routed = out.split("|")
    assert module.startswith(str(venv)) and lua_dir.startswith(str(venv))
    assert routed == "('s0', 'http://a')"


def test_python_dash_m_runs_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "redis_router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "demo" in out and "status" in out
