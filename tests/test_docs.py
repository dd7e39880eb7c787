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
    operating = README[README.index("## Operating it") : README.index("## Plugins and verl")]
    missing = [name for name in sub.choices if f"`{name}" not in operating]
    assert missing == [], f"the README's command list lacks {missing}"


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


def test_every_error_the_library_raises_is_exported_and_documented():
    """A user catches what the docs name with ``from redis_router import ...``."""
    import redis_router
    from redis_router import errors

    raised = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type)
        and issubclass(obj, Exception)
        and obj.__module__ == errors.__name__
    }
    assert "ReplicaEjected" in raised
    assert raised <= set(redis_router.__all__), raised - set(redis_router.__all__)
    docs = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    assert [name for name in sorted(raised) if f"`{name}`" not in docs] == []


def _sketch_params(args: str) -> list[str]:
    """``a, b=None, *, c=1, **kw`` -> ["a", "b", "*", "c", "**kw"] (top-level commas only)."""
    out, depth, part = [], 0, ""
    for ch in args + ",":
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(part.strip().split("=")[0].strip())
            part = ""
        else:
            part += ch
    return [p for p in out if p]


def test_the_readme_api_sketch_has_the_real_signatures():
    """Names, order and the keyword-only marker of every parameter the sketch spells out."""
    import inspect

    sketch = README[README.index("## API") : README.index("## Key schema")]
    sketch = sketch[
        sketch.index("```python") : sketch.index("```\n", sketch.index("```python") + 9)
    ]
    calls = re.findall(r"(?:lb\.|lb = )(\w+)\(((?:[^()]|\([^()]*\))*)\)", sketch, flags=re.S)
    checked = 0
    for method, args in calls:
        target = RedisLoadBalancer.__init__ if method == "RedisLoadBalancer" else None
        target = target or getattr(RedisLoadBalancer, method)
        params = _sketch_params(" ".join(args.split()))
        if not all(p == "*" or p.lstrip("*").isidentifier() for p in params):
            continue  # placeholders such as {id: value}: not a parameter list
        real = []
        for p in list(inspect.signature(target).parameters.values())[1:]:
            if p.kind is p.KEYWORD_ONLY and "*" not in real:
                real.append("*")
            real.append({p.VAR_KEYWORD: "**", p.VAR_POSITIONAL: "*"}.get(p.kind, "") + p.name)
        assert params == real, method
        checked += 1
    assert checked >= 8


def test_help_says_what_each_command_does_without_a_url(capsys):
    """demo and simulate start a private server when given no URL; the rest use localhost."""
    for name in cli.COMMANDS:
        parser = cli.build_parser([name])
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        private = name in ("demo", "simulate")
        assert ("else a private server started for the run" in text) is private, name
        assert ("else redis://localhost:6379/0" in text) is not private, name
