"""VerlRouter by itself, without Ray or verl: pool ownership, unusable grants, config forms.

What verl's own code does with the router is in test_verl_real.py (verl 0.9.1 under Ray);
these tests check what needs no verl, on every server binary.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from redis_router import RequestLoadBalancer, VerlRouter
from redis_router.verl import UnusableReplica, config_path, pool_name

from . import invariants

VERL_YAML = Path(__file__).resolve().parents[1] / "plugins" / "verl.yaml"


class ActorHandle:
    """Stands in for a Ray actor handle: not JSON, so Redis stores it as null."""

    def __init__(self, sid: str) -> None:
        self.sid = sid


def handles(*ids: str) -> dict[str, ActorHandle]:
    return {sid: ActorHandle(sid) for sid in ids}


def router(server: Any, servers: dict[str, Any] | None, **config: Any) -> VerlRouter:
    """A router built the way verl builds one from verl.yaml: (servers, yaml dict)."""
    yaml = OmegaConf.to_container(OmegaConf.load(VERL_YAML), resolve=True)
    assert isinstance(yaml, dict)
    return VerlRouter(servers, {**yaml, "redis": server.url, **config})


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_verl_yaml_names_this_class_and_reads_its_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:6380/2")
    monkeypatch.delenv("VERL_FULL_DETERMINISM", raising=False)
    cfg = OmegaConf.to_container(OmegaConf.load(VERL_YAML), resolve=True)
    assert cfg["router_class"] == "redis_router.verl.VerlRouter"
    assert cfg["redis"] == "redis://example:6380/2"
    assert "name" not in cfg  # one pool per job unless a name is written in
    assert cfg["full_determinism"] is False
    assert cfg["lease_ttl"] == 20 and cfg["max_lease_age"] == 86400
    monkeypatch.setenv("VERL_FULL_DETERMINISM", "true")
    cfg = OmegaConf.to_container(OmegaConf.load(VERL_YAML), resolve=True)
    assert cfg["full_determinism"] is True


def test_full_determinism_from_the_environment_reaches_the_balancer(server, monkeypatch):
    monkeypatch.setenv("VERL_FULL_DETERMINISM", "true")
    lb = router(server, handles("a"))

    async def main() -> None:
        assert (await lb.get_status())["full_determinism"] is True
        await lb.close()

    run(main())


def test_pool_name_is_the_same_for_the_same_replicas_in_any_order():
    a = pool_name(["10.0.0.2:8000", "10.0.0.1:8000"])
    assert a == pool_name(["10.0.0.1:8000", "10.0.0.2:8000"])
    assert a.startswith("verl-") and len(a) == len("verl-") + 12
    assert a != pool_name(["10.0.0.1:8000", "10.0.0.3:8000"])
    assert a != pool_name(["10.0.0.1:8000"])


def test_each_job_owns_its_pool_and_a_restart_finds_it_again(server, r):
    job = handles("10.0.0.1:8000", "10.0.0.2:8000")
    other = handles("10.0.0.3:8000", "10.0.0.4:8000")

    async def main() -> None:
        first, second = router(server, job), router(server, other)
        assert first.name != second.name
        assert await first.get_all_servers() == sorted(job)
        assert await second.get_all_servers() == sorted(other)
        placed, _ = await first.acquire_server("session-1")
        await first.release_server(placed, "session-1")
        # A replica added while the job ran (verl's hybrid replicas) is gone after a restart.
        await first.add_servers(handles("10.0.0.9:8000"))
        assert len(await first.get_all_servers()) == 3
        await first.close()
        restarted = router(server, job)
        assert restarted.name == first.name
        assert await restarted.get_all_servers() == sorted(job)
        again, handle = await restarted.acquire_server("session-1")
        assert again == placed and handle is job[placed]  # sticky across the restart
        await restarted.release_server(again, "session-1")
        assert await second.get_all_servers() == sorted(other)  # untouched
        await restarted.close()
        await second.close()

    run(main())
    assert invariants.check(r, pool_name(job)) == dict.fromkeys(job, 0)


def test_pools_that_start_empty_are_each_their_own():
    assert VerlRouter({}, {"redis": "redis://h:1/0"}).name != VerlRouter(None).name


def test_an_explicit_name_shares_the_pool_and_only_adds(server):
    async def main() -> None:
        a = router(server, handles("a0"), name="shared")
        b = router(server, handles("b0"), name="shared")
        assert await a.get_all_servers() == ["a0"]
        assert await b.get_all_servers() == ["a0", "b0"]
        assert a.name == b.name == "shared"
        await a.close()
        await b.close()

    run(main())


def test_a_replica_registered_elsewhere_is_never_handed_out(server, r):
    """Two routers share a name; each holds only its own replica's handle. A grant of the
    other's replica releases its lease and names the replica and the remedy."""

    async def main() -> None:
        a = router(server, handles("a0"), name="shared")
        b = router(server, handles("b0"), name="shared")
        await b.get_all_servers()  # registers b0
        held: list[str] = []
        with pytest.raises(UnusableReplica) as info:
            for rid in ("x", "y"):  # a0 busy after the first, so b0 by the second at the latest
                sid, handle = await a.acquire_server(rid)
                assert sid == "a0" and isinstance(handle, ActorHandle)
                held.append(rid)
        message = str(info.value)
        assert "'b0'" in message and "no handle" in message and "`name`" in message
        assert isinstance(info.value, RuntimeError)
        assert "No available servers" not in message  # verl would wait on it forever
        assert await a.get_inflight_count("b0") == 0  # the lease was released at once
        for rid in held:
            assert await a.release_server("a0", rid)
        await a.close()
        await b.close()

    run(main())
    assert invariants.check(r, "shared") == {"a0": 0, "b0": 0}


