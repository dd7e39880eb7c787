"""The gateways the peers benchmark compares against: installed from the registry into an
environment of their own (``.venv-peers`` in the checkout, reused when present) and started on
loopback as their own ``--help`` documents (``launch --worker-urls ... --policy ...``).

A gateway that cannot be installed or started is a :class:`Gateway` with ``error`` set, so the
benchmark prints a row saying why instead of failing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .peers_http import HOST, completion_body

ROOT = Path(__file__).resolve().parent.parent
ENV_DIR = ROOT / ".venv-peers"


@dataclass(frozen=True)
class GatewaySpec:
    """One gateway: its distribution, the version range installed, how it starts, its policy."""

    label: str
    dist: str
    pin: str
    module: tuple[str, ...]  # after ``python -m``
    policy: str


SPECS = (
    GatewaySpec(
        "vllm-router round_robin",
        "vllm-router",
        "0.1.*",
        ("vllm_router.launch_router",),
        "round_robin",
    ),
    GatewaySpec(
        "sglang-router cache_aware",
        "sglang-router",
        "0.3.*",
        ("sglang_router", "launch"),
        "cache_aware",
    ),
    GatewaySpec("smg cache_aware", "smg", "1.13.*", ("smg", "launch"), "cache_aware"),
)


def env_python() -> Path:
    return ENV_DIR / "bin" / "python"


def _version(dist: str) -> str | None:
    py = env_python()
    if not py.exists():
        return None
    out = subprocess.run(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def install(log: list[str]) -> dict[str, str]:
    """Create the environment if missing and install every gateway not yet in it. Returns
    {dist: version} of those installed, or {dist: "not installed: why"}."""
    result: dict[str, str] = {}
    if not env_python().exists():
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(ENV_DIR)], capture_output=True, text=True
        )
        if made.returncode != 0:
            why = (made.stderr.strip().splitlines() or ["venv failed"])[-1]
            return {s.dist: f"not installed: {why}" for s in SPECS}
    for spec in SPECS:
        version = _version(spec.dist)
        if version is None:
            log.append(f"installing {spec.dist}=={spec.pin} into {ENV_DIR}")
            done = subprocess.run(
                [str(env_python()), "-m", "pip", "install", "-q", f"{spec.dist}=={spec.pin}"],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if done.returncode != 0:
                lines = [x for x in done.stderr.splitlines() if "WARNING" not in x]
                result[spec.dist] = "not installed: " + (lines[-1] if lines else "pip failed")
                continue
            version = _version(spec.dist)
        result[spec.dist] = version or "not installed: no version after pip install"
    return result


def installed() -> dict[str, str]:
    """The versions in the environment as it is (nothing installed)."""
    return {s.dist: _version(s.dist) or f"not installed ({ENV_DIR} has no {s.dist})" for s in SPECS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Gateway:
    """One running instance of a gateway (or why it is not running)."""

    spec: GatewaySpec
    url: str = ""
    error: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: str = ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def start(
    spec: GatewaySpec,
    worker_urls: list[str],
    log_dir: Path,
    index: int,
    python: Path | None = None,
    ready_within: float = 60.0,
) -> Gateway:
    """Start one instance (with ``python``, default the gateways' env) and wait, at most
    ``ready_within`` seconds, until it proxies a completion to the replicas."""
    python = python or env_python()
    port = free_port()
    cmd = [
        str(python),
        "-m",
        *spec.module,
        "--host",
        HOST,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        spec.policy,
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "error",
    ]
    gw = spawn(spec, cmd, port, log_dir / f"{spec.dist}-{index}.log")
    return wait_ready(gw, ready_within)


def spawn(
    spec: GatewaySpec, cmd: list[str], port: int, log_path: Path, cwd: Path | None = None
) -> Gateway:
    """Start ``cmd`` (a front listening on ``port``), its output to ``log_path``; not waited
    for (see :func:`wait_ready`), so that several start at once."""
    gw = Gateway(spec, url=f"http://{HOST}:{port}", log_path=str(log_path))
    try:
        with open(gw.log_path, "wb") as log:
            gw.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env={**os.environ, "RUST_LOG": "error"},
            )
    except OSError as exc:
        gw.error = f"cannot start {cmd[0]}: {exc}"
    return gw


def wait_ready(gw: Gateway, ready_within: float = 60.0) -> Gateway:
    """Wait until the front proxies a completion to the replicas (200), or set its error."""
    if gw.proc is None:
        return gw
    port = int(gw.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + ready_within
    last = ""
    while time.monotonic() < deadline:
        if gw.proc.poll() is not None:
            tail = Path(gw.log_path).read_text(errors="replace").strip().splitlines()[-3:]
            gw.error = f"exited with {gw.proc.returncode}: {' | '.join(tail)[-300:]}"
            gw.proc = None
            return gw
        try:
            status, body = _probe(port)
            if status == 200:
                return gw
            last = f"answered {status}: {body[:120]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    gw.stop()
    gw.error = f"not ready within {ready_within:g} s ({last})"
    return gw


def _probe(port: int) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=completion_body("probe"),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
