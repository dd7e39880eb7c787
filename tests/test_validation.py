"""Bad input changes nothing (I8); errors name the argument; passwords never leak."""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, RedisUnavailable
from redis_router.connection import redact
from redis_router.errors import CredentialsRefused

from . import invariants


def snapshot(server) -> dict[bytes, bytes]:
    """Every key with its serialized value: equal snapshots mean nothing was written. The
    holders' heartbeat deadlines are left out: balancers that acquired earlier in the test keep
    beating from the background, which is not a write of the call under test."""
    with server.client() as raw:
        return {k: raw.dump(k) for k in raw.keys("*") if not k.endswith(b":holders")}


BAD_IDS = [
    (None, TypeError, "must be a str"),
    (b"bytes", TypeError, "must be a str"),
    (42, TypeError, "must be a str"),
    ("", ValueError, "non-empty"),
    ("a\x1fb", ValueError, "control characters"),
    ("nul\x00", ValueError, "control characters"),
    ("\ud800", ValueError, "surrogates"),
    ("x" * 513, ValueError, "at most 512 bytes"),
]


@pytest.mark.parametrize(("bad", "exc", "why"), BAD_IDS, ids=repr)
def test_bad_request_id_is_refused_before_any_write(make_lb, server, r, bad, exc, why):
    lb = make_lb({"s0": "a"})
    lb.acquire_server("ok")
    before = snapshot(server)
    for call in (
        lambda: lb.acquire_server(bad),
        lambda: lb.acquire(bad),
        lambda: lb.acquire_many(["fine", bad]),
        lambda: lb.release_server("s0", bad if bad is not None else 0),
    ):
        with pytest.raises(exc, match=why) as info:
            call()
        assert "request_id" in str(info.value)
    assert snapshot(server) == before


@pytest.mark.parametrize(("bad", "exc", "why"), [*BAD_IDS[:5], ("y" * 257, ValueError, "256")])
def test_bad_server_id_is_refused_before_any_write(make_lb, server, r, bad, exc, why):
    lb = make_lb({"s0": "a"})
    before = snapshot(server)
    for call in (
        lambda: lb.add_servers({"fine": 1, bad: 2}),
        lambda: lb.remove_servers(["s0", bad]),
        lambda: lb.drain_servers([bad]),
        lambda: lb.release_server(bad),
        lambda: lb.get_inflight_count(bad),
    ):
        with pytest.raises(exc, match=why) as info:
            call()
        assert "server" in str(info.value)
    assert snapshot(server) == before
    assert lb.get_all_servers() == ["s0"]


def test_a_lone_string_is_not_a_list_of_ids(make_lb, server, r):
    lb = make_lb({"s0": "a"})
    before = snapshot(server)
    with pytest.raises(TypeError, match="server_ids must be a list"):
        lb.remove_servers("s0")
    with pytest.raises(TypeError, match="request_ids must be a list"):
        lb.acquire_many("abc")
    assert snapshot(server) == before


@pytest.mark.parametrize(
    ("kwargs", "exc", "arg"),
    [
        ({"name": "has{brace}"}, ValueError, "name"),
        ({"name": ""}, ValueError, "name"),
        ({"name": "a*b"}, ValueError, "name"),
        ({"sticky_ttl": 0}, ValueError, "sticky_ttl"),
        ({"lease_ttl": float("nan")}, ValueError, "lease_ttl"),
        ({"lease_ttl": "10"}, TypeError, "lease_ttl"),
        ({"lease_ttl": 1e16}, ValueError, "lease_ttl"),
        ({"lease_ttl": 0.01}, ValueError, "lease_ttl"),
        ({"sticky_ttl": 1e16}, ValueError, "sticky_ttl"),
        ({"max_lease_age": 1e16}, ValueError, "max_lease_age"),
        ({"max_lease_age": 5, "lease_ttl": 10}, ValueError, "max_lease_age"),
        ({"full_determinism": "yes"}, TypeError, "full_determinism"),
        ({"rng": 3}, TypeError, "rng"),
        ({"redis": 3.5}, TypeError, "redis"),
        ({"redis": "http://localhost:6379"}, ValueError, "scheme"),
        ({"router_kwargs": {"colour": "red"}}, TypeError, "colour"),
    ],
)
def test_bad_constructor_arguments_name_the_argument_and_write_nothing(server, r, kwargs, exc, arg):
    kwargs.setdefault("redis", server.url)
    before = snapshot(server)
    with pytest.raises(exc, match=arg):
        RedisLoadBalancer({"s0": "a"}, **kwargs)
    with pytest.raises(exc, match=arg):
        AsyncRedisLoadBalancer({"s0": "a"}, **kwargs)
    assert snapshot(server) == before


def test_bad_servers_mapping_writes_nothing(server, r):
    with pytest.raises(TypeError, match="servers must be a mapping"):
        RedisLoadBalancer(["s0"], redis=server.url)
    with pytest.raises(ValueError, match="servers key"):
        RedisLoadBalancer({"ok": 1, "": 2}, redis=server.url)
    assert snapshot(server) == {}


def test_different_sticky_ttl_in_one_balancer_is_refused(make_lb, server, r):
    lb = make_lb({"s0": "a"}, sticky_ttl=60)
    lb.acquire_server("pins-it")  # the first acquire pins sticky_ttl
    with pytest.raises(ValueError, match=r"sticky_ttl=30s.*60s"):
        make_lb(name=lb.name, sticky_ttl=30)


