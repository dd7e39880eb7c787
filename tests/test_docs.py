"""What a new user reads matches what the code does: CI runs the README's commands as written,
every command and metric is documented for operators, and the docs' command output is what the
commands print (docs/generate.py regenerates it; these tests fail when the text has drifted)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

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
