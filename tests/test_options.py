"""The constructor's option groups (redis_router.options): objects, mappings and flat names
make the same balancer; a field given twice, an unknown field or a bad value is refused
before anything is written; both flavours take one signature of at most 12 named options."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from redis_router import (
    Affinity,
    AsyncRedisLoadBalancer,
    Ejection,
    Groups,
    RedisLoadBalancer,
    options,
)
from redis_router.loader import get_router_handle

SERVERS = {"s0": "http://a", "s1": "http://b"}
GROUPED: dict[str, Any] = {
    "affinity": Affinity(margin=2, ratio=1.5, spread_sessions=True),
    "groups": Groups(cap=4, by="-"),
    "ejection": Ejection(after=3, seconds=10.0, max_seconds=60.0, max_share=0.25, sticky="wait"),
}
FLAT: dict[str, Any] = {
    "affinity_margin": 2,
    "affinity_ratio": 1.5,
    "spread_sessions": True,
    "group_cap": 4,
    "group_by": "-",
    "eject_after": 3,
    "eject_for": 10.0,
    "eject_max": 60.0,
    "max_ejected": 0.25,
    "ejected_sticky": "wait",
}
MAPPINGS: dict[str, Any] = {
    "affinity": {"margin": 2, "ratio": 1.5, "spread_sessions": True},
    "groups": {"cap": 4, "by": "-"},
    "ejection": {
        "after": 3,
        "seconds": 10.0,
        "max_seconds": 60.0,
        "max_share": 0.25,
        "sticky": "wait",
    },
}
# What get_status() says of those options.
SHOWN = (
    "affinity_margin",
    "affinity_ratio",
    "spread_sessions",
    "group_cap",
    "group_by",
    "ejection",
)


def _shown(lb: RedisLoadBalancer) -> dict[str, Any]:
    status = lb.get_status()
    return {k: status[k] for k in SHOWN}


@pytest.mark.parametrize("form", ["objects", "mappings", "flat", "router_kwargs"])
def test_every_form_makes_the_same_balancer(make_lb, form):
    given = {
        "objects": GROUPED,
        "mappings": MAPPINGS,
        "flat": FLAT,
        "router_kwargs": {"router_kwargs": {**FLAT}},
    }[form]
    lb = make_lb(SERVERS, name=f"forms-{form}", **given)
    reference = make_lb(SERVERS, name=f"forms-ref-{form}", **GROUPED)
    assert _shown(lb) == _shown(reference)
    assert _shown(lb)["ejection"] != _shown(make_lb(SERVERS))["ejection"]  # not the defaults
    # Pinned alike: a process of the same balancer given the other form agrees with it.
    other = make_lb(SERVERS, name=f"forms-{form}", **(FLAT if form == "objects" else GROUPED))
    assert other.acquire_server("r")[0] in SERVERS


def test_a_yaml_router_config_takes_groups_as_mappings_and_flat_names(server, tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text(
        "router_class: redis_router.RedisLoadBalancer\n"
        f"redis: {server.url}\n"
        "name: yaml-groups\n"
        "ejection: {after: 3, seconds: 10.0}\n"
        "group_cap: 4\n"
    )
    lb = get_router_handle(SERVERS, router_config_path=str(config))
    try:
        status = lb.get_status()
        assert status["group_cap"] == 4 and status["ejection"]["after"] == 3
    finally:
        lb.close()


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"ejection": Ejection(after=3), "eject_after": 4}, "eject_after"),
        ({"affinity": {"margin": 1}, "affinity_ratio": 2.0}, "affinity_ratio"),
        ({"groups": Groups(cap=2), "router_kwargs": {"group_by": "-"}}, "group_by"),
    ],
)
def test_a_field_given_both_ways_is_refused_and_nothing_written(server, r, kwargs, named):
    with pytest.raises(TypeError, match=named):
        RedisLoadBalancer(SERVERS, redis=server.url, name="twice", **kwargs)
    assert r.keys("rr:{twice}:*") == []


@pytest.mark.parametrize(
    "make, exc, named",
    [
        (lambda: Affinity(margin=-1), ValueError, "affinity_margin"),
        (lambda: Affinity(ratio=0.5), ValueError, "affinity_ratio"),
        (lambda: Affinity(spread_sessions="yes"), TypeError, "spread_sessions"),
        (lambda: Groups(cap=0), ValueError, "group_cap"),
        (lambda: Groups(by=" "), ValueError, "group_by"),
        (lambda: Ejection(after=0), ValueError, "eject_after"),
        (lambda: Ejection(after=3, seconds=100.0, max_seconds=10.0), ValueError, "eject_max"),
        (lambda: Ejection(sticky="stay"), ValueError, "ejected_sticky"),
        (lambda: options.group("ejection", {"afterr": 3}), TypeError, "afterr"),
        (lambda: options.group("groups", 4), TypeError, "groups must be a Groups"),
    ],
)
def test_a_bad_option_is_refused_where_it_is_made_naming_it(make, exc, named):
    with pytest.raises(exc, match=named):
        make()


def test_a_bad_option_given_to_a_balancer_writes_nothing(server, r):
    with pytest.raises(ValueError, match="group_cap"):
        RedisLoadBalancer(SERVERS, redis=server.url, name="badopt", groups={"cap": -1})
    with pytest.raises(TypeError, match="coalesce"):  # the asyncio balancer's option only
        RedisLoadBalancer(SERVERS, redis=server.url, name="badopt", coalesce=False)
    assert r.keys("rr:{badopt}:*") == []


def test_both_flavours_take_one_signature_of_at_most_12_named_options():
    sync = inspect.signature(RedisLoadBalancer)
    named = [p for p in sync.parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert len(named) <= 12, [p.name for p in named]
    assert sync == inspect.signature(AsyncRedisLoadBalancer)
    doc = inspect.getdoc(RedisLoadBalancer.__init__) or ""
    for p in named:  # each documented in the constructor's docstring
        assert f"``{p.name}``" in doc, p.name


def test_the_asyncio_balancer_takes_the_same_forms(server, r):
    async def main() -> dict[str, Any]:
        async with AsyncRedisLoadBalancer(
            SERVERS, redis=server.url, name="aforms", coalesce=False, max_connections=8, **GROUPED
        ) as lb:
            status = await lb.get_status()
            return {k: status[k] for k in SHOWN}

    shown = asyncio.run(main())
    with RedisLoadBalancer(SERVERS, redis=server.url, name="aforms-ref", **FLAT) as ref:
        assert shown == _shown(ref)