def test_constructing_a_balancer_writes_nothing_unless_given_servers(server, r):
    RedisLoadBalancer(redis=server.url, name="reader", sticky_ttl=30).get_status()
    assert snapshot(server) == {}
    RedisLoadBalancer({"s0": "a"}, redis=server.url, name="adder").add_servers({"s1": "b"})
    assert not r.exists("rr:{adder}:config")  # registering replicas pins no default


def test_settings_are_checked_again_after_the_keys_are_lost(make_lb, server, r):
    a = make_lb({"s0": "a", "s1": "b"}, sticky_ttl=60)
    a.acquire_server("session")
    a.destroy()  # as a Redis restart without persistence would
    c = make_lb({"s0": "a", "s1": "b"}, name=a.name, sticky_ttl=120)
    c.acquire_server("session")  # the first process to acquire now pins 120 s
    with pytest.raises(ValueError, match=r"sticky_ttl=60s.*120s"):
        a.acquire_server("session")
    assert c.get_total_inflight() == 1  # the refused acquire took nothing


@pytest.mark.parametrize("bad", ["a b", "tab\there", "", "x" * 129, "new\nline", "ü"], ids=repr)
def test_a_token_that_is_not_a_token_is_refused_before_any_write(make_lb, server, r, bad):
    lb = make_lb({"s0": "a"})
    lb.acquire_server("ok")
    before = snapshot(server)
    with pytest.raises(ValueError, match="token"):
        lb.acquire("req", token=bad)
    with pytest.raises(TypeError, match="token"):
        lb.acquire("req", token=7)
    assert snapshot(server) == before


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(token=st.text(min_size=0, max_size=140))
def test_any_token_is_refused_or_round_trips(make_lb, server, r, token):
    lb = make_lb({"s0": "a"})
    before = snapshot(server)
    try:
        lease = lb.acquire("req", token=token)
    except (TypeError, ValueError) as exc:
        assert "token" in str(exc)
        assert snapshot(server) == before
        return
    assert lease.token == token and lb.get_inflight_count("s0") == 1
    assert lb.release_server("s0", "req")
    assert invariants.check(r, lb.name) == {"s0": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_names_the_url_without_its_password():
    url = f"redis://admin:hunter2-secret@127.0.0.1:{_free_port()}/0"
    with pytest.raises(RedisUnavailable) as info:
        RedisLoadBalancer({"s0": "a"}, redis=url)
    message = str(info.value)
    assert "hunter2" not in message and "127.0.0.1" in message and "admin:***@" in message
    assert isinstance(info.value, ConnectionError)


def test_wrong_password_error_does_not_leak_it(binary):
    from redis_router.local_server import LocalServer

    with LocalServer(binary, password="right-pass").start() as srv:
        url = f"redis://:wrong-pass-123@127.0.0.1:{srv.port}/0"
        with pytest.raises(CredentialsRefused) as info:  # a configuration error, no outage
            RedisLoadBalancer({"s0": "a"}, redis=url)
        assert "wrong-pass-123" not in str(info.value) and "right-pass" not in str(info.value)
        lb = RedisLoadBalancer({"s0": "a"}, redis=srv.url)
        assert "right-pass" not in repr(lb) and "right-pass" not in str(lb.get_status())
        lb.close()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("rediss://user@h:1", "rediss://***@h:1"),
        ("redis+sentinel://:pw@a:1,b:2/svc", "redis+sentinel://:***@a:1,b:2/svc"),
        ("redis://h:1/0", "redis://h:1/0"),
    ],
)
def test_redact_hides_credentials(url, shown):
    assert redact(url) == shown


def test_every_key_of_a_balancer_shares_one_cluster_slot(make_lb, server, r):
    from redis.crc import key_slot

    lb = make_lb({"s0": "a", "s{1}": "b", "s*2": "c"})
    for i in range(10):
        lb.acquire_server(f"r{i}")
    lb.release_server("s0")  # leaves a resend record
    lb.drain_servers(["s0"])
    lb.reap()
    keys = r.keys("*")
    assert {"holders", "remembered", "config"} <= {k.rsplit(":", 1)[-1] for k in keys}
    assert len(keys) >= 10
    assert all(k.startswith(f"rr:{{{lb.name}}}:") for k in keys)
    assert {key_slot(k.encode()) for k in keys} == {key_slot(f"{{{lb.name}}}".encode())}


def test_balancers_with_different_names_never_touch_each_others_keys(make_lb, server, r):
    a, b = make_lb({"s0": "a", "s1": "b"}), make_lb({"s0": "a", "s1": "b"})
    b.acquire_server("mine")
    before = {
        k: v for k, v in snapshot(server).items() if k.startswith(f"rr:{{{b.name}}}".encode())
    }
    for i in range(20):
        a.acquire_server(f"r{i}")
    a.remove_servers(["s0"])
    a.clear_sticky_cache()
    a.reap()
    a.destroy()
    after = {k: v for k, v in snapshot(server).items() if k.startswith(f"rr:{{{b.name}}}".encode())}
    assert after == before
    assert not r.keys(f"rr:{{{a.name}}}:*")
    invariants.check(r, b.name)
