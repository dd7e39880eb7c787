"""get_router_handle: explicit class, then YAML config, then the default; one clear error type."""

from __future__ import annotations

import random
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from redis_router import (
    AsyncRedisLoadBalancer,
    RedisLoadBalancer,
    RouterConfigError,
    get_router_handle,
)
from redis_router.plugins.least_tokens import LeastTokensRouter

SERVERS = {"s0": "http://10.0.0.0:8000", "s1": "http://10.0.0.1:8000"}


class Recorder(RedisLoadBalancer):
    """Records how the loader called it (a subclass, so it satisfies the protocol)."""

    def __init__(self, servers: Any = None, **kw: Any) -> None:
        self.called_with = {"servers": servers, **kw}
        super().__init__(servers, **kw)


class NotARouter:
    def __init__(self, **kw: Any) -> None:
        pass

    def acquire_server(self, request_id: str) -> tuple[str, Any]:
        return "s0", None


def write(tmp_path: Path, text: str, name: str = "router.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_default_is_a_redis_load_balancer_built_with_the_options(server):
    lb = get_router_handle(SERVERS, redis=server.url, name="dflt", full_determinism=True)
    assert type(lb) is RedisLoadBalancer
    assert lb.get_all_servers() == ["s0", "s1"]
    status = lb.get_status()
    assert status["name"] == "dflt" and status["full_determinism"] is True
    lb.close()


def test_explicit_class_wins_over_the_config(server, tmp_path):
    path = write(tmp_path, "router_class: redis_router.RedisLoadBalancer\n")
    lb = get_router_handle(SERVERS, path, load_balancer_cls=Recorder, redis=server.url, name="x")
    assert type(lb) is Recorder
    assert lb.called_with == {"servers": SERVERS, "redis": server.url, "name": "x"}
    lb.close()


class OnlyServers(Recorder):
    """A router built the way verl builds an explicit class: servers, nothing else."""

    def __init__(self, servers: Any) -> None:
        self.got = servers


def test_explicit_class_gets_servers_and_full_determinism_only_if_it_is_the_default(server):
    assert get_router_handle(SERVERS, load_balancer_cls=OnlyServers).got == SERVERS
    with pytest.warns(UserWarning, match="full_determinism=True is not passed to"):
        assert get_router_handle(SERVERS, load_balancer_cls=OnlyServers, full_determinism=True)
    for cls in (RedisLoadBalancer, AsyncRedisLoadBalancer):
        lb = get_router_handle(
            SERVERS, load_balancer_cls=cls, full_determinism=True, redis=server.url, name="d"
        )
        assert type(lb) is cls and lb._core.full_determinism is True


class VerlStylePlugin(Recorder):
    """A plugin written for verl: the config is the second positional parameter, whatever
    its name."""

    def __init__(self, servers: Any, config: dict[str, Any]) -> None:
        self.got = servers, config


def test_yaml_router_gets_the_config_positionally_when_it_can(tmp_path):
    path = write(tmp_path, "router_class: tests.test_loader.VerlStylePlugin\nname: n\nk: 1\n")
    assert get_router_handle(SERVERS, path).got == (SERVERS, {"name": "n", "k": 1})


def test_yaml_router_gets_servers_and_the_rest_of_the_yaml_as_router_kwargs(
    server, tmp_path, monkeypatch
):
    monkeypatch.setenv("REDIS_URL", server.url)
    monkeypatch.setenv("RR_TEST_TTL", "7")
    path = write(
        tmp_path,
        """
        router_class: tests.test_loader.Recorder
        redis: ${oc.env:REDIS_URL,redis://localhost:6379/0}
        name: from-yaml
        lease_ttl: ${oc.decode:${oc.env:RR_TEST_TTL}}
        sticky_ttl: ${lease_ttl}
        """,
    )
    lb = get_router_handle(SERVERS, str(path))
    assert lb.called_with == {
        "servers": SERVERS,
        "router_kwargs": {
            "redis": server.url,
            "name": "from-yaml",
            "lease_ttl": 7,
            "sticky_ttl": 7,
        },
    }
    assert lb.get_status()["lease_ttl"] == 7.0
    lb.close()


def test_call_options_and_full_determinism_reach_a_yaml_router(server, tmp_path):
    path = write(
        tmp_path,
        f"router_class: tests.test_loader.Recorder\nredis: {server.url}\nname: file-name\n",
    )
    lb = get_router_handle(SERVERS, path, full_determinism=True, name="call-name")
    assert lb.called_with["router_kwargs"] == {
        "redis": server.url,
        "name": "call-name",  # the call's option overrides the file's
        "full_determinism": True,
    }
    lb.close()


def test_relative_path_is_resolved_against_the_working_directory(server, tmp_path, monkeypatch):
    write(tmp_path, f"router_class: redis_router.RedisLoadBalancer\nredis: {server.url}\n")
    monkeypatch.chdir(tmp_path)
    lb = get_router_handle(SERVERS, "router.yaml")
    assert type(lb) is RedisLoadBalancer
    lb.close()


def test_registered_router_name_is_accepted(server, tmp_path):
    """`default` is registered under redis_router.routers by this package's pyproject."""
    path = write(tmp_path, f"router_class: default\nredis: {server.url}\nname: by-name\n")
    lb = get_router_handle(SERVERS, path)
    assert type(lb) is RedisLoadBalancer and lb.name == "by-name"
    lb.close()


def test_packaged_config_loads_by_pkg_url(server, monkeypatch):
    monkeypatch.setenv("REDIS_URL", server.url)
    lb = get_router_handle(SERVERS, "pkg://redis_router.plugins/least_tokens.yaml", name="pk")
    assert type(lb) is LeastTokensRouter
    lb.close()


def test_async_router_class_is_returned_unstarted(server, tmp_path):
    path = write(
        tmp_path, f"router_class: redis_router.AsyncRedisLoadBalancer\nredis: {server.url}\n"
    )
    assert type(get_router_handle(SERVERS, path)) is AsyncRedisLoadBalancer


# -- every failure is a RouterConfigError that says what and where --------------------------


def fails(servers: Any, path: Any, *needles: str, **kw: Any) -> RouterConfigError:
    with pytest.raises(RouterConfigError) as info:
        get_router_handle(servers, path, **kw)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    return info.value


def test_missing_file_names_the_resolved_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = fails(SERVERS, "nope.yaml", str(tmp_path / "nope.yaml"), "working directory")
    assert isinstance(err, ValueError)  # one type, also a ValueError for generic handlers


def test_bad_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "router_class: [unclosed\n")
    fails(SERVERS, path, str(path), "not valid YAML")


