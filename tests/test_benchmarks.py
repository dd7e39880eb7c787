"""The benchmark entry point still runs and still reports every comparison it names.

Structure only: timings on a shared machine prove nothing in a test, so no number is
compared with a target here (``python -m benchmarks`` does that and prints PASS / FAIL).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from benchmarks.__main__ import ROW_IDS
from redis_router.local_server import find_server_binaries, first_server_binary

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(first_server_binary() is None, reason="no server binary found"),
]


def _on_functions_server(module: str, *args: str) -> str:
    """``python -m benchmarks.<module> ARGS --server-bin <a 7+ binary>``'s output, run in this
    checkout; it must exit 0."""
    binary = next((b for b in find_server_binaries() if b.version_tuple >= (7,)), None)
    assert binary is not None, "no server binary with Functions found"
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args, "--server-bin", binary.path],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout or "FAIL" in done.stdout, done.stdout
    return json.loads(out.read_text())


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_every_comparison_is_reported_or_skipped_with_a_reason(report):
    got = [r["id"] for r in report["rows"]]
    assert len(got) == len(set(got))
    for rid in ROW_IDS:
        assert (rid in got) != (rid in report["skipped"]), rid
    assert all(report["skipped"].values())


def test_measurements_are_positive_and_finite(report):
    for row in report["rows"]:
        value = row["value"]
        if row["id"] == "watch_retry_rate":
            assert _finite(value) and value >= 0, row
        else:
            assert _finite(value) and value > 0, row
        for key in ("baseline_value", "ratio"):
            if row[key] is not None:
                assert _finite(row[key]) and row[key] > 0, (key, row)


def test_rows_with_a_target_carry_a_verdict(report):
    for row in report["rows"]:
        if row["target"] is not None:
            assert row["passed"] in (True, False), row
            assert row["target"].split()[0] in ("<=", ">="), row


def test_batch_routes_exactly_as_sequential_acquires(report):
    rows = {r["id"]: r for r in report["rows"]}
    for rid in ("batch_sync", "batch_async"):
        assert rows[rid]["extra"]["verified_same_as_sequential"] is True


def test_report_names_the_server_and_the_sizes(report):
    assert report["quick"] is True
    assert Path(report["server"]["path"]).exists()
    assert report["sizes"]["sessions"] > 0


def worktree_paths() -> list[str]:
    """The repository's worktrees by path (their HEADs move as other checkouts commit)."""
    listed = subprocess.run(
        ["git", "worktree", "list", "--porcelain"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split(" ", 1)[1] for line in listed.splitlines() if line.startswith("worktree ")]


def test_ab_measures_both_trees_and_prints_every_measure():
    """``python -m benchmarks.ab`` against this checkout's own HEAD: both trees run and every
    measure gets a finite before, after and ratio."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout

    worktrees = worktree_paths()
    sizes = ["--rounds", "1", "--seconds", "0.5", "--pairs", "50"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ab", git("rev-parse", "HEAD").strip(), *sizes],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:]}
    measures = ("pair_us", "pair_redis_us", "tp_per_s", "tp_client_cpu_us", "tp_redis_cpu_us")
    for measure in (*measures, "tp_solo_per_s", "apair_us", "apair_client_cpu_us", "ahttp_p50_us"):
        ratio = lines[measure][-1]
        assert ratio.endswith("x") and math.isfinite(float(ratio[:-1])) and float(ratio[:-1]) > 0
    # the routed request's excess over a direct one: finite (its sign is the machine's)
    assert math.isfinite(float(lines["ahttp_added_p50_us"][-1][:-1]))
    assert worktree_paths() == worktrees  # the temporary one is removed


@pytest.mark.quick  # the module's test in the quick tier
def test_ab_refuses_an_unknown_measure_naming_the_allowed_ones():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ab", "HEAD", "--only", "pair,latency"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--only: unknown latency; allowed: pair, apair, ahttp, instructions" in done.stderr


def test_script_ab_times_both_versions_call_by_call():
    """``python -m benchmarks.script_ab`` against the commit that sent the settings as one
    map (the last change of the arguments the client sends):
    both versions' scripts run on one server (an A/A run while no script has changed since)
    and every script and size gets a finite before, after and ratio."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout

    worktrees = worktree_paths()
    rev = git("log", "--format=%H", "-1", "--grep", "Settings cross into Lua as one map by name")
    rev = rev.strip()
    assert rev
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.script_ab", rev, "--calls", "30"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in done.stdout.splitlines()[3:]}
    assert set(rows) == {
        f"{s} x{b}" for s in ("acquire", "release", "pair", "wall") for b in (1, 8)
    }
    for values in rows.values():
        assert len(values) == 6 and all(math.isfinite(float(v)) and float(v) > 0 for v in values)
    assert worktree_paths() == worktrees  # the temporary one is removed


def test_script_ab_paths_times_evalsha_against_fcall():
    """``--paths``: this checkout's scripts by EVALSHA and by FCALL on one Redis 7+ server;
    a pair is its acquire's and release's times added."""
    out = _on_functions_server("script_ab", "--paths", "--calls", "30")
    assert out.startswith("before = EVALSHA, after = FCALL")
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in out.splitlines()[3:]}
    assert set(rows) == {
        f"{s} x{b}" for s in ("acquire", "release", "pair", "wall", "noop") for b in (1, 8)
    }
    for b in (1, 8):
        pair, parts = rows[f"pair x{b}"], (rows[f"acquire x{b}"], rows[f"release x{b}"])
        for i in (0, 2):  # trimmed means of before and after
            assert float(pair[i]) == pytest.approx(sum(float(p[i]) for p in parts), abs=0.02)


