"""The exact KV-block index fed by the replicas' KV-cache events, on the wire format vLLM and
SGLang publish (a small publisher of our own:
redis_router/kv_events/publisher.py), on every server binary."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from redis_router import RedisLoadBalancer
from redis_router.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventSubscriber,
    KVIndex,
    block_hashes,
    index_states,
    offset_endpoint_port,
    replica_ports,
    streams_of,
    subscriber,
)
from redis_router.kv_events.publisher import Publisher, cleared, removed, stored
from redis_router.scripts import load_file

BS = 4  # tokens per engine block


def settle(subs: list[KVEventSubscriber], done: Callable[[], bool], timeout: float = 15) -> None:
    """Step the subscribers until ``done()``; fail after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for s in subs:
            s.step(0.02)
        if done():
            return
    raise AssertionError("the index did not reach the expected state in time")


def holders(r: Any, name: str) -> dict[str, set[str]]:
    """kv:idx as {router hash: replica ids}."""
    raw = r.hgetall(f"rr:{{{name}}}:kv:idx")
    return {h: set(v.split("\x1f")[0::3][:-1]) for h, v in raw.items()}


def expect(prompts: dict[str, list[list[int]]], bs: int = BS) -> dict[str, set[str]]:
    """The index that should hold: every block of each replica's prompts."""
    out: dict[str, set[str]] = {}
    for sid, ps in prompts.items():
        for p in ps:
            for h in block_hashes(p, bs):
                out.setdefault(h, set()).add(sid)
    return out


def store_prompt(
    pub: Publisher, prompt: list[int], base: int, *, arrays: bool, split: int = 1
) -> list[int]:
    """Publish a prompt's blocks as BlockStored events (split across ``split`` batches, each
    continuing the last by parent hash); engine hashes base, base + 1, ... Returns them."""
    n = len(prompt) // BS
    hashes = [base + j for j in range(n)]
    cut = max(1, n // split)
    for lo in range(0, n, cut):
        hi = min(n, lo + cut)
        parent = hashes[lo - 1] if lo else None
        pub.publish([stored(hashes[lo:hi], parent, prompt[lo * BS : hi * BS], BS, arrays=arrays)])
    return hashes


@pytest.fixture
def pubs() -> Any:
    made: list[Publisher] = []

    def make(**kw: Any) -> Publisher:
        p = Publisher(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def subs(server: Any) -> Any:
    made: list[KVEventSubscriber] = []

    def make(name: str, **kw: Any) -> KVEventSubscriber:
        kw.setdefault("poll", 0.2)
        kw.setdefault("heartbeat", 0.2)
        kw.setdefault("replay_timeout", 2.0)
        s = KVEventSubscriber(server.url, name, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(blocks * BS)]


@pytest.mark.parametrize("arrays", [True, False], ids=["array-like", "tagged-map"])
def test_stored_blocks_are_indexed_under_the_routers_hashes(server, r, pubs, subs, arrays):
    rng = random.Random(1)
    pub = pubs()
    lb = RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv")
    sub = subs("kv")
    p = prompt(rng, 6)
    store_prompt(pub, p, 100, arrays=arrays, split=3)  # chained through parent hashes
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [p]}))
    assert index_states(r, "kv", {"r0": pub.meta()})["r0"] == {
        "state": "exact",
        "reason": None,
        "blocks": 6,
    }
    lb.close()


def test_fields_and_events_newer_engines_add_are_ignored(server, r, pubs, subs):
    rng = random.Random(2)
    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv").close()
    sub = subs("kv")
    p = prompt(rng, 2)
    pub.publish(
        [
            stored([1, 2], None, p, BS, arrays=False, group_idx=0, session_id="s", future=[1, 2]),
            {"type": "BlockMoved", "block_hashes": [7]},
            ["SomethingNew", 1, 2],
        ]
    )
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [p]}))


