"""What the HTTP front reads from a request before any lease (redis_router.http.routing), and
how `serve` turns flags and a router YAML into a balancer's options."""

from __future__ import annotations

import argparse
import itertools
import random

import pytest

from redis_router.cli import build_parser
from redis_router.cli.common import CliError
from redis_router.cli.serve import balancer_options
from redis_router.http.routing import (
    BadRequest,
    SessionRule,
    render_chat,
    replica_url,
    retry_ids,
    route_request,
    text_ids,
)

RULE = SessionRule()


def route(path: str, body: bytes, rule: SessionRule = RULE, **headers: str):
    return route_request(path, body, {k.replace("_", "-"): v for k, v in headers.items()}, rule)


def test_a_text_maps_to_ids_whose_prefixes_are_the_prefixes_of_the_text():
    rng = random.Random(7)
    for _ in range(200):
        words = [rng.choice(["the", "sum", "é", "数学", "of", " ", "\n"]) for _ in range(50)]
        text = "".join(words)
        cut = rng.randrange(len(text) + 1)
        head, whole = text_ids(text[:cut]), text_ids(text)
        assert whole[: len(head)] == head  # a prefix of the text is a prefix of its ids
        assert len(whole) == len(text.encode()) // 4  # about a token's worth each
    assert text_ids("abc") == [] and text_ids("abcd") == [int.from_bytes(b"abcd", "little")]


def test_chat_turns_render_to_prefixes_of_the_next_turn_the_same_everywhere():
    system = {"role": "system", "content": "You solve problems."}
    turns = [system]
    rendered = [render_chat(turns)]
    for k in range(5):
        turns = [*turns, {"role": "user", "content": f"q{k}"}]
        turns = [*turns, {"role": "assistant", "content": [{"type": "text", "text": f"a{k}"}]}]
        rendered.append(render_chat(turns))
    assert all(b.startswith(a) for a, b in itertools.pairwise(rendered))
    # Roles are part of the key: the same words from another speaker are another prompt.
    assert render_chat([{"role": "user", "content": "x"}]) != render_chat(
        [{"role": "assistant", "content": "x"}]
    )


def test_the_request_id_is_the_session_else_the_clients_else_a_fresh_one():
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "user": "u1", "rid": "b1"}'
    by_field = SessionRule(body_field="user")
    assert route("/v1/chat/completions", chat, by_field).request_id == "u1"
    header = route("/v1/chat/completions", chat, by_field, X_Session_ID="s1")
    assert (header.request_id, header.session) == ("s1", "s1")
    plain = route("/v1/chat/completions", chat)  # without the field rule: the body's rid
    assert (plain.request_id, plain.session, plain.client_rid) == ("b1", None, "b1")
    assert route("/v1/chat/completions", chat, X_Request_Id="h1").request_id == "h1"
    fresh = {route("/v1/completions", b'{"prompt": "x"}').request_id for _ in range(50)}
    assert len(fresh) == 50
    assert retry_ids("s1", 2) == ["s1", "s1~r1", "s1~r2"]


def test_prompts_become_the_policys_fields():
    ids = route("/v1/completions", b'{"prompt": [5, 6, 7, 8]}')
    assert ids.fields(["prompt_ids"]) == {"prompt_ids": [5, 6, 7, 8]}
    batch = route("/v1/completions", b'{"prompt": [[1, 2], [3]], "temperature": 0.5}')
    assert batch.fields(["prompt_ids", "sampling_params"]) == {
        "prompt_ids": [1, 2],
        "sampling_params": {"temperature": 0.5},
    }
    gen = route("/generate", b'{"text": "abcdefgh", "sampling_params": {"max_new_tokens": 3}}')
    assert gen.fields(["prompt_ids", "sampling_params"]) == {
        "prompt_ids": text_ids("abcdefgh"),
        "sampling_params": {"max_new_tokens": 3},
    }
    grouped = route("/generate", b'{"input_ids": [1, 2]}', X_Group_ID="g7")
    assert grouped.fields(["group_id", "prompt_ids"]) == {"group_id": "g7", "prompt_ids": [1, 2]}
    assert route("/v1/models", b"").fields(["prompt_ids"]) == {}  # nothing to route on


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"", None),
        ("/v1/completions", b"\xff", None),
        ("/v1/completions", b'"x"', None),
        ("/v1/completions", b'{"prompt": true}', "prompt"),
        ("/v1/completions", b'{"prompt": [1, 2.5]}', "prompt"),
        ("/v1/completions", b'{"prompt": [4294967296]}', "prompt"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "u", "content": 3}]}', "messages"),
        ("/generate", b'{"text": ["a", 1]}', "text"),
        ("/generate", b'{"text": "a", "stream": 1}', "stream"),
    ],
)
def test_a_malformed_body_is_refused_naming_the_field(path, body, param):
    with pytest.raises(BadRequest) as exc:
        route(path, body)
    assert exc.value.param == param
    if param:
        assert param in str(exc.value)


