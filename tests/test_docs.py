"""What a new user reads matches what the code does: CI runs the README's commands as written,
every command and metric is documented for operators, and the docs' command output is what the
commands print (docs/generate.py regenerates it; these tests fail when the text has drifted)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from redis_router import RedisLoadBalancer, cli
from redis_router.local_server import first_server_binary

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """The two commands at the top of the README (run it, test it), without their comments."""
    first = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert first, "README has no bash block"
    lines = [line.split("  #")[0].strip() for line in first.group(1).splitlines() if line.strip()]
    assert len(lines) == 2, lines
    return lines


def test_ci_runs_the_readme_commands_exactly_as_written_each_in_a_fresh_venv():
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    stripped = [line.strip() for line in run]
    for command in readme_commands():
        assert command in stripped, f".ci/run does not run the README's {command!r}"
        at = stripped.index(command)
        # the command is the last of its subshell, right after activating a venv made anew
        assert stripped[at + 1] == ")", command
        opened = max(i for i in range(at) if stripped[i] == "(")
        activate = next(line for line in stripped[opened:at] if line.startswith("source "))
        venv = shlex.split(activate)[1].removesuffix("/bin/activate")
        assert f"fresh_venv {venv}" in stripped[:opened], venv
    # The README's test venv installs what the README says, and nothing heavy besides.
    assert "pip install -e '.[test]' && python -m pytest" in readme_commands()
    text = "\n".join(run)
    for lint in ("ruff format --check .", "ruff check .", "mypy --strict redis_router"):
        assert lint in stripped, lint
    for heavy in ("REDIS_ROUTER_REQUIRE_VERL=1", "REDIS_ROUTER_REQUIRE_VLLM=1"):
        assert heavy in text, heavy


@functools.cache
def _generator() -> Any:
    """docs/generate.py, imported from its path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(first_server_binary() is None, reason="no server binary found")
def test_the_docs_command_output_is_what_the_commands_print():
    """Each marked block, rerun by docs/generate.py on a private server: run
    `python docs/generate.py` to rewrite the blocks this names."""
    assert _generator().generate(check=True) == []


def test_every_marked_block_has_a_command_and_a_known_scenario():
    gen = _generator()
    found = [b for path in gen.FILES for b in gen.blocks(path)]
    assert {b.path.name for b in found} >= {"README.md", "operators.md"}
    for block in found:
        assert block.commands, block.where
        assert block.scenario in gen.SCENARIOS, block.where


def test_a_drifted_block_is_found(tmp_path):
    """The check is not vacuous: a block whose text differs from the output fails it."""
    gen = _generator()
    block = next(b for b in gen.blocks(ROOT / "docs" / "operators.md") if not b.masked)
    assert not gen.same(block, block.text.replace("active", "actve", 1))
    masked = next(b for b in gen.blocks(ROOT / "docs" / "operators.md") if b.masked)
    assert gen.same(masked, re.sub(r"\d", "7", masked.text))  # numbers may differ ...
    assert not gen.same(masked, masked.text.replace("vllm-1", "replica-1"))  # ... words not


OPERATORS = (ROOT / "docs" / "operators.md").read_text()


def test_every_cli_subcommand_is_in_the_operators_guide():
    parser = cli.build_parser([])
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(cli.COMMANDS)
    missing = [name for name in sub.choices if f"| `{name}" not in OPERATORS]
    assert missing == [], f"docs/operators.md's command table lacks {missing}"


def test_every_exported_metric_is_in_the_operators_guide(server):
    """Scraped from the exporter's collector on a balancer with every kind of replica state,
    including one with a KV-events publisher (whose families appear only then)."""
    pytest.importorskip("prometheus_client")
    from redis_router.cli.exporter import BalancerCollector

    lb = RedisLoadBalancer(
        {"a": {"kv_events": "tcp://127.0.0.1:5557"}, "b": None}, redis=server.url, name="m"
    )
    collector = BalancerCollector(server.url, "m")
    try:
        lb.acquire_server("x")
        families = list(collector.collect())
    finally:
        collector.close()
        lb.close()
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert len(names) >= 20
    missing = sorted(n for n in names if f"`{n}`" not in OPERATORS)
    assert missing == [], f"docs/operators.md's metrics table lacks {missing}"