def test_blocks_the_router_cannot_look_up_are_not_indexed(server, r, pubs, subs):
    rng = random.Random(3)
    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv").close()
    sub = subs("kv")
    lora, cpu, plain = prompt(rng, 1), prompt(rng, 1), prompt(rng, 1)
    ev_lora = stored([1], None, lora, BS, arrays=False)
    ev_lora["lora_name"] = "adapter"
    ev_cpu = stored([2], None, cpu, BS, arrays=False)
    ev_cpu["medium"] = "CPU"
    pub.publish([ev_lora, ev_cpu, stored([3], None, plain, BS, arrays=False)])
    pub.publish([stored([4], 1, plain, BS, arrays=False)])  # a child of the LoRA block
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [plain]}))


def test_removed_and_cleared_blocks_leave_the_index(server, r, pubs, subs):
    rng = random.Random(4)
    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv").close()
    sub = subs("kv")
    a, b = prompt(rng, 3), prompt(rng, 3)
    ha = store_prompt(pub, a, 100, arrays=True)
    store_prompt(pub, b, 200, arrays=True)
    pub.publish([removed(ha[1:], arrays=True)])
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [a[:BS], b]}))
    pub.publish([cleared(arrays=True)])
    settle([sub], lambda: holders(r, "kv") == {} and not r.keys("rr:{kv}:kv:trash*"))
    assert index_states(r, "kv", {"r0": pub.meta()})["r0"]["state"] == "exact"


def test_first_connect_replays_what_was_published_before(server, r, pubs, subs):
    rng = random.Random(5)
    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv").close()
    ps = [prompt(rng, 4) for _ in range(5)]
    for k, p in enumerate(ps):
        store_prompt(pub, p, 1000 * k, arrays=True, split=2)
    sub = subs("kv")  # connects after all of it was published
    settle([sub], lambda: holders(r, "kv") == expect({"r0": ps}))
    assert index_states(r, "kv", {"r0": pub.meta()})["r0"]["state"] == "exact"


def test_a_batch_published_while_the_subscription_travels_is_found_in_the_replay(
    server, r, pubs, subs, monkeypatch
):
    """A SUB socket misses what is published before its subscription reaches the publisher.
    With no batch after it to show the gap, the subscriber's checks after connecting find it;
    over a quiet spell they stop after len(JOIN_CHECKS) replay requests."""
    # Any check after the publish finds the batch: one missed by a stalled test still leaves two.
    monkeypatch.setattr(subscriber, "JOIN_CHECKS", (0.5, 1.0, 2.0))
    rng = random.Random(14)
    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv").close()
    first, missed = prompt(rng, 1), prompt(rng, 1)
    store_prompt(pub, first, 0, arrays=True)  # before the subscriber connects: replayed
    sub = subs("kv")
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [first]}))
    synced = time.monotonic()  # the checks are due 0.5, 1 and 2 s after the sync, before this
    pub.publish([stored([10], None, missed, BS, arrays=True)], skip_live=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [first, missed]}))
    while time.monotonic() < synced + 2.5:  # past the last check: a quiet spell
        sub.step(0.05)
    first_connect, *checks = pub.replays
    assert first_connect == 0
    assert checks[0] == 0 and set(checks) <= {0, 1}  # from the last applied batch on ...
    assert len(checks) <= 3  # ... at most once per check (two due at once go as one)
    assert index_states(r, "kv", {"r0": pub.meta()})["r0"]["state"] == "exact"


def test_a_gap_is_filled_from_the_replay(server, r, pubs, subs):
    rng = random.Random(6)
    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta()}, redis=server.url, name="kv").close()
    sub = subs("kv")
    first = prompt(rng, 2)
    store_prompt(pub, first, 0, arrays=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [first]}))
    missed, after = prompt(rng, 2), prompt(rng, 2)
    pub.publish([stored([10, 11], None, missed, BS, arrays=True)], skip_live=True)
    store_prompt(pub, after, 20, arrays=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [first, missed, after]}))
    assert index_states(r, "kv", {"r0": pub.meta()})["r0"]["state"] == "exact"