def test_ids_from_headers_are_checked():
    body = b'{"prompt": "x"}'
    with pytest.raises(BadRequest, match="X-Session-ID must be at most"):
        route("/v1/completions", body, X_Session_ID="s" * 505)
    with pytest.raises(BadRequest, match="control characters"):
        route("/v1/completions", body, X_Request_Id="a\x01b")
    with pytest.raises(BadRequest, match="session key"):
        route("/v1/completions", b'{"prompt": "x", "user": 3}', SessionRule(body_field="user"))
    with pytest.raises(ValueError, match="session header"):
        SessionRule(header="")


def test_a_replica_url_comes_from_its_metadata_or_the_metadata_itself():
    assert replica_url({"url": "http://10.0.0.1:8000/"}) == "http://10.0.0.1:8000"
    assert replica_url("https://h:1") == "https://h:1"
    assert replica_url(None) is None and replica_url({"host": "h"}) is None
    assert replica_url("ray-actor-handle") is None


def args_of(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def test_serve_takes_its_balancer_from_a_router_yaml_and_flags_win(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    yaml = tmp_path / "router.yaml"
    yaml.write_text(
        "router_class: prefix_cache\nname: pc\nredis: redis://h:1/0\nblock_size: 16\n"
        "sticky_ttl: 600\n"
    )
    url, name, policy, config = balancer_options(
        args_of(
            "serve",
            "--router-config",
            str(yaml),
            "--sticky-ttl",
            "60",
            "--option",
            "min_match=0.25",
        )
    )
    assert (url, name, policy.name) == ("redis://h:1/0", "pc", "prefix_cache")
    assert config == {"block_size": 16, "sticky_ttl": 60.0, "min_match": 0.25}
    _, name, _, _ = balancer_options(
        args_of("--name", "mine", "serve", "--router-config", str(yaml))
    )
    assert name == "mine"
    _, _, policy, config = balancer_options(args_of("serve", "--policy", "least_tokens"))
    assert policy == "least_tokens" and config == {}
    not_a_balancer = tmp_path / "other.yaml"
    not_a_balancer.write_text("router_class: collections.OrderedDict\n")
    with pytest.raises(CliError, match="not a redis-router balancer"):
        balancer_options(args_of("serve", "--router-config", str(not_a_balancer)))
    with pytest.raises(CliError, match="KEY=VALUE"):
        balancer_options(args_of("serve", "--option", "block_size"))


def test_a_503_says_whether_retrying_can_help() -> None:
    """Every error that stops a request from being routed is a 503 (serve, the transports):
    with Retry-After while waiting can help, without it for a Redis that refuses the
    credentials or whose host does not resolve."""
    from redis_router.errors import (
        CredentialsRefused,
        NoCapacity,
        NoServersAvailable,
        PoolExhausted,
        RedisUnavailable,
        ReplicaEjected,
        UnknownRedisHost,
    )
    from redis_router.http.routing import NOT_ROUTED, refusal

    cases = {
        NoServersAvailable("empty"): ("1", "no_servers_available"),
        NoCapacity("full"): ("1", "no_capacity"),
        ReplicaEjected("ejected", "r0", 2.5): ("3", "replica_ejected"),
        RedisUnavailable("down"): ("1", "redis_unavailable"),
        PoolExhausted("busy"): ("1", "pool_exhausted"),
        CredentialsRefused("refused"): (None, "redis_config_error"),
        UnknownRedisHost("unknown"): (None, "redis_config_error"),
    }
    for exc, answer in cases.items():
        assert isinstance(exc, NOT_ROUTED)
        assert refusal(exc) == answer, exc
