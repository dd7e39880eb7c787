"""No credential of a Redis URL is ever shown: not in ``lb.url``, ``repr(lb)``, an error, a
keeper log line, nor in `redis-router status` (table and JSON), for every URL form.

The password is made of distinctive chunks joined by the characters that break naive
redaction (``@ : / ? #`` and ``%40``); no chunk may appear anywhere, so a partial leak
(the part after an ``@``, say) fails too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from redis_router import AsyncRedisLoadBalancer, RedisLoadBalancer, RedisUnavailable
from redis_router.connection import _query_credentials, redact
from redis_router.local_server import LocalServer, ServerBinary

CHUNKS = ("Zq7", "Wk8", "Xr9", "Yp6", "Vb5", "Ut4", "Sm3")
SECRET = "Zq7@Wk8:Xr9/Yp6?Vb5#Ut4%40Sm3"
# How a password is written into a URL: as is, percent-encoded whole, or with @ and : raw
# (which redis-py accepts in the user info).
ENCODINGS = {
    "raw": SECRET,
    "encoded": quote(SECRET, safe=""),
    "raw-at-colon": quote(SECRET, safe="@:"),
}
# Every form connection.py accepts, with the password where each form takes one. Port 1:
# nothing listens there.
FORMS = {
    "redis": "redis://:{p}@127.0.0.1:1/0",
    "redis-user": "redis://user:{p}@127.0.0.1:1/0",
    "redis-lone-userinfo": "redis://{p}@127.0.0.1:1/0",
    "rediss-user": "rediss://user:{p}@127.0.0.1:1/0",
    "unix": "unix://:{p}@/nonexistent/redis.sock?db=0",
    "unix-user": "unix://user:{p}@/nonexistent/redis.sock",
    "sentinel": "redis+sentinel://:{p}@127.0.0.1:1,127.0.0.1:2/mymaster/0",
    "sentinel-password": "redis+sentinel://127.0.0.1:1/mymaster?sentinel_password={p}",
    "sentinel-both": "redis+sentinel://u:{p}@127.0.0.1:1/mymaster?sentinel_password={p}",
    "cluster": "redis+cluster://:{p}@127.0.0.1:1,127.0.0.1:2",
    "query-password": "redis://127.0.0.1:1/0?password={p}",
    "query-password-later": "redis://127.0.0.1:1/0?db=0&password={p}&username=u",
    "no-scheme": ":{p}@127.0.0.1:1/0",  # refused (unsupported scheme), without the password
}
CASES = [
    pytest.param(form.format(p=enc), id=f"{name}-{how}")
    for name, form in FORMS.items()
    for how, enc in ENCODINGS.items()
    # A lone user info is redis-py's user name up to its first ':': only a password without
    # one is hidden whole there (the user name is shown, as for user:password@).
    if not (name == "redis-lone-userinfo" and ":" in enc)
]


def assert_hidden(text: str) -> None:
    leaked = [c for c in CHUNKS if c in text]
    assert not leaked, f"{leaked} leaked in {text!r}"


@pytest.mark.parametrize("url", CASES)
def test_redact_hides_every_part_of_the_password(url):
    shown = redact(url)
    assert_hidden(shown)
    if "://" in url:
        assert shown.startswith(url.split("://")[0] + "://")
    assert "***" in shown


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:p%40ss@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:a@b@h:1/0", "redis://user:***@h:1/0"),
        ("redis://h:1/0?db=2&password=x&ssl=true", "redis://h:1/0?db=2&password=***"),
        (
            "redis+sentinel://a:1/svc?sentinel_password=x",
            "redis+sentinel://a:1/svc?sentinel_password=***",
        ),
        ("redis://h:1/0", "redis://h:1/0"),
        ("unix:///tmp/r.sock?db=1", "unix:///tmp/r.sock?db=1"),
        ("localhost:6379/0?password=x", "localhost:6379/0?password=***"),
        (":pw@localhost:6379", ":***@localhost:6379"),
    ],
)
def test_redact_keeps_what_is_no_secret(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize("url", CASES)
def test_unreachable_url_hides_the_password_in_every_output(url):
    """Sync: the constructor reaches Redis and fails; asyncio: the first call does."""
    started = time.monotonic()
    with pytest.raises((RedisUnavailable, ValueError)) as info:
        RedisLoadBalancer(redis=url, name="red")
    assert time.monotonic() - started < 10  # a bound (a Sentinel used to take ~15 s)
    assert_hidden(str(info.value) + repr(info.value))
    assert "***" in str(info.value)
    if isinstance(info.value, RedisUnavailable):
        lb = AsyncRedisLoadBalancer(redis=url, name="red")
        assert_hidden(lb.url + repr(lb))

        async def first_call() -> BaseException:
            try:
                await lb.acquire_server("r1")
            except RedisUnavailable as exc:
                return exc
            raise AssertionError("an unreachable Redis granted an acquire")

        error = asyncio.run(first_call())
        assert_hidden(str(error) + repr(error))


# -- a real server whose password holds every awkward character -----------------------------


@pytest.fixture
def secured(binary: ServerBinary) -> Iterator[LocalServer]:
    srv = LocalServer(binary, password=SECRET)
    srv.args = ("--unixsocket", os.path.join(srv.dir, "r.sock"), "--unixsocketperm", "700")
    srv.start()
    yield srv
    srv.close()


def working_urls(srv: LocalServer) -> dict[str, str]:
    enc, raw_at = quote(SECRET, safe=""), quote(SECRET, safe="@:")
    where = f"{srv.host}:{srv.port}"
    return {
        "password": f"redis://:{enc}@{where}/0",
        "user-password": f"redis://default:{raw_at}@{where}/0",
        "query-password": f"redis://{where}/0?password={enc}",
        "unix": f"unix://:{enc}@{os.path.join(srv.dir, 'r.sock')}?db=0",
    }


def run_cli(*args: str, redis: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "redis_router.cli", "--redis", redis, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def wait_for(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def test_query_credentials_are_decoded_once_and_the_rest_kept() -> None:
    # redis-py before 8.1 decodes a query value twice: %2540 would reach the server as @.
    url = "redis://h:1/0?password=a%2540b&db=2&username=&password=second&username=u%25"
    assert _query_credentials(url) == (
        "redis://h:1/0?db=2",
        {"password": "a%40b", "username": "u%"},
    )
    assert _query_credentials("unix:///s.sock?db=1") == ("unix:///s.sock?db=1", {})


@pytest.mark.parametrize("form", ["password", "user-password", "query-password", "unix"])
def test_working_balancer_cli_and_keeper_never_show_the_password(secured, form, caplog):
    url = working_urls(secured)[form]
    lb = RedisLoadBalancer({"s0": None}, redis=url, name="sec", lease_ttl=0.4)
    try:
        lease = lb.acquire("r1")  # really connected: the password was right
        assert lease.server_id == "s0"
        assert_hidden(lb.url + repr(lb) + json.dumps(lb.get_status()))

        table = run_cli("--name", "sec", "status", redis=url)
        assert table.returncode == 0, table.stderr
        assert "***" in table.stdout and "s0" in table.stdout
        assert_hidden(table.stdout + table.stderr)
        as_json = run_cli("--name", "sec", "status", "--json", redis=url)
        assert as_json.returncode == 0, as_json.stderr
        assert "***" in json.loads(as_json.stdout)["redis"]
        assert_hidden(as_json.stdout + as_json.stderr)

        # The server goes away: the keeper's heartbeats fail and say so in the log.
        caplog.set_level(logging.WARNING, logger="redis_router")
        secured.stop()
        assert wait_for(lambda: any("heartbeat failed" in r.getMessage() for r in caplog.records))
        for record in caplog.records:
            assert_hidden(record.getMessage())
            assert_hidden(logging.Formatter().format(record))  # with any traceback
        with pytest.raises(RedisUnavailable) as info:
            lb.acquire_server("r2")
        assert_hidden(str(info.value))
        down = run_cli("--name", "sec", "status", redis=url)
        assert down.returncode == 1 and "***" in down.stderr
        assert_hidden(down.stdout + down.stderr)
    finally:
        lb.close()


@pytest.mark.parametrize(
    "form",
    ["redis-user", "rediss-user", "unix", "sentinel-both", "cluster", "query-password-later"],
)
@pytest.mark.parametrize("how", ["raw", "encoded"])
def test_cli_error_for_an_unreachable_url_hides_the_password(form, how):
    url = FORMS[form].format(p=ENCODINGS[how])
    proc = run_cli("status", "--json", redis=url)
    assert proc.returncode == 1 and proc.stdout == ""
    line = proc.stderr.strip()
    assert line.startswith("redis-router: error: ") and "\n" not in line, proc.stderr
    assert "***" in line
    assert_hidden(line)


def test_status_never_shows_a_replicas_credentials(server) -> None:
    """A replica registered with credentials in its URL (as a metadata field or as a plain
    URL string): status, status --json and the health lines show it without them."""
    lb = RedisLoadBalancer(
        {
            "a": {"url": "http://ops:s3cret-a@127.0.0.1:1/v1", "dp": [1]},
            "b": "http://ops:s3cret-b@127.0.0.1:2",
        },
        redis=server.url,
        name="metas",
    )
    try:
        table = run_cli("--name", "metas", "status", redis=server.url)
        as_json = run_cli("--name", "metas", "status", "--json", redis=server.url)
        for proc in (table, as_json):
            assert proc.returncode == 0, proc.stderr
            assert "s3cret" not in proc.stdout + proc.stderr
        shown = json.loads(as_json.stdout)["replicas"]
        assert shown["a"]["metadata"] == {"url": "http://ops:***@127.0.0.1:1/v1", "dp": [1]}
        assert shown["b"]["metadata"] == {"url": "http://ops:***@127.0.0.1:2"}
        assert "127.0.0.1:2" in table.stdout
        # The balancer keeps what was registered: a worker needs the credentials.
        assert lb.get_status()["replicas"]["a"]["metadata"]["url"].startswith("http://ops:s3cret")
    finally:
        lb.destroy()
        lb.close()
