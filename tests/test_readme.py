"""The README's plugin example is real code: extracted from the README and run on a server."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

from omegaconf import OmegaConf

from redis_router import RequestLoadBalancer

from . import invariants

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _block(first_line: str) -> str:
    """The fenced code block of the README whose first line is ``first_line``."""
    for body in re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"README has no code block starting with {first_line!r}")


def test_readme_plugin_example_routes_through_redis(server, r, tmp_path):
    (tmp_path / "random_pick.lua").write_text(_block("-- plugins/random_pick.lua"))
    (tmp_path / "random_pick.py").write_text(_block("# plugins/random_pick.py"))
    config = OmegaConf.create(_block("# plugins/random_pick.yaml"))
    assert config.router_class.endswith("random_pick.RandomPickRouter")
    spec = importlib.util.spec_from_file_location("random_pick", tmp_path / "random_pick.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    servers = {f"s{i}": f"http://10.0.0.{i}" for i in range(4)}
    lb = module.RandomPickRouter(servers, redis=server.url, name="readme")
    assert isinstance(lb, RequestLoadBalancer)
    placed = Counter(lb.acquire_server(f"q{i}")[0] for i in range(200))
    assert invariants.fair(placed, 200, 4), placed  # uniform, held leases notwithstanding
    first = lb.acquire_server("q7")[0]
    assert lb.acquire_server("q7")[0] == first  # sticky, from the core's acquire_all
    assert sum(invariants.check(r, "readme").values()) == 202
