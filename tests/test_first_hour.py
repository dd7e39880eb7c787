"""What a newcomer meets in the first hour: a wrong password or host said as a configuration
error (not an outage), a mistyped keyword refused, a closed balancer that routes no more, and
the small things around the CLI, the simulator, docker-compose and the shipped plugins."""

from __future__ import annotations

import asyncio
import importlib.metadata
import io
import re
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

import redis_router as rr  # the new errors as rr.X: on an older tree each test fails alone
from redis_router import (
    AsyncRedisLoadBalancer,
    RedisLoadBalancer,
    RedisRouterError,
    RedisUnavailable,
    cli,
    get_router_handle,
)
from redis_router.core import OPTION_DEFAULTS
from redis_router.local_server import LocalServer, ServerBinary
from redis_router.plugins.least_tokens import LeastTokensRouter
from redis_router.plugins.prefix_cache import PrefixCacheRouter
from redis_router.tools import simulate

from .test_cli import UNREACHABLE, assert_one_line_error, run_cli

ROOT = Path(__file__).resolve().parent.parent
SERVERS = {"a": None, "b": None}
PASSWORD = "s3cr3t-Pw"
WRONG = "wr0ng-Pw"
USER_PASSWORD = "us3r-Pw"
NOT_AN_OUTAGE = "once it is back"  # what a RedisUnavailable promises
EX_CONFIG = 78

# -- a wrong password, a missing one, an unknown host ----------------------------------------


@pytest.fixture
def protected(binary: ServerBinary) -> Iterator[LocalServer]:
    """A server of the test's own with requirepass, an enabled ACL user `router` and a
    disabled one `gone`, both with USER_PASSWORD."""
    srv = LocalServer(binary, password=PASSWORD).start()
    try:
        with srv.client() as c:
            c.execute_command("ACL", "SETUSER", "router", "on", f">{USER_PASSWORD}", "~*", "+@all")
            c.execute_command("ACL", "SETUSER", "gone", "off", f">{USER_PASSWORD}", "~*", "+@all")
        yield srv
    finally:
        srv.close()


def refused_urls(srv: LocalServer) -> dict[str, str]:
    where = f"{srv.host}:{srv.port}"
    return {
        "wrong-password": f"redis://:{WRONG}@{where}/0",
        "no-password": f"redis://{where}/0",
        "acl-user-wrong-password": f"redis://router:{WRONG}@{where}/0",
        "acl-user-disabled": f"redis://gone:{USER_PASSWORD}@{where}/0",
        "unknown-acl-user": f"redis://nobody:{USER_PASSWORD}@{where}/0",
        "query-password": f"redis://{where}/0?password={WRONG}",
    }


def assert_configuration_error(error: BaseException, *secrets: str) -> None:
    assert isinstance(error, rr.CredentialsRefused), repr(error)
    assert isinstance(error, rr.RedisConfigError) and isinstance(error, RedisRouterError)
    assert not isinstance(error, (RedisUnavailable, ConnectionError))  # callers retry those
    text = str(error) + repr(error)
    assert "refused the credentials" in text and "ACL" in text and "password in the URL" in text
    assert NOT_AN_OUTAGE not in text
    for secret in secrets:
        assert secret not in text


def first_async_acquire(url: str) -> BaseException:
    async def main() -> BaseException:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=url, name="first")
        try:
            await lb.acquire_server("r1")
        except Exception as exc:
            return exc
        finally:
            await lb.close()
        raise AssertionError("an acquire was granted")

    return asyncio.run(main())


def test_refused_credentials_are_a_configuration_error_sync_async_and_cli(protected) -> None:
    for case, url in refused_urls(protected).items():
        with pytest.raises(RedisRouterError) as info:
            RedisLoadBalancer(SERVERS, redis=url, name="first")
        assert_configuration_error(info.value, WRONG, USER_PASSWORD, PASSWORD)
        if case == "no-password":
            assert "requires a password and the URL gives none" in str(info.value)
        assert_configuration_error(first_async_acquire(url), WRONG, USER_PASSWORD, PASSWORD)

        proc = run_cli("status", redis=url)
        assert proc.returncode == EX_CONFIG, (case, proc.stderr)
        line = assert_one_line_error(proc, "configuration error", "refused the credentials")
        assert NOT_AN_OUTAGE not in line
        assert WRONG not in line and USER_PASSWORD not in line and PASSWORD not in line
    # The right credentials work, as the password and as the ACL user.
    where = f"{protected.host}:{protected.port}"
    for url in (f"redis://:{PASSWORD}@{where}/0", f"redis://router:{USER_PASSWORD}@{where}/0"):
        with RedisLoadBalancer(SERVERS, redis=url, name="first") as lb:
            assert lb.acquire_server("r1")[0] in SERVERS


