"""The request-owner lookup: which replica serves a request now, for a targeted abort."""

from __future__ import annotations

import asyncio
import json

import pytest

from redis_router import AsyncRedisLoadBalancer

from . import invariants
from .test_cli import run_cli

SERVERS = {"s0": {"url": "http://a"}, "s1": {"url": "http://b"}, "s2": None}


def test_owner_is_the_replica_holding_the_lease_until_it_ends(make_lb, r):
    lb = make_lb(SERVERS)
    assert lb.request_owner("r1") is None
    lease = lb.acquire("r1")
    other = make_lb(name=lb.name)  # any process sees it
    assert other.request_owner("r1") == lease.server_id
    # Answered before asking: another balancer's call on its own connection may reach Redis
    # before a release still unread on this one's.
    assert lease.release().result()
    assert other.request_owner("r1") is None  # its session is still sticky, but nothing runs
    invariants.check(r, lb.name)


def test_owner_is_found_after_the_sticky_entries_are_gone(make_lb, r):
    lb = make_lb(SERVERS)
    lease = lb.acquire("r1")
    lb.clear_sticky_cache()
    assert lb.request_owner("r1") == lease.server_id  # probed through the pool
    lb.drain_servers([lease.server_id])
    assert lb.request_owner("r1") == lease.server_id  # draining replicas serve on
    lb.remove_servers([lease.server_id])
    assert lb.request_owner("r1") is None  # its lease ended with it
    invariants.check(r, lb.name)


def test_owner_follows_a_moved_session(make_lb, r):
    lb = make_lb({"s0": None}, affinity_margin=0)
    first = lb.acquire("a")
    lb.add_servers({"s1": None})
    second = lb.acquire("a")  # s0 carries 1 against 0: the turn moves to s1
    assert (first.server_id, second.server_id) == ("s0", "s1")
    assert lb.request_owner("a") == "s1"
    second.release()
    assert lb.request_owner("a") == "s0"  # the earlier turn still runs there
    invariants.check(r, lb.name)


def test_async_twin_finds_the_owner(server, r):
    async def run() -> tuple[str | None, str]:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=server.url, name="owner-async")
        try:
            lease = await lb.acquire("r9")
            return await lb.request_owner("r9"), lease.server_id
        finally:
            await lb.close()

    got, expected = asyncio.run(run())
    assert got == expected


@pytest.mark.parametrize("bad", ["", "a\x1fb", 3])
def test_bad_request_id_is_refused_before_sending(make_lb, bad):
    lb = make_lb(SERVERS)
    with pytest.raises((TypeError, ValueError), match="request_id"):
        lb.request_owner(bad)


def test_cli_prints_the_owner_and_its_metadata(server, make_lb):
    lb = make_lb(SERVERS)
    lease = lb.acquire("rollout-7")
    proc = run_cli("--name", lb.name, "owner", "rollout-7", "--json", redis=server.url)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {
        "request_id": "rollout-7",
        "replica": lease.server_id,
        "metadata": SERVERS[lease.server_id],
    }
    plain = run_cli("--name", lb.name, "owner", "rollout-7", redis=server.url)
    assert plain.stdout.split()[0] == lease.server_id
    lease.release()
    gone = run_cli("--name", lb.name, "owner", "rollout-7", redis=server.url)
    assert gone.returncode == 1 and "serves request 'rollout-7'" in gone.stdout
