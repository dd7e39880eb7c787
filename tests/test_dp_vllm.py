"""The rank header redis_router.dp sends is the one vLLM reads: checked against the installed
vllm's own source and code. Needs vllm, which .ci/run installs in an environment of its own
(.venv-vllm) and runs this file there, where a missing vllm fails it; elsewhere the file is
skipped."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from redis_router import dp

BASE = "vllm.entrypoints.generate.base.serving"
# The OpenAI endpoints that take the rank from the request (they call the base's reader).
ENDPOINTS = (
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.completion.serving",
)

if os.environ.get("REDIS_ROUTER_REQUIRE_VLLM"):  # .ci/run: a missing vllm is a failure
    importlib.import_module("vllm")
else:
    pytest.importorskip("vllm", reason="needs vllm: .ci/run runs this file in .venv-vllm")


def source_of(module: str) -> str:
    """A module's source as installed, read without importing it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not installed"
    return Path(spec.origin).read_text(encoding="utf-8")


def headers_read(source: str, function: str) -> list[str]:
    """The header names ``function`` reads with ``<...>.headers.get("<name>")``."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "get"
                    and isinstance(call.func.value, ast.Attribute)
                    and call.func.value.attr == "headers"
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                ):
                    names.append(call.args[0].value)
    return names


def test_the_rank_header_is_the_one_vllms_source_reads():
    read = headers_read(source_of(BASE), "_get_data_parallel_rank")
    assert [h.lower() for h in read] == [dp.VLLM_HEADER.lower()]
    for module in ENDPOINTS:
        assert "self._get_data_parallel_rank(raw_request)" in source_of(module), module


def test_vllms_reader_finds_the_rank_in_the_headers_the_helper_gives():
    starlette = importlib.import_module("starlette.datastructures")
    serving = importlib.import_module(BASE)
    reader = serving.GenerateBaseServing._get_data_parallel_rank
    for rank in (0, 5, 1023):
        headers = dp.vllm_headers({"url": "http://h:8000", "dp_size": 1024, "dp_rank": rank})
        request = SimpleNamespace(headers=starlette.Headers(headers=headers))
        assert reader(request) == rank
    assert reader(SimpleNamespace(headers=starlette.Headers(headers={}))) is None