def test_a_gap_the_replay_cannot_fill_degrades_the_replica_until_its_cache_is_cleared(
    server, r, pubs, subs
):
    rng = random.Random(7)
    pub = pubs(buffer=1)
    meta = pub.meta()
    RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv").close()
    sub = subs("kv")
    before = prompt(rng, 2)
    store_prompt(pub, before, 0, arrays=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [before]}))
    pub.publish([removed([0, 1], arrays=True)], skip_live=True)  # lost: the buffer keeps 1
    pub.publish([stored([9], None, prompt(rng, 1), BS, arrays=True)], skip_live=True)
    after = prompt(rng, 1)
    pub.publish([stored([20], None, after, BS, arrays=True)])
    settle(
        [sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["reason"] == "gap not replayable"
    )
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [after]}))  # the rest was reset
    pub.publish([cleared(arrays=True)])
    settle([sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact")


def test_a_stored_event_whose_tokens_do_not_fill_its_blocks_is_skipped(server, r, pubs, subs):
    """Skipped as a block the router cannot look up is: one odd engine does not stop the
    subscriber (and with it the index of every replica)."""
    rng = random.Random(12)
    pub = pubs()
    meta = pub.meta()
    RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv").close()
    sub = subs("kv")
    good, short, later = prompt(rng, 2), prompt(rng, 2), prompt(rng, 1)
    wide = [1 << 32, *prompt(rng, 1)[1:]]  # a token id that does not fit uint32
    pub.publish(
        [
            stored([1, 2], None, short[:-1], BS, arrays=True),
            stored([3], None, wide, BS, arrays=False),
            stored([4, 5], None, good, BS, arrays=True),
            stored([6], 1, prompt(rng, 1), BS, arrays=True),  # its parent was skipped
        ]
    )
    pub.publish([stored([7], None, later, BS, arrays=False)])
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [good, later]}))
    assert index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact"


