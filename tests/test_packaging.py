"""Package data has one home and one way in: ``redis_router/lua`` and ``redis_router/plugins`` are
symlinks to the repository's top-level folders, read through ``importlib.resources``, and a
built wheel carries copies of both."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from redis_router import scripts
from redis_router.local_server import LocalServer, first_server_binary

ROOT = Path(__file__).resolve().parent.parent
LUA = sorted(p.name for p in (ROOT / "lua").glob("*.lua"))
DIST = "llm_redis_router"  # the distribution llm-redis-router, as file names spell it


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
        lines = (ROOT / "lua" / name).read_text().splitlines()
        head = list(itertools.takewhile(lambda line: line.startswith("--"), lines))
        text = "\n".join(head)
        assert head[0].startswith(f"-- {name}"), name
        for part in ("KEYS[1]", "Returns", "Keeps"):
            assert part in text, f"{name} header lacks {part}"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python -m build``: the sdist, and the wheel built from that sdist (so the sdist is
    complete enough to build from)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "-q", "--outdir", str(out), str(ROOT)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return {"sdist": next(out.glob(f"{DIST}-*.tar.gz")), "wheel": next(out.glob(f"{DIST}-*.whl"))}


@pytest.mark.slow
def test_the_sdist_has_what_a_checkout_needs_to_build_run_and_test(built):
    with tarfile.open(built["sdist"]) as tar:
        top, *_ = tar.getnames()
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert top.startswith(f"{DIST}-")
    for needed in ("LICENSE", "README.md", "pyproject.toml", "docker-compose.yml", ".ci/run"):
        assert needed in names, needed
    assert {f"lua/{n}" for n in LUA} <= names
    assert {"tests/conftest.py", "benchmarks/__main__.py", "redis_router/tools/demo.py"} <= names


@pytest.mark.slow
def test_the_wheel_carries_the_license_the_name_and_the_command(built):
    wheel = zipfile.ZipFile(built["wheel"])
    names = set(wheel.namelist())
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    meta = wheel.read(f"{info}/METADATA").decode()
    assert "\nName: llm-redis-router\n" in meta
    assert "\nLicense-Expression: Apache-2.0\n" in meta
    assert wheel.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert "redis-router = redis_router.cli:main" in wheel.read(f"{info}/entry_points.txt").decode()
    tools = {"demo", "simulate", "simulate_kv", "simulate_rl"}
    assert {f"redis_router/tools/{t}.py" for t in tools} <= names
    assert not {f"redis_router/{t}.py" for t in tools} & names  # the top level is the library
    # The long description is the README: no image that only resolves inside the repository.
    description = meta.split("\n\n", 1)[1]
    assert not re.findall(r"!\[[^\]]*\]\((?!https?://)[^)]*\)", description)


def test_license_is_the_full_apache_2_0_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    for section in range(1, 10):
        assert f"\n   {section}. " in text, section  # the nine sections of the terms
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text


ROUTE = """
import sys, redis_router
from redis_router import RedisLoadBalancer, RouterConfigError, get_router_handle, scripts
from redis_router.loader import registered_routers
lb = RedisLoadBalancer({"s0": "http://a"}, redis=sys.argv[1], name="wheel")
plugin = get_router_handle({"t0": None}, "pkg://redis_router.plugins/least_tokens.yaml")
by_entry_point = registered_routers()["least_tokens"].load()
cache = get_router_handle({"c0": None}, "pkg://redis_router.plugins/prefix_cache.yaml")
mine = get_router_handle({"m0": None}, "mine.yaml")  # the user's own file, by registered name
try:
    get_router_handle({"x": None}, "plugins/least_tokens.yaml")  # a checkout's path
    checkout_path = "found"
except RouterConfigError as exc:
    checkout_path = "not found" if "not found" in str(exc) else str(exc)
print(
    redis_router.__file__,
    scripts.lua_dir(),
    sys.modules[type(plugin).__module__].__file__,
    type(plugin) is by_entry_point,
    lb.acquire_server("r1"),
    plugin.acquire_server("r2", prompt_ids=[1, 2, 3])[0],
    cache.acquire_server("r3", prompt_ids=[1, 2, 3])[0],
    type(mine) is by_entry_point and mine.acquire_server("r4", prompt_ids=[4])[0],
    checkout_path,
    sep="|",
)
"""


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_ships_scripts_and_routes(built, tmp_path):
    wheel = built["wheel"]
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
    (tmp_path / "mine.yaml").write_text(
        "router_class: least_tokens\nredis: ${oc.env:REDIS_URL}\nname: mine\n"
    )
    with LocalServer(first_server_binary()).start() as srv:
        out = subprocess.run(
            [str(py), "-c", ROUTE, srv.url],
            cwd=tmp_path,  # outside the checkout
            env={**os.environ, "REDIS_URL": srv.url},
            check=True,
            timeout=60,
            capture_output=True,
            text=True,
        ).stdout.strip()
    module, lua_dir, plugin, same_class, routed, plugin_routed, cached, mine, checkout = out.split(
        "|"
    )
    for path in (module, lua_dir, plugin):
        assert path.startswith(str(venv)), path
    assert same_class == "True"
    assert routed == "('s0', 'http://a')" and plugin_routed == "t0" and cached == "c0"
    assert mine == "m0"
    assert checkout == "not found"  # why the docs show pkg:// and registered names
    command = subprocess.run(
        [str(venv / "bin" / "redis-router"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "demo" in command.stdout and "simulate" in command.stdout


INSTALLS_OTHERS = re.compile(r"pip install [^`\n&;#|]*?(?<![\w.-])'?redis-router(?![\w-])")


def test_every_install_line_installs_this_project():
    """PyPI's redis-router is another project (with the same import name): no README, doc,
    message or script tells anyone to install it."""
    files = [ROOT / "README.md", ROOT / ".ci" / "run", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "redis_router").rglob("*.py")) + sorted(
        (ROOT / "benchmarks").glob("*.py")
    )
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in files
        for m in INSTALLS_OTHERS.finditer(path.read_text())
    ]
    assert offenders == []
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quick start")]
    assert "llm-redis-router" in install
    assert "cannot share an environment" in install  # the import-name clash is said, not hidden


def test_python_dash_m_runs_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "redis_router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "demo" in out and "status" in out