def test_an_unknown_host_is_a_configuration_error_and_a_refused_port_an_outage() -> None:
    url = "redis://:hunter2@no-such-host.invalid:6379/0"  # .invalid never resolves (RFC 6761)
    with pytest.raises(RedisRouterError) as info:
        RedisLoadBalancer(SERVERS, redis=url, name="first")
    error = info.value
    assert isinstance(error, rr.UnknownRedisHost) and not isinstance(error, RedisUnavailable)
    assert "does not resolve" in str(error) and "host name in the URL" in str(error)
    assert NOT_AN_OUTAGE not in str(error) and "hunter2" not in str(error)
    error = first_async_acquire(url)
    assert isinstance(error, rr.UnknownRedisHost) and "hunter2" not in str(error)
    line = assert_one_line_error(run_cli("status", redis=url), "configuration error")
    assert "does not resolve" in line and "hunter2" not in line
    # Nothing listening: an outage, which calls ride out.
    with pytest.raises(RedisUnavailable, match=NOT_AN_OUTAGE):
        RedisLoadBalancer(SERVERS, redis=UNREACHABLE, name="first")
    proc = run_cli("status", redis=UNREACHABLE)
    assert proc.returncode == 1 and "configuration error" not in proc.stderr


# -- a mistyped keyword ------------------------------------------------------------------------


def sync_attempts(lb: Any) -> list[Callable[[], Any]]:
    def in_lease() -> None:
        with lb.lease("r", wiat=2):
            raise AssertionError("a lease was granted")

    return [
        lambda: lb.acquire_server("r", wiat=2),
        lambda: lb.acquire("r", wiat=2),
        lambda: lb.acquire_many(["r", "s"], wiat=[1, 2]),
        in_lease,
    ]


def test_a_mistyped_keyword_is_refused_and_nothing_is_written(server, make_lb, r) -> None:
    lb = make_lb(SERVERS)
    before = {k: r.dump(k) for k in r.keys("*")}
    for attempt in sync_attempts(lb):
        with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['wiat'\]"):
            attempt()

    async def main() -> None:
        alb = AsyncRedisLoadBalancer(redis=server.url, name=lb.name)
        try:
            for attempt in (
                lambda: alb.acquire_server("r", wiat=2),
                lambda: alb.acquire("r", wiat=2),
                lambda: alb.acquire_many(["r"], wiat=[2]),
            ):
                with pytest.raises(TypeError, match=r"\['wiat'\].*\['group_id'\]"):
                    await attempt()
            with pytest.raises(TypeError, match="wiat"):
                async with alb.lease("r", wiat=2):
                    raise AssertionError("a lease was granted")
        finally:
            await alb.close()

    asyncio.run(main())
    assert {k: r.dump(k) for k in r.keys("*")} == before  # nothing was written
    assert lb.get_total_inflight() == 0


@pytest.mark.parametrize(
    "cls, options, fields",
    [
        (RedisLoadBalancer, {}, {"group_id": "g"}),
        (RedisLoadBalancer, {"group_by": "-"}, {"group_id": "g"}),
        (LeastTokensRouter, {}, {"prompt_ids": [1, 2, 3]}),
        (
            LeastTokensRouter,
            {"remaining_work": True},
            {"prompt_ids": [1, 2], "expected_output_tokens": 9, "group_id": "g"},
        ),
        (PrefixCacheRouter, {"group_cap": 2}, {"prompt_ids": list(range(64)), "group_id": "g"}),
    ],
)
def test_every_declared_field_is_still_accepted(make_lb, cls, options, fields) -> None:
    lb = make_lb(SERVERS, cls=cls, **options)
    assert set(lb.require_acquire_fields()) <= set(fields)  # each declared one is given
    sid, _ = lb.acquire_server("p-1", **fields)
    with lb.lease("p-2", **fields) as lease:
        assert lease.server_id in SERVERS
    per = {k: [v, v] for k, v in fields.items()}
    assert len(lb.acquire_many(["p-3", "p-4"], **per)) == 2
    assert sid in SERVERS and lb.get_total_inflight() == 3
    with pytest.raises(TypeError, match=r"\['prompt_id'\]"):  # a typo of a field
        lb.acquire_server("p-5", prompt_id=[1])


# -- a closed balancer -------------------------------------------------------------------------


