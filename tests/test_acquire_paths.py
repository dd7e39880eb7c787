"""The single-request fast path of the acquire procedure equals its batch path.

``lib/acquiring.lua`` keeps a straight procedure for one request (``acquire_one``, the common
case) beside the batch procedure (``acquire_all``). Random sequences of acquires (new
sessions, repeated ids, sticky turns), releases, drains and undrains are run on two balancers
with the same tie-break seed and options (affinity margin and ratio, groups and their cap,
spread_sessions): one acquires request by request (the fast path), the other in batches of two
or more (the batch path). Every grant, every count, every re-pin and every replica's pinned
sessions must agree.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import invariants

SERVERS = {f"s{i}": None for i in range(4)}
# Ids of three groups (group_by "-": the group is the part before the last "-").
IDS = [f"g{i % 3}-{i}" for i in range(7)]
_names = itertools.count()

STEP = st.one_of(
    st.tuples(st.just("acquire"), st.lists(st.sampled_from(IDS), min_size=2, max_size=6)),
    st.tuples(st.just("release"), st.integers(0, 63)),
    st.tuples(st.just("drain"), st.sampled_from(["s1", "s2", "s3"])),
    st.tuples(st.just("undrain"), st.sampled_from(["s1", "s2", "s3"])),
)


def _sticky(r: Any, name: str) -> dict[str, str]:
    """Every live sticky entry and group placement, whichever time bucket holds it."""
    out: dict[str, str] = {}
    for key in sorted(r.keys(invariants.prefix(name) + "sticky:*")):
        out.update(r.hgetall(key))
    for key in sorted(r.keys(invariants.prefix(name) + "group:*")):
        out.update({"group " + k: v for k, v in r.hgetall(key).items()})
    return out


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**32),
    steps=st.lists(STEP, min_size=1, max_size=12),
    full=st.booleans(),
    margin=st.sampled_from([None, 0, 1, 2]),
    ratio=st.sampled_from([None, 1.0, 1.5]),
    groups=st.sampled_from([None, (None, "-"), (1, "-"), (2, "-")]),
    spread=st.booleans(),
)
def test_batches_route_exactly_as_one_request_at_a_time(
    make_lb, r, seed, steps, full, margin, ratio, groups, spread
):
    n = next(_names)
    cap, by = groups or (None, None)
    opts: dict[str, Any] = dict(
        full_determinism=full,
        affinity_margin=margin,
        affinity_ratio=ratio,
        group_cap=cap,
        group_by=by,
        spread_sessions=spread,
    )
    one = make_lb(SERVERS, name=f"one{n}", rng=random.Random(seed), **opts)
    many = make_lb(SERVERS, name=f"many{n}", rng=random.Random(seed), **opts)
    held: list[tuple[str, str]] = []
    for op, arg in steps:
        if op == "acquire":
            singles = [one.acquire(rid) for rid in arg]
            batch = many._run(many._core.acquire(list(arg)))
            assert [(g.server_id, g.sticky) for g in batch] == [
                (g.server_id, g.sticky) for g in singles
            ]
            held += [(g.server_id, g.request_id) for g in singles]
        elif op == "release" and held:
            sid, rid = held.pop(arg % len(held))
            assert one.release_server(sid, rid).result() == many.release_server(sid, rid).result()
        elif op in ("drain", "undrain"):
            getattr(one, f"{op}_servers")([arg])
            getattr(many, f"{op}_servers")([arg])
        assert invariants.check(r, one.name) == invariants.check(r, many.name)
        assert _sticky(r, one.name) == _sticky(r, many.name)
    for stat in ("acquires", "sticky_hits", "repins", "pinned"):
        # (pinned: "@" is a time, and a replica at 0 may be absent)
        a, b = (
            {k: v for k, v in r.hgetall(invariants.prefix(lb.name) + stat).items()
             if k != "@" and v != "0"}
            for lb in (one, many)
        )  # fmt: skip
        assert a == b, stat
