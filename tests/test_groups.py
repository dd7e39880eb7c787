"""Group affinity: the samples of one prompt (a GRPO group) go to one replica, up to a cap.

The first request of a group is placed by the policy; later members follow it while its
replica takes new sessions and holds fewer than group_cap members in a row; then the policy
places the next one and the group follows it there. Entries expire as sticky ones do.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from redis_router import AsyncRedisLoadBalancer, ConfigMismatch
from redis_router.plugins.least_tokens import LeastTokensRouter
from redis_router.plugins.prefix_cache import PrefixCacheRouter

from . import invariants

SERVERS = {f"s{i}": None for i in range(4)}


def _groups(r, name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in r.keys(invariants.prefix(name) + "group:*"):
        out.update(r.hgetall(key))
    return out


def test_members_of_a_group_follow_its_first(make_lb, r):
    lb = make_lb(SERVERS, group_by="-", rng=random.Random(5))
    placed = {lb.acquire(f"prompt17-s{k}").server_id for k in range(8)}
    assert len(placed) == 1  # 8 leases held, yet all on the first member's replica
    other = lb.acquire("prompt18-s0").server_id
    assert other not in placed  # a new group goes to the least loaded
    assert _groups(r, lb.name) == {"prompt17": f"{placed.pop()}\x1f8", "prompt18": f"{other}\x1f1"}
    invariants.check(r, lb.name)


def test_a_group_spills_to_the_next_replica_at_its_cap(make_lb, r):
    lb = make_lb(SERVERS, group_cap=3, rng=random.Random(11))
    got = [lb.acquire(f"s{k}", group_id="p1").server_id for k in range(7)]
    first, second, third = got[:3], got[3:6], got[6:]
    assert len(set(first)) == len(set(second)) == 1
    assert first[0] != second[0]  # the full replica carries 3, the policy picks an idle one
    assert third[0] not in (first[0], second[0])
    assert lb.get_inflight_count(first[0]) == 3 and lb.get_inflight_count(second[0]) == 3
    invariants.check(r, lb.name)


def test_a_seen_request_stays_sticky_before_its_group(make_lb, r):
    lb = make_lb(SERVERS, group_by="-", rng=random.Random(2))
    a = lb.acquire("x-1").server_id
    lb.drain_servers([a])
    assert lb.acquire("x-2").server_id != a  # the group's replica takes no new sessions
    assert lb.acquire("x-1").server_id == a  # a sticky session keeps its draining replica
    invariants.check(r, lb.name)


def test_group_entries_expire_like_sticky_ones(make_lb, r):
    lb = make_lb(SERVERS, group_by="-", sticky_ttl=8)
    lb.acquire("q-1")
    (key,) = r.keys(invariants.prefix(lb.name) + "group:*")
    assert 8000 < r.pttl(key) <= 10_000  # sticky_ttl .. 1.25 x sticky_ttl


def test_bump_drops_group_placements(make_lb, r):
    lb = make_lb(SERVERS, group_by="-", rng=random.Random(4))
    lb.acquire("q-1")
    assert _groups(r, lb.name)
    counts = {sid: lb.get_inflight_count(sid) for sid in SERVERS}
    assert lb.bump_weight_version()["locality_keys_dropped"] == 1
    assert _groups(r, lb.name) == {}
    assert {sid: lb.get_inflight_count(sid) for sid in SERVERS} == counts
    invariants.check(r, lb.name)


def test_async_coalesced_members_land_together(server, r):
    async def run() -> list[str]:
        lb = AsyncRedisLoadBalancer(
            SERVERS, redis=server.url, name="grp-async", group_cap=5, rng=random.Random(9)
        )
        try:
            got = await asyncio.gather(
                *(lb.acquire_server(f"s{k}", group_id="g") for k in range(8))
            )
            return [sid for sid, _ in got]
        finally:
            await lb.close()

    got = asyncio.run(run())
    assert len(set(got[:5])) == 1 and len(set(got[5:])) == 1 and got[0] != got[5]
    invariants.check(r, "grp-async")


@pytest.mark.parametrize("cls", [LeastTokensRouter, PrefixCacheRouter])
def test_every_policy_gets_groups(server, r, cls):
    lb = cls(SERVERS, redis=server.url, name=f"grp-{cls.__name__}", group_by="-")
    try:
        assert "group_id" in lb.require_acquire_fields()
        rnd = random.Random(3)
        placed = {
            lb.acquire(f"p-{k}", prompt_ids=[rnd.randrange(900) for _ in range(40)]).server_id
            for k in range(6)
        }
        assert len(placed) == 1
        invariants.check(r, lb.name)
    finally:
        lb.close()


def test_groups_are_off_under_full_determinism(make_lb, r):
    lb = make_lb(SERVERS, group_by="-", full_determinism=True)
    for k in range(6):
        lb.acquire(f"p-{k}")
    assert _groups(r, lb.name) == {}


def test_declared_only_when_on(make_lb):
    assert make_lb(SERVERS).require_acquire_fields() == []
    assert make_lb(SERVERS, group_cap=2).require_acquire_fields() == ["group_id"]


def test_every_process_must_use_the_same_groups(make_lb):
    lb = make_lb(SERVERS, group_cap=4, group_by="-")
    lb.acquire("a-1")
    with pytest.raises(ConfigMismatch, match="group_cap=8"):
        make_lb(name=lb.name, group_cap=8, group_by="-")
    with pytest.raises(ConfigMismatch, match="group_by=off"):
        make_lb(name=lb.name, group_cap=4)


@pytest.mark.parametrize(
    ("kw", "error", "text"),
    [
        ({"group_cap": 0}, ValueError, "group_cap must be in"),
        ({"group_cap": "3"}, TypeError, "group_cap must be an int"),
        ({"group_by": ""}, ValueError, "group_by must be 1 to 16"),
        ({"group_by": " "}, ValueError, "group_by must be 1 to 16"),
        ({"group_by": 3}, TypeError, "group_by must be a str"),
    ],
)
def test_bad_group_options_name_the_argument(make_lb, r, kw, error, text):
    with pytest.raises(error, match=text):
        make_lb(SERVERS, **kw)
    assert r.dbsize() == 0


def test_bad_group_id_is_refused_before_sending(make_lb, r):
    lb = make_lb(SERVERS)
    with pytest.raises(ValueError, match="group_id"):
        lb.acquire_server("a", group_id="")
    assert lb.get_total_inflight() == 0


def test_a_lone_retry_reads_the_policy_arguments_after_the_group(server, r):
    """A call that places nothing new still finds the policy's own arguments at i + OWN."""
    lb = PrefixCacheRouter(SERVERS, redis=server.url, name="grp-retry", group_by="-")
    try:
        lease = lb.acquire("p-1", prompt_ids=list(range(64)))
        again = lb.acquire("p-1", token=lease.token, prompt_ids=list(range(64)))
        assert again.server_id == lease.server_id and lb.get_total_inflight() == 1
        invariants.check(r, lb.name)
    finally:
        lb.close()


def test_with_prefix_cache_the_hot_spot_test_splits_a_group_not_its_cap(server, r):
    """Past group_cap the policy places the next member, and the prefix index sends it back to
    the replica holding the prompt until one more would make that replica a hot spot (for a
    repeat of the whole prompt: its count over the least loaded, 0, by more than 2 x 4)."""
    lb = PrefixCacheRouter(
        SERVERS, redis=server.url, name="grp-pc-cap", group_cap=2, rng=random.Random(6)
    )
    try:
        p = [random.Random(8).randrange(900) for _ in range(64)]
        got = [lb.acquire(f"s{k}", group_id="g", prompt_ids=p).server_id for k in range(9)]
        assert len(set(got[:8])) == 1 and got[8] != got[0]
        invariants.check(r, lb.name)
    finally:
        lb.destroy()
        lb.close()