def test_a_closed_balancer_routes_nothing_and_its_releases_are_no_ops(server, make_lb, r) -> None:
    lb = make_lb(SERVERS)
    observer = make_lb(name=lb.name)
    held = lb.acquire("kept")
    lb.close()
    for attempt in [*sync_attempts(lb), lambda: lb.acquire_server("r")]:
        with pytest.raises(rr.BalancerClosed, match=r"was closed.*create a new one"):
            attempt()
    with pytest.raises(rr.BalancerClosed):
        lb.get_status()
    assert not lb.release_server("a") and not held.release() and not held.renew()
    lb.close()  # again: nothing more
    assert observer.get_total_inflight() == 0  # nothing granted after close()
    assert observer.get_status()["holders"]["live"] == 0  # no holder registered again


def test_a_closed_asyncio_balancer_behaves_as_the_sync_one(server, make_lb) -> None:
    observer = make_lb(SERVERS)

    async def main() -> None:
        lb = AsyncRedisLoadBalancer(SERVERS, redis=server.url, name=observer.name)
        held = await lb.acquire("kept")
        await lb.close()
        for attempt in (
            lambda: lb.acquire_server("r"),
            lambda: lb.acquire("r"),
            lambda: lb.acquire_many(["r", "s"]),
            lb.get_status,
        ):
            with pytest.raises(rr.BalancerClosed, match=r"was closed.*create a new one"):
                await attempt()
        with pytest.raises(rr.BalancerClosed):
            async with lb.lease("r"):
                raise AssertionError("a lease was granted")
        assert not await lb.release_server("a")
        assert not await held.release() and not await held.renew()
        await lb.close()

    asyncio.run(main())
    assert observer.get_total_inflight() == 0
    assert observer.get_status()["holders"]["live"] == 0


# -- the CLI, the simulator, docker-compose, the plugins ---------------------------------------


def test_version_prints_the_distribution_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"redis-router {importlib.metadata.version('llm-redis-router')}\n"


def test_a_bad_replica_id_is_called_a_replica_id() -> None:
    line = assert_one_line_error(run_cli("servers", "add", "", redis=UNREACHABLE), "replica id")
    assert "servers key" not in line and "hunter2" not in line


def test_simulate_help_explains_every_option_in_plain_words() -> None:
    parser = cli.build_parser(["simulate"])
    sub = next(a for a in parser._actions if a.dest == "command")
    actions = sub.choices["simulate"]._actions  # type: ignore[attr-defined]
    missing = [a.option_strings for a in actions if not a.help]
    assert missing == []
    text = sub.choices["simulate"].format_help()  # type: ignore[attr-defined]
    assert "ALL_WORKLOADS" not in text  # an internal name
    assert "dp" in text and "('" not in text  # the workloads as words, not a tuple


def test_simulate_quick_does_not_judge_the_targets_it_is_too_small_for(server) -> None:
    out = io.StringIO()
    argv = ["--quick", "--redis", server.url, "--workloads", "multi-turn,grpo"]
    argv += ["--routers", "least-loaded,prefix-cache", "--no-bench"]
    with redirect_stdout(out):
        assert simulate.main(argv) == 0
    lines = [x for x in out.getvalue().splitlines() if x.startswith("- ")]
    assert len(lines) == 2 and all("not judged" in x for x in lines), lines
    assert not any(re.search(r": (NOT )?met$", x) for x in lines)
    # A full run still judges them, from the same figures.
    results = [
        simulate.Result(w, r, 48, 100, int(h * 100), h, 1.1, 10, 1.0, 1.0, 1.0)
        for w, r, h in (("grpo", "least-loaded", 0.4), ("grpo", "prefix-cache", 0.8))
    ]
    assert simulate.targets(results, None)[0].endswith(": met")
    assert simulate.targets(results, None, quick=True)[0].endswith(simulate.NOT_JUDGED)


def test_docker_compose_takes_the_host_port_from_redis_port() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    ports = yaml.safe_load(text)["services"]["redis"]["ports"]
    assert ports == ["${REDIS_PORT:-6379}:6379"]
    assert "REDIS_PORT=" in text  # the comment says how to pick another


@pytest.mark.parametrize("plugin", ["least_tokens", "prefix_cache"])
def test_shipped_plugins_use_the_library_lease_ttl(server, monkeypatch, plugin) -> None:
    monkeypatch.setenv("REDIS_URL", server.url)
    config = f"pkg://redis_router.plugins/{plugin}.yaml"
    lb = get_router_handle(SERVERS, config, name=f"ttl-{plugin}")
    try:
        assert lb.get_status()["lease_ttl"] == OPTION_DEFAULTS["lease_ttl"]
    finally:
        lb.close()
    assert "lease_ttl" not in yaml.safe_load((ROOT / "plugins" / f"{plugin}.yaml").read_text())
