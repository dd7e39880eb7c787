"""Lease tokens and operation ids come from a buffer of os.urandom: unique within a process,
across its threads, and between a process and its forked children."""

from __future__ import annotations

import os
import threading

from redis_router import core
from redis_router.validation import TOKEN_RE


def test_tokens_are_well_formed_and_never_repeat():
    seen = set()
    for n in (1, 3, 600, 1):  # batches larger than the buffer too
        batch = core.new_tokens(n) if n > 1 else [core.new_token()]
        assert all(len(t) == 16 and TOKEN_RE.fullmatch(t) for t in batch)
        seen.update(batch)
    many = [core.new_token() for _ in range(20_000)]
    seen.update(many)
    assert len(seen) == 1 + 3 + 600 + 1 + 20_000


def test_threads_never_get_the_same_token():
    got: list[list[str]] = [[] for _ in range(4)]

    def draw(k: int) -> None:
        got[k] = [core.new_token() for _ in range(5_000)]

    threads = [threading.Thread(target=draw, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    flat = [t for g in got for t in g]
    assert len(flat) == 20_000 and len(set(flat)) == 20_000


def test_a_forked_child_draws_other_tokens_than_its_parent():
    core.new_token()  # the buffer is filled: the child inherits it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next tokens and leave at once
        os.close(read)
        os.write(write, " ".join(core.new_tokens(50)).encode())
        os._exit(0)
    os.close(write)
    child = b""
    while chunk := os.read(read, 65536):
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    mine = core.new_tokens(50)
    assert len(child.split()) == 50
    assert not set(child.decode().split()) & set(mine)
