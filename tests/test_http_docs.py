"""docs/http.md's example is real: its shell block and its roaming.py run as written (on free
ports, against the test's server), and print what the page shows."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .test_http_serve import Procs, until

pytestmark = pytest.mark.slow

DOC = (Path(__file__).resolve().parent.parent / "docs" / "http.md").read_text()
PORTS = ("8101", "8102", "8000", "8001")


def block(first_line: str) -> str:
    for body in re.findall(r"```[a-z]*\n(.*?)```", DOC, flags=re.S):
        if body.startswith(first_line):
            return str(body)
    raise AssertionError(f"docs/http.md has no code block starting with {first_line!r}")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def on(text: str, ports: dict[str, str]) -> str:
    for doc_port, port in ports.items():
        text = re.sub(rf"\b{doc_port}\b", port, text)
    return text


def command(line: str) -> list[str]:
    head, *rest = shlex.split(line)
    return {"python": [sys.executable], "redis-router": [sys.executable, "-m", "redis_router"]}[
        head
    ] + rest


@pytest.mark.quick  # the module's test in the quick tier
def test_the_two_instance_example_runs_and_prints_what_the_page_shows(server):
    ports = {p: free_port() for p in PORTS}
    shell = on(block("export REDIS_URL="), ports).splitlines()
    assert shell[0].startswith("export REDIS_URL=")
    env = {"REDIS_URL": server.url}
    procs = Procs()
    try:
        for line in shell[1:]:
            if line.endswith("&"):
                procs.start(*command(line.rstrip("& "))[1:], env=env)
            else:
                subprocess.run(command(line), check=True, env=env, capture_output=True, timeout=60)
        for port in ports.values():
            until(lambda port=port: _up(port), f"port {port} to answer", timeout=60)
        roaming = on(block("# roaming.py"), ports)
        run = subprocess.run(
            [sys.executable, "-c", roaming], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
    finally:
        procs.stop()
    shown = on(block("$ python roaming.py"), ports).splitlines()[1:]
    printed = run.stdout.splitlines()
    assert len({re.search(r": (r\d) said", line)[1] for line in printed}) == 1  # type: ignore[index]
    anonymous = [re.sub(r"\br[01]\b|r[01]-w", "R", line) for line in printed]
    assert anonymous == [re.sub(r"\br[01]\b|r[01]-w", "R", line) for line in shown]


def _up(port: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