def test_release_declares_request_id_and_ends_that_requests_lease(server, r):
    async def main() -> None:
        lb = router(server, handles("s0"))
        assert await lb.require_release_fields() == ["request_id"]
        assert await lb.require_acquire_fields() == []
        await lb.acquire_server("first")
        await lb.acquire_server("second")
        await lb.release_server("s0", request_id="second")
        leases = r.hgetall(f"rr:{{{lb.name}}}:leases")
        assert [v.split("\x1f")[1] for v in leases.values()] == ["first"]
        await lb.release_server("s0", request_id="first")
        await lb.close()

    run(main())


def test_clear_sticky_cache_returns_verls_report(server):
    async def main() -> None:
        lb = router(server, handles("s0", "s1"))
        sid, _ = await lb.acquire_server("kept")
        await lb.acquire_server("done")
        await lb.release_server(sid, "kept")
        report = await lb.clear_sticky_cache()
        assert report["cleared_entries"] == 2
        assert sorted(report["server_loads"]) == ["s0", "s1"]
        assert sum(report["server_loads"].values()) == 1  # "done" still in flight
        assert (await lb.clear_sticky_cache())["cleared_entries"] == 0
        await lb.close()

    run(main())


def test_other_config_forms_and_the_empty_pool_error_text(server):
    lb = VerlRouter(
        servers={}, config={"redis": server.url, "name": "verl-empty", "full_determinism": True}
    )

    async def main() -> None:
        assert (await lb.get_status())["full_determinism"] is True
        with pytest.raises(RuntimeError, match="No available servers in load balancer"):
            await lb.acquire_server("r")
        await lb.close()

    run(main())


def test_satisfies_the_protocol(server):
    lb = VerlRouter({"s0": None}, {"router_class": "x", "redis": server.url, "name": "vl"})
    assert isinstance(lb, RequestLoadBalancer)

    async def main() -> None:
        assert await lb.acquire_server("a") == ("s0", None)
        assert await lb.release_server("s0", "a")
        await lb.close()

    run(main())


def test_config_given_twice_is_refused():
    with pytest.raises(TypeError, match="not both"):
        VerlRouter({}, router_kwargs={}, config={})


def test_module_prints_verls_override_line():
    out = subprocess.run(
        [sys.executable, "-m", "redis_router.verl"], capture_output=True, text=True, check=True
    )
    key, _, path = out.stdout.strip().partition("=")
    assert key == "actor_rollout_ref.rollout.router_config_path"
    assert Path(path).is_absolute() and Path(path).read_text() == VERL_YAML.read_text()
    assert out.stderr == ""
    only = subprocess.run(
        [sys.executable, "-m", "redis_router.verl", "--config-path"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert only.stdout.strip() == path == config_path()
