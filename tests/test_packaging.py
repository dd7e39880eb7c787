"""Package data has one home and one way in: ``redis_router/lua`` and ``redis_router/plugins`` are
symlinks to the repository's top-level folders, read through ``importlib.resources``, and a
built wheel carries copies of both."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from redis_router import scripts
from redis_router.local_server import LocalServer, first_server_binary

ROOT = Path(__file__).resolve().parent.parent
LUA = sorted(p.name for p in (ROOT / "lua").glob("*.lua"))


def test_package_data_folders_are_symlinks_to_the_top_level_folders():
    for name in ("lua", "plugins"):
        link = ROOT / "redis_router" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
    assert scripts.lua_dir() == ROOT / "redis_router" / "lua"


def test_editable_install_reads_the_repository_scripts():
    assert scripts.lua_dir().resolve() == ROOT / "lua"
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
from redis_router import RedisLoadBalancer, get_router_handle, scripts
from redis_router.loader import registered_routers
lb = RedisLoadBalancer({"s0": "http://a"}, redis=sys.argv[1], name="wheel")
plugin = get_router_handle({"t0": None}, "pkg://redis_router.plugins/least_tokens.yaml")
by_entry_point = registered_routers()["least_tokens"].load()
print(
    redis_router.__file__,
    scripts.lua_dir(),
    sys.modules[type(plugin).__module__].__file__,
    type(plugin) is by_entry_point,
    lb.acquire_server("r1"),
    plugin.acquire_server("r2", prompt_ids=[1, 2, 3])[0],
    sep="|",
)
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
    plugins = {p.name for p in (ROOT / "plugins").iterdir() if p.suffix in (".py", ".lua", ".yaml")}
    assert {f"redis_router/plugins/{n}" for n in plugins} <= set(names)
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
            env={**os.environ, "REDIS_URL": srv.url},
            check=True,
            timeout=60,
            capture_output=True,
            text=True,
        ).stdout.strip()
    module, lua_dir, plugin, same_class, routed, plugin_routed = out.split("|")
    for path in (module, lua_dir, plugin):
        assert path.startswith(str(venv)), path
    assert same_class == "True"
    assert routed == "('s0', 'http://a')" and plugin_routed == "t0"


def test_python_dash_m_runs_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "redis_router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "demo" in out and "status" in out
