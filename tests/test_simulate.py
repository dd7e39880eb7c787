"""The simulator: a --quick run drives every router through every workload and cleans up.
No timing assertions: the figures depend on the machine; only structure and sanity."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from redis_router.tools import simulate


def test_grpo_groups_share_a_prompt_under_distinct_request_ids():
    jobs = simulate._jobs("grpo", seed=1, jobs=16, turns=1)
    assert len(jobs) == 16 and all(len(job) == 1 for job in jobs)
    for g in range(2):
        group = [job[0] for job in jobs[g * 8 : (g + 1) * 8]]
        assert len({t.request_id for t in group}) == 8
        assert all(t.prompt == group[0].prompt for t in group)
    assert jobs[0][0].prompt != jobs[8][0].prompt


def test_multi_turn_session_extends_its_own_prompt():
    (session,) = simulate._jobs("multi-turn", seed=1, jobs=1, turns=3)
    assert len({t.request_id for t in session}) == 1
    for before, after in itertools.pairwise(session):
        assert after.prompt[: len(before.prompt) + len(before.output)] == (
            before.prompt + before.output
        )


@pytest.mark.slow
def test_quick_run_reports_every_router_and_workload(server, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert simulate.main(["--quick", "--redis", server.url, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    routers, skipped = simulate.available_routers(list(simulate.ROUTERS))
    assert skipped == [] and report["skipped"] == []
    seen = {(r["workload"], r["router"]) for r in report["results"]}
    assert seen == {(w, r) for w in simulate.WORKLOADS for r in routers}
    for r in report["results"]:
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert r["cached_tokens"] <= r["prompt_tokens"]
        assert r["requests"] >= 48 and r["throughput"] > 0
        assert math.isnan(r["balance"]) or r["balance"] >= 1.0
    bench = report["bench"]
    assert set(bench) == {
        "default",
        "prefix-cached",
        "prefix-unique",
        "ratio-cached",
        "ratio-unique",
    }
    assert all(v > 0 for v in bench.values())
    assert bench["ratio-unique"] == pytest.approx(bench["prefix-unique"] / bench["default"])
    printed = capsys.readouterr().out
    assert all(f"| {w} | {r} |" in printed for w, r in seen)
    assert "GRPO:" in printed and "multi-turn:" in printed and "acquire, 4k-token" in printed
    with server.client() as c:  # every balancer and simulated replica it made was cleaned up
        # (its balancers only: an unclosed balancer of an earlier test may still send a
        # heartbeat, which registers its holder anew after the server was emptied)
        for pattern in ("rr:{sim-*", "rr:{bench-*", "rrsim:*"):
            assert list(c.scan_iter(match=pattern)) == [], pattern


def test_rl_trade_reports_every_row_and_the_targets(server, capsys):
    """Virtual time and a seeded tie-break: the run is deterministic, so its figures are
    checked, not only its structure."""
    assert simulate.main(["--rl", "--quick", "--redis", server.url]) == 0
    printed = capsys.readouterr().out
    for row in ("sticky only", "global gate 2/1.5", "margin 2", "groups, cap 8", "prefix-cache"):
        assert f"| {row} |" in printed
    assert "step time (s)" in printed and "re-prefilled tokens" in printed
    assert "agent long tail:" in printed and "GRPO:" in printed and "every option on:" in printed


def test_rl_trade_moves_sessions_only_with_a_margin_or_the_gate(server):
    from redis_router.tools import simulate_rl

    rows = {(r.workload, r.row): r for r in simulate_rl.run_all(server.url, quick=True)}
    assert rows[("agent", "sticky only")].reprefilled == 0
    assert rows[("agent", "margin 2")].repins > 0
    assert (
        rows[("agent", "global gate 2/1.5")].reprefilled > rows[("agent", "margin 4")].reprefilled
    )
    for r in rows.values():
        assert 0.0 <= r.hit_rate <= 1.0 and r.makespan > 0
    assert rows[("grpo", "groups, cap 8")].hit_rate > rows[("grpo", "sticky only")].hit_rate


def test_kv_replica_reports_what_it_caches_and_evicts_as_events():
    from redis_router.kv_events import BlockRemoved, BlockStored
    from redis_router.tools import simulate_kv as kv

    rep = kv.Replica(capacity=4)
    a = list(range(3 * kv.BLOCK))
    ha = kv.chain(a, 3)
    rep.store(a, ha)
    assert rep.pending == [BlockStored(ha, None, a, kv.BLOCK)]
    b = a[: 2 * kv.BLOCK] + list(range(1000, 1000 + 2 * kv.BLOCK))
    hb = kv.chain(b, 4)
    assert hb[:2] == ha[:2] and rep.cached(hb) == 2
    rep.pending.clear()
    rep.store(b, hb)  # two new blocks on a's first two; a's tail block is evicted first
    assert rep.pending == [
        BlockStored(hb[2:], hb[1], b[2 * kv.BLOCK :], kv.BLOCK),
        BlockRemoved([ha[2]]),
    ]
    assert rep.cached(ha) == 2 and rep.cached(hb) == 4


def test_kv_run_compares_every_router_with_1_8_and_64_clients(server, capsys):
    """Virtual time, seeded tie-breaks: structure and sanity, not the targets."""
    from redis_router.tools import simulate_kv as kv

    assert simulate.main(["--kv", "--quick", "--redis", server.url]) == 0
    printed = capsys.readouterr().out
    rows = [line.split(" | ") for line in printed.splitlines() if line.startswith("| ")]
    # (workload, router, clients, tie-breaks) -> hit rate, max/mean, requests, events
    got = {tuple([r[0][2:], *r[1:4]]): r[4:] for r in rows if r[1] in kv.ROUTERS}
    for w in kv.WORKLOADS:
        for r in ("least-loaded", "approximate", "exact"):
            for c in kv.CLIENTS:
                assert (w, r, str(c), "0") in got
        for r in ("approximate", "exact"):
            for t in kv.TIES:
                assert (w, r, "1", str(t)) in got
        assert (w, "oracle", "-", "0") in got
    for (_w, r, _c, _t), (hit, balance, _req, events) in got.items():
        assert 0.0 <= float(hit.rstrip("%")) <= 100.0
        assert float(balance) >= 1.0
        assert (int(events.strip(" |").replace(",", "")) > 0) == (r == "exact")
    # The shared system prompts: a prefix router beats least-loaded by far.
    hit = {(w, r): float(v[0].rstrip("%")) for (w, r, c, t), v in got.items() if c in "1-"}
    assert hit[("system", "exact")] > hit[("system", "least-loaded")] + 10
    assert hit[("system", "oracle")] > hit[("system", "least-loaded")] + 10
    assert "(target >= 1.3x)" in printed and "clients varies" in printed
    assert "acquire, 4096-token prompt" in printed and "exact on, none exact" in printed
    with server.client() as c:
        assert list(c.scan_iter(match="rr:{kvsim-*")) == []
        assert list(c.scan_iter(match="rr:{kvc-*")) == []
