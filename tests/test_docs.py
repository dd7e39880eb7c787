"""What a new user reads matches what the code does: CI runs the README's commands as written,
every command and metric is documented for operators, and the docs' command output is what the
commands print (docs/generate.py regenerates it; these tests fail when the text has drifted)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from redis_router import RedisLoadBalancer, cli
from redis_router.local_server import first_server_binary

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def section(heading: str, text: str = README) -> str:
    """The README section under ``heading`` (a line starting ``## ``), up to the next one."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


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
    # Then the exhaustive tier, as the README's Tests section writes it, in that same venv.
    tests = section("## Tests")
    exhaustive = next(
        line.split("  #")[0].strip()
        for line in re.search(r"```bash\n(.*?)```", tests, flags=re.S).group(1).splitlines()
        if "--tier exhaustive" in line
    )
    assert exhaustive == "python -m pytest --tier exhaustive", exhaustive
    assert exhaustive in stripped, f".ci/run does not run the README's {exhaustive!r}"
    at = stripped.index(exhaustive)
    assert at > stripped.index("pip install -e '.[test]' && python -m pytest")
    assert (
        stripped[at + 1] == ")" and "source .venv-readme-test/bin/activate" in stripped[at - 3 : at]
    )
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
    operating = section("## Operating it")
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

    sketch = section("## API at a glance")
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


def test_the_readme_is_short_enough_to_read_to_the_end():
    """What it is, install, quick start, the API at a glance, links; the rest lives in docs/."""
    assert len(README.splitlines()) <= 300


def test_the_quick_tier_runs_a_test_of_every_test_file():
    """``python -m pytest`` (the quick tier) still reaches every module: each test file that
    collects any test has at least one in the quick tier; and the tiers do not overlap."""

    def collect(*args: str) -> set[str]:
        command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        out = subprocess.run(
            [*command, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return {line for line in out.stdout.splitlines() if "::" in line}

    quick, rest = collect(), collect("--tier", "exhaustive")
    assert quick and not quick & rest
    files = {item.split("::")[0] for item in quick | rest}
    missing = sorted(f for f in files if not any(i.startswith(f + "::") for i in quick))
    assert missing == [], f"no test of these files runs in the quick tier: {missing}"


# `pip install ARGS` wherever a page or CI tells someone to run it.
PIP_INSTALL = re.compile(r"pip install ([^`\n&;|#)]*)")
TAKES_A_VALUE = {"-r", "-c", "-t", "-i", "-f", "--target", "--index-url", "--extra-index-url"}
OURS = {"llm-redis-router", "redis-router"}  # published on no index (PyPI's is another project)


def _install_targets(args: str) -> list[str]:
    try:
        words = shlex.split(args)
    except ValueError:  # a quote the excerpt cut
        words = args.replace("'", " ").replace('"', " ").split()
    targets, skip = [], False
    for word in words:
        if skip or word in TAKES_A_VALUE:
            skip = not skip
            continue
        if not word.startswith("-"):
            targets.append(word)
    return targets


def test_every_install_line_installs_from_a_checkout_or_a_built_wheel():
    """This project is not on the package index: an install line naming it by name fails on a
    fresh machine. Each, in the docs, CI and the library's messages, must install a local path
    (`-e .`, a checkout), the wheel that `python -m build --wheel` writes (its version the
    project's), or the published packages an extra stands for."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version
    wheel = f"dist/llm_redis_router-{version[1]}-py3-none-any.whl"
    pages = [ROOT / "README.md", ROOT / ".ci" / "run", *sorted((ROOT / "docs").glob("*.md"))]
    pages += sorted((ROOT / "redis_router").rglob("*.py")) + sorted(ROOT.glob("benchmarks/*.py"))
    offenders, wheels = [], 0
    for page in pages:
        for m in PIP_INSTALL.finditer(page.read_text()):
            for target in _install_targets(m[1]):
                if "llm_redis_router-" in target:
                    wheels += 1
                    if not target.startswith(wheel):
                        offenders.append(f"{page.name}: {target} (the wheel built is {wheel})")
                    continue
                name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", target)
                local = target.startswith((".", "/", "$", "~")) or "@" in target
                if name and not local and name[0].lower().replace("_", "-") in OURS:
                    offenders.append(f"{page.name}: pip install {m[1].strip()}")
    assert offenders == []
    assert wheels >= 2  # the README's install section and verl.md's
    assert "python -m build --wheel" in section("## Install")
