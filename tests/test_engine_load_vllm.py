"""The gauges `redis-router load` reads are the ones vLLM registers: their names are read from
the installed vLLM's own source (vllm/v1/metrics/loggers.py), then written with vLLM's label
names by prometheus_client, as vLLM's /metrics writes them, and parsed back. Needs vllm, which
.ci/run installs in an environment of its own (.venv-vllm) and runs this file there, where a
missing vllm fails it; elsewhere the file is skipped."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from redis_router.engine import EngineLoad
from redis_router.engine_metrics import VLLM, parse

if os.environ.get("REDIS_ROUTER_REQUIRE_VLLM"):  # .ci/run: a missing vllm is a failure
    SPEC = importlib.util.find_spec("vllm.v1.metrics.loggers")
    assert SPEC is not None, "vllm.v1.metrics.loggers not found in the vLLM environment"
else:
    pytest.importorskip("vllm", reason="needs vllm: .ci/run runs this file in .venv-vllm")
    SPEC = importlib.util.find_spec("vllm.v1.metrics.loggers")

# A gauge as vLLM's PrometheusStatLogger makes one: self._gauge_cls(name="...", ...,
# labelnames=labelnames), where labelnames = ["model_name", "engine"].
GAUGE = re.compile(r"self\._gauge_cls\(\s*name=\"([^\"]+)\"(.*?)\n\s*\)", re.S)


def registered_gauges() -> dict[str, str]:
    """Each gauge vLLM's Prometheus logger registers, with the text of its arguments."""
    assert SPEC is not None and SPEC.origin
    source = Path(SPEC.origin).read_text()
    assert 'labelnames = ["model_name", "engine"]' in source
    return {m.group(1): m.group(2) for m in GAUGE.finditer(source)}


def test_the_reporter_reads_gauges_vllm_registers_per_engine():
    gauges = registered_gauges()
    for name in (VLLM.running, VLLM.waiting, VLLM.kv_usage):
        assert name in gauges, f"vLLM registers no gauge {name!r}; its gauges: {sorted(gauges)}"
        assert "labelnames=labelnames" in gauges[name], name


def test_text_with_vllms_names_and_labels_parses_to_its_load():
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    figures = {VLLM.running: (3, 4), VLLM.waiting: (1, 0), VLLM.kv_usage: (0.25, 0.75)}
    for name, per_engine in figures.items():
        assert name in registered_gauges()
        gauge = Gauge(name, name, ["model_name", "engine"], registry=registry)
        for engine, value in enumerate(per_engine):
            gauge.labels("Qwen/Qwen3-0.6B", str(engine)).set(value)
    assert parse(generate_latest(registry).decode()) == ("vllm", EngineLoad(7, 1, 0.5))
