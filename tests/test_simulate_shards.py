"""The sharded-placement model (`redis-router simulate --shards`): its bookkeeping against
brute force, its schemes' costs, determinism per seed, and the findings docs/design.md cites
(seeded runs, so each is a fixed computation, not a draw)."""

from __future__ import annotations

import io
import random
import subprocess
import sys

import pytest

from redis_router.tools import simulate_shards as sim

SIZE = sim.Size.quick()


def test_the_pool_keeps_its_max_and_total_as_counts_move():
    rng = random.Random(7)
    pool = sim.Pool(16, 4, random.Random(1))
    for _ in range(2000):
        r = rng.randrange(16)
        if pool.load[r] and rng.random() < 0.5:
            pool.add(r, -1)
        else:
            pool.add(r, 1)
        assert pool.top == max(pool.load) and pool.total == sum(pool.load)
    for shard in range(4):
        counts = [pool.load[r] for r in pool.members(shard)]
        assert pool.summary(shard) == (min(counts), sum(counts) / 4)
        chosen = pool.least_loaded(pool.members(shard))
        assert pool.shard_of(chosen) == shard and pool.load[chosen] == min(counts)


def test_a_run_is_a_function_of_its_seed():
    a = sim.run("agent", 4, "p2", 3, SIZE)
    assert a == sim.run("agent", 4, "p2", 3, SIZE)
    assert a != sim.run("agent", 4, "p2", 4, SIZE)


@pytest.mark.parametrize(
    ("scheme", "calls"), [("hash", 0.0), ("p2-stale", 0.0), ("jiq", 0.0), ("rr", 0.0),
                          ("p2", 2.0), ("p2-guided", 2.0), ("best", 4.0), ("directory", 1.0)]
)  # fmt: skip
def test_each_scheme_makes_the_calls_it_names(scheme, calls):
    got = sim.run("agent", 4, scheme, 1, SIZE)
    assert got.calls == calls
    if scheme == "hash":
        assert got.away == 0.0
    else:  # about (K - 1) / K of the sessions land off their hash shard
        assert 0.6 < got.away < 0.9


def test_groups_placed_as_units_keep_the_hit_rate_and_samples_placed_alone_lose_it():
    ceiling = (sim.GROUP - 1) / sim.GROUP
    for k in (1, 4, 16):
        assert sim.run("grpo", k, "global" if k == 1 else "directory", 1, SIZE).hit == ceiling
    alone = sim.run("grpo-per-request", 4, "p2", 1, SIZE).hit
    assert alone < ceiling - 0.2


def test_the_directory_balances_a_burst_as_the_whole_pool_does_and_reads_herd():
    """Seeds 1-2, rollout steps: the directory within 5 % of global least loaded at 16
    shards; every scheme that chooses on a read (or a hash) far above it."""
    for workload in ("agent", "grpo"):
        base = [sim.run(workload, 1, "global", s, SIZE).balance for s in (1, 2)]
        for scheme, bound in (("directory", 1.05),):
            got = [sim.run(workload, 16, scheme, s, SIZE).balance for s in (1, 2)]
            assert max(g / b for g, b in zip(got, base, strict=True)) <= bound
        for scheme in ("hash", "p2", "best"):
            got = [sim.run(workload, 16, scheme, s, SIZE).balance for s in (1, 2)]
            assert min(g / b for g, b in zip(got, base, strict=True)) > 1.15, scheme


def test_main_prints_a_row_per_workload_shard_count_and_scheme_then_the_targets():
    out = io.StringIO()
    assert sim.main(1, True, out, seeds=1, shards=(1, 4)) == 0
    lines = out.getvalue().splitlines()
    rows = [ln for ln in lines if ln.split()[:1] and ln.split()[0] in
            (*sim.WORKLOADS, "grpo-per-request")]  # fmt: skip
    per_workload = 1 + (len(sim.SCHEMES) - 1)  # global at K = 1, every other scheme at K = 4
    assert len(rows) == len(sim.WORKLOADS) * per_workload + 2
    targets = [ln for ln in lines if ln.startswith(f"- {sim.CHOSEN}: ")]
    assert len(targets) == 2 and all(ln.endswith(("met", "NOT met")) for ln in targets)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sim.run("agent", 3, "p2", 1, SIZE), "shards must divide 64"),
        (lambda: sim.run("chat", 4, "p2", 1, SIZE), "workload must be one of"),
        (lambda: sim.run("agent", 4, "p3", 1, SIZE), "scheme must be one of"),
        (lambda: sim.main(1, True, io.StringIO(), seeds=0), "seeds must be an int"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_command_line_runs_it_and_refuses_a_shard_count_that_does_not_divide():
    cli = [sys.executable, "-m", "redis_router.cli", "simulate"]
    ok = subprocess.run([*cli, "--shards", "1,2", "--quick", "--seeds", "1"],
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("placement model: 64 replicas")
    bad = subprocess.run([*cli, "--shards", "3", "--quick"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "--shards must divide 64 replicas, got [3]" in bad.stderr
