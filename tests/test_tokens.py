"""Lease tokens and operation ids come from buffers of os.urandom: unique within a process,
across its threads, and between a process and its forked children."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

import pytest

from redis_router import core
from redis_router.validation import TOKEN_RE

# An operation id: base64url, never "!" or "+" first (a release's health marks), no padding.
OPERATION_RE = re.compile(r"[A-Za-z0-9_-]{12}")

KINDS = {
    "token": (core.new_token, core.new_tokens, TOKEN_RE),
    "operation": (core.new_operation, core.new_operations, OPERATION_RE),
}


@pytest.fixture(params=sorted(KINDS))
def kind(
    request: pytest.FixtureRequest,
) -> tuple[Callable[[], str], Callable[[int], list[str]], re.Pattern[str]]:
    return KINDS[request.param]


def test_ids_are_well_formed_and_never_repeat(kind):
    one, many, form = kind
    seen = set()
    for n in (1, 3, 600, 1):  # batches larger than the buffer too
        batch = many(n) if n > 1 else [one()]
        assert len(batch) == n and all(form.fullmatch(t) for t in batch), batch
        seen.update(batch)
    seen.update(one() for _ in range(20_000))
    assert len(seen) == 1 + 3 + 600 + 1 + 20_000


def test_operation_ids_are_twelve_characters_of_which_redis_keeps_nine_a_release():
    """12 characters: the last three name the field a remembered release shares, the other
    nine are what it adds to it (lib/leases.lua, benchmarks/memory.py), and no id holds the
    separator that packs them."""
    ops = core.new_operations(1000)
    assert {len(op) for op in ops} == {12}
    assert not any("\x1f" in op for op in ops)


def test_threads_never_get_the_same_id(kind):
    one = kind[0]
    got: list[list[str]] = [[] for _ in range(4)]

    def draw(k: int) -> None:
        got[k] = [one() for _ in range(5_000)]

    threads = [threading.Thread(target=draw, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    flat = [t for g in got for t in g]
    assert len(flat) == 20_000 and len(set(flat)) == 20_000


def test_a_forked_child_draws_other_ids_than_its_parent(kind):
    one, many, _ = kind
    one()  # the buffer is filled: the child inherits it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next ids and leave at once
        os.close(read)
        os.write(write, " ".join(many(50)).encode())
        os._exit(0)
    os.close(write)
    child = b""
    while chunk := os.read(read, 65536):
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    mine = many(50)
    assert len(child.split()) == 50
    assert not set(child.decode().split()) & set(mine)
