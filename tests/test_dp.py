"""Data-parallel ranks as routing units (redis_router.dp): a replica registered with
``dp_size`` is routed per rank, and administered by its id."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest
import redis

from redis_router import AsyncRedisLoadBalancer, NoCapacity, RouterClient, dp
from redis_router.cli import main as cli
from redis_router.cli.common import Balancer, snapshot
from redis_router.cli.status import render
from redis_router.http import RouterTransport
from redis_router.tools import simulate

DP8 = {"url": "http://10.0.0.1:8000", "dp_size": 8}


def units(replica: str, n: int) -> list[str]:
    return [f"{replica}#dp{k}" for k in range(n)]


# -- registration ----------------------------------------------------------------------------


def test_a_replica_with_dp_size_is_registered_as_one_pool_member_per_rank(make_lb):
    lb = make_lb({"s0": DP8, "plain": {"url": "http://10.0.0.2:8000"}})
    assert lb.get_all_servers() == sorted(["plain", *units("s0", 8)])
    meta = lb.get_status()["replicas"]["s0#dp5"]["metadata"]
    assert meta == {**DP8, "dp_rank": 5}


def test_the_grant_names_the_rank_and_the_helpers_turn_it_into_what_each_engine_reads(make_lb):
    lb = make_lb({"s0": DP8})
    lease = lb.acquire("session-1")
    replica, rank = dp.replica_of(lease.server_id)
    assert replica == "s0" and lease.handle["dp_rank"] == rank
    assert dp.vllm_headers(lease.handle) == {"X-data-parallel-rank": str(rank)}
    assert dp.sglang_fields(lease.handle) == {"routed_dp_rank": rank}
    assert dp.sglang_fields(lease.handle, legacy=True) == {"data_parallel_rank": rank}
    assert dp.vllm_headers({"url": "http://x"}) == {} == dp.sglang_fields("http://x")


@pytest.mark.parametrize(
    ("size", "error", "words"),
    [
        ("8", TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
        (2.0, TypeError, "must be an int"),
        (0, ValueError, "from 1 to 1024"),
        (1025, ValueError, "from 1 to 1024"),
    ],
)
def test_a_bad_dp_size_is_refused_naming_the_argument_and_writes_nothing(
    make_lb, r, size, error, words
):
    lb = make_lb()
    with pytest.raises(error, match=words) as caught:
        lb.add_servers({"ok": {"url": "http://a"}, "s0": {"url": "http://b", "dp_size": size}})
    assert "servers['s0']['dp_size']" in str(caught.value)
    assert r.keys("*") == []


def test_ids_of_the_form_of_a_rank_are_reserved(make_lb, r):
    lb = make_lb()
    with pytest.raises(ValueError, match="reserved for rank k"):
        lb.add_servers({"s0#dp3": {"url": "http://a"}})
    with pytest.raises(ValueError, match="'dp_size' only"):
        lb.add_servers({"s0": {"url": "http://a", "dp_size": 2, "dp_rank": 1}})
    assert r.keys("*") == []
    lb.add_servers({"s0#dpx": "http://a", "#dp1": "http://b", "s0#dp01": "http://c"})
    assert lb.get_all_servers() == ["#dp1", "s0#dp01", "s0#dpx"]


def test_registering_again_with_another_size_leaves_exactly_the_new_ranks(make_lb):
    lb = make_lb({"s0": {"url": "http://a"}})
    lb.add_servers({"s0": {"url": "http://a", "dp_size": 4}})
    assert lb.get_all_servers() == units("s0", 4)
    lb.add_servers({"s0": {"url": "http://a", "dp_size": 2}})
    assert lb.get_all_servers() == units("s0", 2)
    lb.add_servers({"s0": {"url": "http://a"}})
    assert lb.get_all_servers() == ["s0"]


# -- routing ---------------------------------------------------------------------------------


def test_every_turn_of_a_session_reaches_the_same_rank(make_lb):
    lb = make_lb({"s0": DP8, "s1": {**DP8, "url": "http://10.0.0.2:8000"}})
    first: dict[str, str] = {}
    rng = random.Random(3)
    sessions = [f"conv-{i}" for i in range(48)]
    for _turn in range(8):
        rng.shuffle(sessions)
        leases = [lb.acquire(s) for s in sessions]
        for s, lease in zip(sessions, leases, strict=True):
            assert first.setdefault(s, lease.server_id) == lease.server_id
        for lease in leases:
            lease.release().result()
    # new sessions spread over every rank of both replicas (least loaded places them)
    assert set(first.values()) == set(units("s0", 8) + units("s1", 8))


def test_a_declared_capacity_applies_to_each_rank(make_lb):
    lb = make_lb({"s0": {"url": "http://a", "dp_size": 3, "capacity": 2}})
    assert {r["capacity"] for r in lb.get_status()["replicas"].values()} == {2}
    leases = [lb.acquire(f"req-{i}") for i in range(6)]
    assert sorted(lease.server_id for lease in leases) == sorted(units("s0", 3) * 2)
    with pytest.raises(NoCapacity):
        lb.acquire("one-too-many")
    leases[0].release().result()
    assert lb.acquire("now-fits").server_id == leases[0].server_id


def test_capacity_given_by_replica_id_applies_to_each_rank(make_lb):
    lb = make_lb()
    lb.add_servers({"s0": {"url": "http://a", "dp_size": 2}}, capacity={"s0": 1})
    assert {r["capacity"] for r in lb.get_status()["replicas"].values()} == {1}


def test_a_resent_acquire_returns_the_same_lease_on_the_same_rank(make_lb):
    lb = make_lb({"s0": DP8})
    first = lb.acquire("session-r", token="tok-1")
    again = lb.acquire("session-r", token="tok-1")
    assert (again.server_id, again.token) == (first.server_id, first.token)
    assert lb.get_total_inflight() == 1


# -- administration by replica id ------------------------------------------------------------


def test_removing_a_replica_by_its_id_removes_all_its_ranks(make_lb):
    lb = make_lb({"s0": DP8, "s1": {"url": "http://b", "dp_size": 2}})
    assert lb.remove_servers(["s0"]) == 8
    assert lb.get_all_servers() == units("s1", 2)
    assert all(dp.replica_of(lb.acquire(f"x{i}").server_id)[0] == "s1" for i in range(8))


def test_draining_a_replica_by_its_id_drains_all_its_ranks_and_keeps_their_sessions(make_lb):
    lb = make_lb({"s0": {"url": "http://a", "dp_size": 4}, "s1": {"url": "http://b"}})
    pinned = {f"old-{i}": lb.acquire(f"old-{i}").server_id for i in range(10)}
    assert lb.drain_servers(["s0"]) == 4
    status = lb.get_status()
    assert status["draining_servers"] == units("s0", 4)
    assert status["dp_replicas"]["s0"]["draining"] is True
    assert {lb.acquire(f"new-{i}").server_id for i in range(8)} == {"s1"}
    assert all(lb.acquire(s).server_id == sid for s, sid in pinned.items())
    assert lb.undrain_servers(["s0"]) == 4
    assert lb.get_status()["draining_servers"] == []


def test_a_rank_can_still_be_drained_alone_by_its_unit_id(make_lb):
    lb = make_lb({"s0": {"url": "http://a", "dp_size": 4}})
    assert lb.drain_servers(["s0#dp2"]) == 1
    assert lb.get_status()["draining_servers"] == ["s0#dp2"]


def test_the_asyncio_balancer_registers_and_drains_ranks_alike(server):
    async def main() -> tuple[list[str], int, str]:
        async with AsyncRedisLoadBalancer(redis=server.url, name="dp-aio") as lb:
            await lb.add_servers({"s0": {"url": "http://a", "dp_size": 2}})
            lease = await lb.acquire("s")
            drained = await lb.drain_servers(["s0"])
            return await lb.get_all_servers(), drained, lease.handle["dp_rank"]

    ids, drained, rank = asyncio.run(main())
    assert ids == units("s0", 2) and drained == 2 and rank in (0, 1)


# -- status ----------------------------------------------------------------------------------


def test_status_groups_ranks_under_their_replica(make_lb, server):
    lb = make_lb({"s0": {"url": "http://a", "dp_size": 3}, "p": {"url": "http://b"}})
    held = [lb.acquire(f"q{i}") for i in range(4)]
    lb.drain_servers(["s0#dp1"])
    group = lb.get_status()["dp_replicas"]
    assert list(group) == ["s0"]
    assert group["s0"]["dp_size"] == 3 and group["s0"]["units"] == units("s0", 3)
    ranks_load = sum(h.server_id != "p" for h in held)
    assert group["s0"]["inflight"] == ranks_load and group["s0"]["draining"] is False

    client = redis.Redis.from_url(server.url)
    try:
        snap = snapshot(Balancer(client, lb.name, server.url))
    finally:
        client.close()
    assert snap["dp_replicas"]["s0"]["units"] == units("s0", 3)
    table = render(snap).splitlines()
    at = next(i for i, line in enumerate(table) if line.startswith("s0 "))
    assert "3 ranks" in table[at] and '"dp_size":3' in table[at]
    assert [line.split()[0] for line in table[at + 1 : at + 4]] == units("s0", 3)
    assert all(line.startswith("  s0#dp") for line in table[at + 1 : at + 4])
    assert table[at + 2].split()[1] == "draining"


# -- the httpx transport ---------------------------------------------------------------------


def test_the_httpx_transport_sends_the_rank_header_and_field_to_the_granted_rank(make_lb):
    lb = make_lb({"s0": {"url": "http://replica", "dp_size": 4}})
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    client = httpx.Client(transport=RouterTransport(lb, transport=httpx.MockTransport(upstream)))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        resp = client.post(
            "http://router/v1/chat/completions", json=body, headers={"X-Session-ID": "conv"}
        )
        assert resp.status_code == 200
    ranks = {
        (r.headers["X-data-parallel-rank"], json.loads(r.content)["routed_dp_rank"]) for r in seen
    }
    assert len(ranks) == 1
    header, field = ranks.pop()
    assert int(header) == field and 0 <= field < 4
    assert all(json.loads(r.content)["messages"] == body["messages"] for r in seen)
    assert all(int(r.headers["content-length"]) == len(r.content) for r in seen)


# -- the simulator row -----------------------------------------------------------------------


def test_the_simulator_dp_rows_keep_sessions_on_their_rank_and_multiply_the_hit_rate(
    server, capsys
):
    """`simulate --kv --quick --workloads dp`: 32 sessions of 8 turns on 2 servers x 8 ranks.
    Rank-aware is sticky per rank, so every turn reaches its session's rank; rank-blind
    reaches it with probability 1/8 (224 turns: 40 % is over 10 standard deviations away)."""
    argv = ["--kv", "--quick", "--workloads", "dp", "--redis", server.url, "--seeds", "2"]
    assert simulate.main(argv) == 0
    printed = capsys.readouterr().out
    rows = {
        cells[1]: cells[2:]
        for line in printed.splitlines()
        if line.startswith("| dp | ")
        for cells in [line.strip("| ").split(" | ")]
    }
    assert set(rows) == {"rank-aware", "rank-blind"}
    (units_a, hit_a, same_a, req_a), (units_b, hit_b, same_b, req_b) = (
        rows["rank-aware"],
        rows["rank-blind"],
    )
    assert (units_a, units_b, req_a, req_b) == ("16", "2", "256", "256")

    def pct(cell: str) -> float:
        return float(cell.split("%")[0])

    assert same_a.startswith("100.0% (100.0-100.0)")
    assert pct(same_b) < 40.0
    assert pct(hit_a) >= 4 * pct(hit_b) and pct(hit_a) > 30.0
    assert "(target >= 99%" in printed and "(target >= 5x)" in printed
    with server.client() as c:
        assert list(c.scan_iter(match="rr:{kvdp-*")) == []


# -- the exact KV index ----------------------------------------------------------------------


def test_each_rank_reads_only_its_own_kv_events_publisher():
    from redis_router.kv_events import StreamEndpoint, streams_of

    listed = {
        "kv_events": [f"tcp://h:{5557 + k}" for k in range(4)],
        "kv_events_replay": [f"tcp://h:{5565 + k}" for k in range(4)],
        "dp_size": 4,
    }
    units_meta, _, _ = dp.expand({"s0": listed}, None)
    assert streams_of("s0#dp2", units_meta["s0#dp2"]) == [
        StreamEndpoint("s0#dp2", 0, 1, "tcp://h:5559", "tcp://h:5567")
    ]
    one = {"kv_events": "tcp://h:5557", "dp_size": 4}
    units_meta, _, _ = dp.expand({"s0": one}, None)
    assert streams_of("s0#dp3", units_meta["s0#dp3"]) == [
        StreamEndpoint("s0#dp3", 0, 1, "tcp://h:5560", None)
    ]
    with pytest.raises(ValueError, match="dp_rank 5 but 4 kv_events endpoints"):
        streams_of("s0#dp5", {**listed, "dp_rank": 5})


def test_a_router_client_session_yields_the_rank_in_its_handle_and_releases_it(make_lb):
    lb = make_lb({"s0": {"url": "http://a", "dp_size": 4}})
    client = RouterClient(lb)
    with client.session_sync("conv") as (server_id, handle):
        assert server_id == f"s0#dp{handle['dp_rank']}"
        assert dp.vllm_headers(handle) == {"X-data-parallel-rank": str(handle["dp_rank"])}
        assert lb.get_inflight_count(server_id) == 1
    assert lb.get_total_inflight() == 0


# -- health probes ---------------------------------------------------------------------------


class _Counting(BaseHTTPRequestHandler):
    hits: ClassVar[dict[str, int]] = {}

    def do_GET(self) -> None:
        _Counting.hits[self.path] = _Counting.hits.get(self.path, 0) + 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_the_health_command_probes_a_replica_once_and_ejects_all_its_ranks_together(
    make_lb, server, capsys
):
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    live = f"http://127.0.0.1:{http.server_address[1]}"
    _Counting.hits.clear()
    try:
        lb = make_lb(
            {
                "dead": {"url": "http://127.0.0.1:1", "dp_size": 4},
                "up": {"url": live, "dp_size": 2},
                "p0": {"url": live + "/p"},
                "p1": {"url": live + "/p"},
            },
            eject_after=1,
            max_ejected=0.5,
        )
        lb.acquire("pins-the-settings").release().result()
        assert cli(["health", "--redis", server.url, "--name", lb.name, "--once"]) == 0
        assert _Counting.hits == {"/health": 1, "/p/health": 1}
        status = lb.get_status()
        assert status["ejected_servers"] == units("dead", 4)
        assert status["dp_replicas"]["dead"]["ejected_units"] == units("dead", 4)
        assert status["dp_replicas"]["up"]["ejected_units"] == []
        out = capsys.readouterr().out
        assert all(f"dead#dp{k}: ejected" in out for k in range(4)), out
    finally:
        http.shutdown()
        http.server_close()


def test_the_inflight_count_of_a_replica_id_sums_its_ranks(make_lb):
    lb = make_lb({"s0": {"url": "http://a", "dp_size": 4}, "p": {"url": "http://b"}})
    held = [lb.acquire(f"q{i}") for i in range(10)]
    on_ranks = sum(h.server_id != "p" for h in held)
    assert lb.get_inflight_count("s0") == on_ranks
    assert lb.get_inflight_count("p") == 10 - on_ranks
    assert lb.get_inflight_count(held[0].server_id) >= 1
    assert lb.get_inflight_count("nobody") == 0


def test_a_rank_may_declare_its_own_capacity_over_its_replicas(make_lb):
    lb = make_lb()
    lb.add_servers({"s0": {"url": "http://a", "dp_size": 3}}, capacity={"s0#dp1": 5, "s0": 2})
    caps = {sid: r["capacity"] for sid, r in lb.get_status()["replicas"].items()}
    assert caps == {"s0#dp0": 2, "s0#dp1": 5, "s0#dp2": 2}


def test_the_async_httpx_transport_sends_the_rank_too_and_plain_replicas_get_nothing(server):
    from redis_router.http import AsyncRouterTransport

    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    async def main() -> None:
        async with AsyncRedisLoadBalancer(redis=server.url, name="dp-async-http") as lb:
            await lb.add_servers({"s0": {"url": "http://a", "dp_size": 2}, "p": "http://b"})
            inner = httpx.MockTransport(upstream)
            transport = AsyncRouterTransport(lb, transport=inner)
            async with httpx.AsyncClient(transport=transport) as client:
                await lb.drain_servers(["p"])
                resp = await client.post("http://router/generate", json={"text": "hi"})
                assert resp.status_code == 200
                await lb.drain_servers(["s0"])
                await lb.undrain_servers(["p"])
                resp = await client.post("http://router/generate", json={"text": "hi"})
                assert resp.status_code == 200
            assert await lb.remove_servers(["s0"]) == 2
            assert await lb.get_all_servers() == ["p"]

    asyncio.run(main())
    ranked, plain = seen
    rank = json.loads(ranked.content)["routed_dp_rank"]
    assert ranked.url.host == "a" and ranked.headers["x-data-parallel-rank"] == str(rank)
    assert plain.url.host == "b" and "x-data-parallel-rank" not in plain.headers
    assert json.loads(plain.content) == {"text": "hi"}


# -- prefix-cache routing --------------------------------------------------------------------


def test_the_prefix_cache_plugin_sends_a_repeated_prompt_to_the_same_rank(server, r):
    from redis_router.plugins.prefix_cache import PrefixCacheRouter

    servers = {"s0": {"url": "http://a", "dp_size": 4}, "s1": {"url": "http://b", "dp_size": 4}}
    lb = PrefixCacheRouter(
        servers, router_kwargs={"redis": server.url, "name": "dp-pc", "rng": random.Random(3)}
    )
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(50_000) for _ in range(20 * 32)] for _ in range(4)]
        first = {}
        for k in range(8):  # GRPO samples of 4 prompts under fresh request ids
            for j, p in enumerate(prompts):
                sid, handle = lb.acquire_server(f"g{j}-{k}", prompt_ids=p)
                assert first.setdefault(j, sid) == sid
                assert sid == f"{dp.replica_of(sid)[0]}#dp{handle['dp_rank']}"
                lb.release_server(sid, f"g{j}-{k}")
        assert len(set(first.values())) > 1  # the prompts spread over the ranks
    finally:
        lb.close()