def test_script_ab_runs_a_revision_with_the_same_scripts_as_an_a_a_comparison():
    """HEAD's scripts are this checkout's: the run says it is A/A and still times both copies
    (REV's under another hash), every row finite."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.script_ab", "HEAD", "--calls", "5", "--batch", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the same acquire and release: A/A" in done.stdout.splitlines()[0]
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in done.stdout.splitlines()[3:]}
    assert set(rows) == {f"{s} x1" for s in ("acquire", "release", "pair", "wall")}
    for values in rows.values():
        assert len(values) == 6 and all(math.isfinite(float(v)) and float(v) > 0 for v in values)


def test_script_ab_fcall_times_two_revisions_as_their_own_functions_libraries():
    """``REV --fcall``: both revisions' scripts as the Functions libraries their own trees'
    loaders make (HEAD's under another name: an A/A run), each call found in the server's log
    by its function's name, and the no-op call beside them."""
    out = _on_functions_server("script_ab", "HEAD", "--fcall", "--calls", "10", "--batch", "1")
    assert out.startswith("before = HEAD, after = this checkout (FCALL)")
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in out.splitlines()[3:]}
    assert set(rows) == {f"{s} x1" for s in ("acquire", "release", "pair", "wall", "noop")}
    for values in rows.values():
        assert len(values) == 6 and all(math.isfinite(float(v)) and float(v) > 0 for v in values)


def test_pair_profile_names_every_stage_of_both_scripts_and_its_commands():
    """``python -m benchmarks.pair_profile``: each stage of the acquire and of the release gets
    a finite cumulative time, the last being the whole script, and the commands it adds (the
    pick's count, the lease record, the lease ending), counted by the server."""
    from benchmarks import pair_profile

    text = _on_functions_server("pair_profile", "--calls", "20", "--rounds", "1")
    lines = text.splitlines()
    for stages in (pair_profile.ACQUIRE, pair_profile.RELEASE):
        for stage, _ in stages:
            row = re.compile(rf"^  {re.escape(stage)} +(\S+) +[+-]")
            (cumulative,) = [float(m.group(1)) for ln in lines if (m := row.match(ln))]
            assert math.isfinite(cumulative) and cumulative > 0
    assert "ZINCRBY" in text and "HSETNX" in text and "HDEL" in text
    # The bound: the pair, and its own commands replayed without its Lua, against a no-op.
    (commands,) = [ln for ln in lines if ln.startswith("the bound (")]
    made = re.match(r"the bound \((\d+) \+ (\d+) commands a pair", commands)
    assert made and int(made.group(1)) >= 10 and int(made.group(2)) >= 5, commands
    for what in ("the pair", "its commands alone (oracle)"):
        row = re.compile(rf"^  {re.escape(what)} +(\S+) +(\S+)x the no-op$")
        ((us, times),) = [
            (float(m.group(1)), float(m.group(2))) for ln in lines if (m := row.match(ln))
        ]
        assert math.isfinite(us) and us > 0 and times > 1
    (hand,) = [ln for ln in lines if ln.startswith("  the release written by hand")]
    m = re.search(r" (\S+)  \(the library's: (\S+)\)$", hand)
    assert m and all(math.isfinite(float(v)) and float(v) > 0 for v in m.groups()), hand