def test_non_mapping_yaml_is_refused(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    fails(SERVERS, path, str(path), "mapping")


def test_hydra_defaults_are_rejected_naming_the_key_and_the_file(tmp_path):
    path = write(tmp_path, "defaults:\n  - base\nrouter_class: redis_router.RedisLoadBalancer\n")
    fails(SERVERS, path, "`defaults`", str(path), "Hydra composition is not supported")


def test_unresolvable_interpolation_names_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RR_SURELY_UNSET", raising=False)
    path = write(tmp_path, "router_class: default\nredis: ${oc.env:RR_SURELY_UNSET}\n")
    fails(SERVERS, path, str(path), "RR_SURELY_UNSET", "interpolation")


def test_missing_router_class_says_what_to_add(tmp_path):
    path = write(tmp_path, "name: x\n")
    fails(SERVERS, path, str(path), "no router_class", "router_class: redis_router.")


def test_unknown_module_is_named(tmp_path):
    path = write(tmp_path, "router_class: no_such_pkg.routers.Fancy\n")
    fails(SERVERS, path, "'no_such_pkg.routers'", "install the package", str(path))


def test_unknown_class_is_named_with_the_module(tmp_path):
    path = write(tmp_path, "router_class: redis_router.NoSuchRouter\n")
    fails(SERVERS, path, "'redis_router'", "'NoSuchRouter'", str(path))


def test_unregistered_bare_name_lists_the_registered_ones(tmp_path):
    path = write(tmp_path, "router_class: fancy\n")
    fails(SERVERS, path, "'fancy'", "redis_router.routers", "'default'")


def test_a_class_that_is_not_a_balancer_is_refused_before_it_is_built(tmp_path):
    path = write(tmp_path, "router_class: tests.test_loader.NotARouter\n")
    fails(SERVERS, path, "does not implement RequestLoadBalancer", "release_server", str(path))
    fails(SERVERS, None, "NotARouter", "release_server", load_balancer_cls=NotARouter)


def test_something_that_is_not_a_class_is_refused(tmp_path):
    path = write(tmp_path, "router_class: redis_router.get_router_handle\n")
    fails(SERVERS, path, "not a class")


def test_unknown_option_names_the_router_and_the_option(server, tmp_path):
    path = write(
        tmp_path, f"router_class: redis_router.RedisLoadBalancer\nredis: {server.url}\nttl: 3\n"
    )
    fails(SERVERS, path, "could not be constructed", "'ttl'", str(path))


def test_the_default_rng_option_passes_through(server):
    lb = get_router_handle(SERVERS, redis=server.url, name="rng", rng=random.Random(1))
    assert lb.acquire_server("a")[0] in SERVERS
    lb.close()


# -- pkg:// names a file of the package and nothing else ------------------------------------


@pytest.fixture
def outside_package(tmp_path, monkeypatch):
    """A package ``rrpkgx`` on sys.path, and beside it (outside it) a valid router config that
    the package reaches by ``..`` and through a symlink of its own."""
    pkg = tmp_path / "rrpkgx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "inside.yaml").write_text("router_class: default\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x.yaml").write_text("router_class: default\n")
    (pkg / "link.yaml").symlink_to(elsewhere / "x.yaml")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("rrpkgx", None)  # a previous test's package of that name
    yield pkg
    sys.modules.pop("rrpkgx", None)


@pytest.mark.parametrize(
    "rel",
    [
        "../elsewhere/x.yaml",
        "../../elsewhere/x.yaml",
        "sub/../../elsewhere/x.yaml",
        "./inside.yaml",
        "/" + "etc/passwd",
        "link.yaml",
    ],
)
def test_pkg_path_outside_the_package_is_refused(outside_package, rel):
    err = fails(SERVERS, f"pkg://rrpkgx/{rel}", "rrpkgx")
    assert isinstance(err, ValueError)
    assert "pkg://" in str(err) and "package" in str(err)


def test_pkg_path_of_the_shipped_plugins_cannot_climb_out():
    fails(SERVERS, "pkg://redis_router.plugins/../../elsewhere/x.yaml", "'..'")


def test_pkg_path_inside_the_package_still_resolves(outside_package):
    from redis_router.loader import resolve_config_path

    assert resolve_config_path("pkg://rrpkgx/inside.yaml") == outside_package / "inside.yaml"


def test_pkg_path_finds_a_file_in_a_folder_the_package_added_to_its_path(tmp_path, monkeypatch):
    """A package's __init__ may extend its search path: its files there are its own."""
    from redis_router.loader import resolve_config_path

    pkg, extra = tmp_path / "rrpkgy", tmp_path / "extra"
    pkg.mkdir()
    extra.mkdir()
    (pkg / "__init__.py").write_text(f"__path__.append({str(extra)!r})\n")
    (extra / "more.yaml").write_text("router_class: default\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("rrpkgy", None)
    try:
        assert resolve_config_path("pkg://rrpkgy/more.yaml") == extra / "more.yaml"
        fails(SERVERS, "pkg://rrpkgy/../rrpkgy/__init__.py", "'..'")
    finally:
        sys.modules.pop("rrpkgy", None)