def test_an_undecodable_batch_in_the_replay_is_a_gap_not_a_crash(server, r, pubs, subs):
    rng = random.Random(13)
    pub = pubs()
    meta = pub.meta()
    RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv").close()
    sub = subs("kv")
    first, after = prompt(rng, 1), prompt(rng, 1)
    store_prompt(pub, first, 0, arrays=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [first]}))
    with pub.lock:  # a batch the subscriber missed, and that no msgpack decoder reads
        pub.buffer.append((pub.seq, b"\xc1"))
        pub.seq += 1
    pub.publish([stored([20], None, after, BS, arrays=True)])
    settle(
        [sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["reason"] == "gap not replayable"
    )
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [after]}))
    pub.publish([cleared(arrays=True)])
    settle([sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact")


def restart(pubs: Any, pub: Publisher) -> Publisher:
    """The replica restarts: a new publisher on the same ports, numbers from 0, later times."""
    port, replay_port, clock = pub.port, pub.replay_port, pub.clock
    pub.close()
    return pubs(port=port, replay_port=replay_port, clock=clock + 5)


@pytest.mark.parametrize("published", [1, 4], ids=["fewer-than-before", "past-the-old-numbers"])
def test_a_replica_restart_replaces_its_entries(server, r, pubs, subs, published):
    """Also when the new stream already has the old one's last number (the restart is found at
    a number past 0): it is replayed from 0, and the replica stays exact."""
    rng = random.Random(8)
    pub = pubs()
    meta = pub.meta()
    RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv").close()
    sub = subs("kv")
    old = [prompt(rng, 3) for _ in range(3)]
    for k, p in enumerate(old):  # numbers 0..2
        store_prompt(pub, p, 100 * k, arrays=False)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": old}))
    new = restart(pubs, pub)
    fresh = [prompt(rng, 2) for _ in range(published)]
    for k, p in enumerate(fresh):  # before the subscriber reads the reconnect
        store_prompt(new, p, 1000 + 100 * k, arrays=False)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": fresh}), timeout=20)
    settle([sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact")


def test_a_join_check_that_meets_a_restart_not_yet_seen_replaces_the_entries(server, r, pubs, subs):
    """A join check that runs before the subscriber has read the reconnect (its stream still
    linked, no sync due) must not apply the new stream's batches as the old one's sequel."""
    rng = random.Random(15)
    pub = pubs()
    meta = pub.meta()
    RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv").close()
    old = [prompt(rng, 1) for _ in range(3)]
    for k, p in enumerate(old):
        store_prompt(pub, p, 100 * k, arrays=True)  # numbers 0..2
    sub = subs("kv")
    settle([sub], lambda: holders(r, "kv") == expect({"r0": old}))
    new = restart(pubs, pub)
    fresh = [prompt(rng, 1) for _ in range(5)]
    for k, p in enumerate(fresh):
        store_prompt(new, p, 1000 + 100 * k, arrays=True)  # numbers 0..4, 3 and 4 past the old
    (stream,) = sub._streams.values()
    stream.link, stream.needs_sync = "1", False  # as if the reconnect were not read yet
    sub._check_tail(stream)
    sub._apply_held([stream])
    assert holders(r, "kv") == expect({"r0": fresh})


def test_two_subscribers_at_once_build_the_index_one_would(server, r, pubs, subs):
    rng = random.Random(9)
    publishers = [pubs() for _ in range(3)]
    servers = {f"r{k}": p.meta() for k, p in enumerate(publishers)}
    RedisLoadBalancer(servers, redis=server.url, name="kv").close()
    a, b = subs("kv").start(), subs("kv").start()
    shared = prompt(rng, 3)  # every replica holds it: three holders per block
    held: dict[str, list[list[int]]] = {sid: [shared] for sid in servers}
    for k, p in enumerate(publishers):
        store_prompt(p, shared, 0, arrays=bool(k % 2))
    for step in range(60):
        k = rng.randrange(3)
        p = prompt(rng, rng.randint(1, 4))
        held[f"r{k}"].append(p)
        store_prompt(publishers[k], p, 1000 * (step + 1), arrays=bool(k % 2), split=2)
    settle([], lambda: holders(r, "kv") == expect(held))
    assert all(v["state"] == "exact" for v in index_states(r, "kv", servers).values())
    a.close()
    b.close()


def test_replicas_added_and_removed_are_followed_and_forgotten(server, r, pubs, subs):
    rng = random.Random(10)
    p0, p1 = pubs(), pubs()
    lb = RedisLoadBalancer({"r0": p0.meta()}, redis=server.url, name="kv")
    sub = subs("kv")
    a, b = prompt(rng, 2), prompt(rng, 2)
    store_prompt(p0, a, 0, arrays=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [a]}))
    lb.add_servers({"r1": p1.meta()})
    settle([sub], lambda: len(sub.streams()) == 2)
    store_prompt(p1, b, 0, arrays=True)
    settle([sub], lambda: holders(r, "kv") == expect({"r0": [a], "r1": [b]}))
    lb.remove_servers(["r0"])
    settle([sub], lambda: holders(r, "kv") == expect({"r1": [b]}))
    assert not r.exists("rr:{kv}:kv:map:0:r0") and not r.hexists("rr:{kv}:kv:stream", "0:r0")
    lb.close()


def test_a_replica_without_a_subscriber_is_not_trusted_after_the_stale_window(
    server, r, pubs, subs
):
    pub = pubs()
    meta = pub.meta()
    RedisLoadBalancer({"r0": meta}, redis=server.url, name="kv").close()
    assert index_states(r, "kv", {"r0": meta})["r0"]["reason"] == "never connected"
    sub = subs("kv", stale=0.5, heartbeat=0.1)
    settle([sub], lambda: index_states(r, "kv", {"r0": meta})["r0"]["state"] == "exact")
    sub.close()
    time.sleep(0.7)
    assert index_states(r, "kv", {"r0": meta})["r0"]["reason"] == "no subscriber"


def test_a_resent_or_older_batch_changes_nothing(server, r):
    RedisLoadBalancer(
        {"r0": {"kv_events": "tcp://127.0.0.1:1"}}, redis=server.url, name="kv"
    ).close()
    index = KVIndex(r, "kv")
    toks = list(range(8))
    first = [BlockStored([1, 2], None, toks, BS)]
    assert index.apply("r0", 0, 1, 0, 1.0, first).outcome == "ok"
    assert index.apply("r0", 0, 1, 1, 1.1, [BlockRemoved([2])]).stored == 0
    snapshot = r.hgetall("rr:{kv}:kv:idx")
    assert index.apply("r0", 0, 1, 0, 1.0, first).outcome == "dup"  # resent
    assert index.apply("r0", 0, 1, 1, 1.1, [BlockRemoved([2])]).outcome == "dup"
    assert index.apply("r0", 0, 1, 3, 1.3, []).need == 2  # out of order: nothing written
    assert (
        r.hgetall("rr:{kv}:kv:idx") == snapshot == {block_hashes(toks, BS)[0]: "r0\x1f0\x1f1\x1f"}
    )
    assert index.apply("x", 0, 1, 0, 1.0, first).outcome == "removed"


def test_pipelined_batches_have_the_outcomes_of_applying_them_one_by_one(server, r):
    """What the subscriber sends in one round trip: each batch's outcome, and the index
    after, are those of apply() in turn, even when the server has to load the script first."""
    rng = random.Random(14)
    meta = {"kv_events": "tcp://127.0.0.1:1"}
    a, b, c = prompt(rng, 2), prompt(rng, 1), prompt(rng, 1)
    batches: list[Any] = [
        ("r0", 0, 1, 0, 1.0, [BlockStored([1, 2], None, a, BS)]),
        ("r1", 0, 1, 0, 1.0, [BlockStored([1], None, c, BS)]),
        ("r0", 0, 1, 1, 1.1, [BlockStored([3], 2, b, BS), BlockRemoved([1])]),
        ("r0", 0, 1, 1, 1.1, [BlockStored([3], 2, b, BS), BlockRemoved([1])]),  # resent
        ("r1", 0, 1, 2, 1.2, [BlockRemoved([1])]),  # a gap: nothing written
        ("r1", 0, 1, 3, 1.3, []),
        ("x", 0, 1, 0, 1.0, []),  # not in the pool
    ]
    one_by_one = []
    for name in ("kv-seq", "kv-pipe"):
        RedisLoadBalancer({"r0": meta, "r1": meta}, redis=server.url, name=name).close()
    seq_index, pipe_index = KVIndex(r, "kv-seq"), KVIndex(r, "kv-pipe")
    for batch in batches:
        one_by_one.append(seq_index.apply(*batch))
    r.script_flush()
    assert pipe_index.apply_many(batches) == one_by_one
    assert [x.outcome for x in one_by_one] == ["ok", "ok", "ok", "dup", "need", "need", "removed"]
    assert one_by_one[4].need == one_by_one[5].need == 1
    assert (
        holders(r, "kv-pipe")
        == holders(r, "kv-seq")
        == expect({"r1": [c]}) | {h: {"r0"} for h in block_hashes(a + b, BS)[1:]}
    )


def test_the_lua_helper_finds_the_deepest_block_an_exact_replica_holds(server, r, tmp_path):
    for sid in ("r0", "r1"):
        RedisLoadBalancer(
            {sid: {"kv_events": "tcp://127.0.0.1:1"}}, redis=server.url, name="kv"
        ).close()
    index = KVIndex(r, "kv")
    toks = list(range(4 * BS))
    index.apply("r0", 0, 1, 0, 1.0, [BlockStored([1, 2, 3], None, toks[: 3 * BS], BS)])
    index.apply("r1", 0, 1, 0, 1.0, [BlockStored([1, 2], None, toks[: 2 * BS], BS)])
    probe = tmp_path / "probe.lua"
    probe.write_text(
        "-- probe.lua\n-- Uses lib/base, kv_index_lib\n"
        "local hs = {} for k = 3, #ARGV do hs[#hs + 1] = ARGV[k] end\n"
        "local j, ids = kv_deepest(hs, #hs, tonumber(ARGV[1]), tonumber(ARGV[2]))\n"
        "if not j then return {} end return {j, unpack(ids)}\n"
    )
    plugins = Path(__file__).resolve().parent.parent / "plugins"
    (tmp_path / "kv_index_lib.lua").write_text((plugins / "kv_index_lib.lua").read_text())
    script = load_file(probe)
    hs = block_hashes(toks, BS)
    now = int(r.time()[0]) * 1000

    def deepest(first: int) -> list[Any]:
        return r.eval(script.source, 1, "rr:{kv}:", first, now, *hs)

    assert deepest(1) == [3, "r0"]
    r.hdel("rr:{kv}:kv:exact", "r0")  # r0 no longer trusted: r1's depth 2 is the deepest
    assert deepest(1) == [2, "r1"]
    assert deepest(3) == []


def test_memory_per_indexed_block(server, r):
    """Not a timed test: prints the bytes one indexed block costs (index + map), one holder."""
    RedisLoadBalancer(
        {"replica-0": {"kv_events": "tcp://127.0.0.1:1"}}, redis=server.url, name="kv"
    ).close()
    index = KVIndex(r, "kv")
    rng = random.Random(11)
    n, per = 20_000, 250
    for k in range(n // per):
        toks = [rng.randrange(150_000) for _ in range(per * 16)]
        hashes = [rng.getrandbits(64) for _ in range(per)]
        assert (
            index.apply("replica-0", 0, 1, k, 1.0 + k, [BlockStored(hashes, None, toks, 16)]).stored
            == per
        )
    keys = [k for k in r.keys("rr:{kv}:kv:*")]
    used = sum(r.memory_usage(k, samples=0) or 0 for k in keys)
    per_block = used / n
    print(
        f"\nkv index: {n} blocks, {used} bytes in {len(keys)} keys, "
        f"{per_block:.0f} bytes per indexed block ({server.binary.label})"
    )
    assert r.hlen("rr:{kv}:kv:idx") == n
    assert per_block < 400  # two hash entries of ~16-byte fields and values


def test_metadata_names_one_endpoint_per_dp_rank():
    meta, config = replica_ports(3, host="10.0.0.7", base=6000, stride=8, dp_size=2)
    assert meta == {
        "kv_events": ["tcp://10.0.0.7:6024", "tcp://10.0.0.7:6025"],
        "kv_events_replay": ["tcp://10.0.0.7:6028", "tcp://10.0.0.7:6029"],
    }
    assert json.loads(config)["endpoint"] == "tcp://*:6024"
    # the engine's own offset for rank 1 lands on the metadata's second endpoint
    assert offset_endpoint_port("tcp://10.0.0.7:6024", 1) == meta["kv_events"][1]
    assert [s.rank for s in streams_of("r3", meta)] == [0, 1]
    assert streams_of("r3", "http://10.0.0.7:8000") == []
    with pytest.raises(ValueError, match="kv_events_replay"):
        streams_of("r3", {"kv_events": ["tcp://a:1", "tcp://a:2"], "kv_events_replay": "x"})
    with pytest.raises(ValueError, match="dp_size"):
        replica_ports(0, host="h", stride=4, dp_size=3)
    ports = [p for i in range(64) for p in replica_ports(i, host="h", dp_size=4)[0]["kv_events"]]
    assert len(set(ports)) == len(ports)  # no two replicas or ranks share a port


def test_status_and_exporter_show_each_replicas_index_state(server, r, pubs, subs, capsys):
    from redis_router.cli import main
    from redis_router.cli.exporter import BalancerCollector

    pub = pubs()
    RedisLoadBalancer({"r0": pub.meta(), "r1": "http://plain"}, redis=server.url, name="kv").close()
    assert main(["--redis", server.url, "--name", "kv", "status"]) == 0
    assert "kv index r0: degraded (never connected), 0 blocks" in capsys.readouterr().out
    sub = subs("kv")
    settle([sub], lambda: index_states(r, "kv", {"r0": pub.meta()})["r0"]["state"] == "exact")
    assert main(["--redis", server.url, "--name", "kv", "status", "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["replicas"]["r0"]["kv_index"]["state"] == "exact"
    assert "kv_index" not in snap["replicas"]["r1"]
    metrics = {m.name: m for m in BalancerCollector(server.url, "kv").collect()}
    assert [s.value for s in metrics["redis_router_kv_index_exact"].samples] == [1.0]