def test_option_cost_prices_every_option_against_the_default_pair():
    """``python -m benchmarks.option_cost``: a row per option with finite Redis time, ratios
    and commands per pair, the options' own commands beyond the default's (capacity's
    admission reads, groups' entry, prefix_cache's index), and both targets judged."""
    from benchmarks import option_cost

    lines = _on_functions_server("option_cost", "--pairs", "20", "--rounds", "2").splitlines()
    rows = {}
    for ln in lines[2:]:
        m = re.match(r"^(.+?) +(\S+) +(\S+) +(\S+-\S+) +(\S+) +(\S+)(?:  (.*))?$", ln)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    assert {"default", "spread_sessions", "no-op FCALL, one key"} <= set(rows)
    assert len([r for r in rows if r.startswith(("capacity", "groups", "ejection", "engine",
                                                  "prefix_cache"))]) == 5  # fmt: skip
    for label, (us, ratio, _, noop, cmds, extra) in rows.items():
        assert all(math.isfinite(float(v)) and float(v) >= 0 for v in (us, ratio, noop, cmds))
        if label.startswith(("capacity", "groups", "prefix_cache")):
            assert extra and "+" in extra, label  # the option's own commands
    assert float(rows["default"][4]) >= 20  # a new session's pair: ~29 commands
    assert float(rows["no-op FCALL, one key"][4]) == 0
    targets = [ln for ln in lines if ln.startswith("target: ")]
    assert len(targets) == 2 and all(ln.endswith(("(met)", "(NOT met)")) for ln in targets)
    assert option_cost.BATCH == 64


def test_shard_nodes_measures_sharded_pools_one_shard_per_primary_in_turn():
    """``python -m benchmarks.shard_nodes``: the sharded pools' shards land on the primaries in
    turn (K = 3: one each; K = 6: two each), the unsharded pool on one primary (max/mean 3);
    every figure finite; a pair is 2 script calls, and a sharded pool's sessions of 4 turns
    add a directory call per new session (a quarter per pair; its publisher adds a few calls
    per 0.1 s, however long the run takes); the share of pairs that missed the pace."""
    out = _on_functions_server("shard_nodes", "--pairs", "200", "--rounds", "1", "--turns", "4")
    rows = {}
    for ln in out.splitlines()[2:]:
        k, *rest = ln.split()
        rows[int(k)] = rest
    assert set(rows) == {1, 3, 6}
    assert rows[3][0] == "[1,1,1]"
    assert rows[6][0] == "[2,2,2]"
    assert rows[1][1] == "-" and rows[3][1] in ("0", "1", "2")
    for values in rows.values():
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in values[2:8])
        assert 0 <= float(values[8].removesuffix("%")) <= 100  # pairs that missed the pace
    assert float(rows[1][4]) == 3.0
    assert 2.0 <= float(rows[1][7]) < 2.1
    for k in (3, 6):
        assert float(rows[k][7]) >= 2.25, rows[k]


def test_release_records_weighs_both_layouts_at_both_fills(binary):
    """``python -m benchmarks.release_records``: at each fill, a finite size per id and server
    time per call for the set and for the packed hash. Structure only: which layout is smaller
    depends on the fill (the packed one from about one id per field, far above these)."""
    from benchmarks import release_records

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.release_records", "--quick", "--server-bin",
         binary.path],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"server: {binary.label};"), done.stdout
    rows = [ln.split() for ln in done.stdout.splitlines()[2:]]
    assert [int(r[0].replace(",", "")) for r in rows] == release_records.fills(quick=True)
    for row in rows:
        values = [float(v) for v in row[1:]]
        assert len(values) == 4 and all(math.isfinite(v) and v > 0 for v in values), rows


def test_server_bin_may_be_a_link_whose_target_runs_as_named(tmp_path, monkeypatch):
    """As Debian installs it: redis-server links to redis-check-rdb, one binary that acts
    by the name it is run as. ``--server-bin`` must run the link, not what it resolves to."""
    from benchmarks.__main__ import _binary
    from redis_router.local_server import ENV_SERVER_BIN, LocalServer, find_server_binaries

    real = next((b for b in find_server_binaries() if b.kind == "redis"), None)
    if real is None:
        pytest.skip("no Redis binary (Valkey acts the same whatever its name)")
    monkeypatch.setenv(ENV_SERVER_BIN, "")
    checker = tmp_path / "redis-check-rdb"
    checker.symlink_to(real.path)
    (tmp_path / "redis-server").symlink_to(checker.name)
    try:
        binary = _binary(str(tmp_path / "redis-server"))
        assert binary.version == real.version
        with LocalServer(binary) as server:
            assert redis.Redis.from_url(server.url).ping()
    finally:
        monkeypatch.undo()  # _binary set the variable itself
        find_server_binaries(refresh=True)  # forget the temporary path


def test_without_the_kv_events_extra_the_kv_lag_rows_are_skipped_with_a_reason(tmp_path):
    """A [servers,plot] install has no msgspec: ``python -m benchmarks`` still runs."""
    shadow = tmp_path / "shadow" / "msgspec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed', name='msgspec')\n")
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "kv_lag", "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'shadow'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    skipped = json.loads(out.read_text())["skipped"]
    kv_rows = [rid for rid in ROW_IDS if rid.startswith("kv_")]
    assert kv_rows and all("msgspec" in skipped[rid] for rid in kv_rows), skipped
    assert "[kv-events]" in skipped[kv_rows[0]]
