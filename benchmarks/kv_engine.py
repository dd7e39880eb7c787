"""Replicas publishing KV-cache events as an engine does, paced, for benchmarks/kv_lag.py.

Each replica is a thread with its own publisher (:mod:`redis_router.kv_events.publisher`, the
wire format vLLM and SGLang use) and a small model of a prefix cache of ``CAPACITY`` blocks of
16 tokens: a scheduler step every 10-20 ms publishes one batch holding the events that step
produced. Running requests fill one block at a time (a ``BlockStored`` of one block chained to
the request's last), a new request caches its prompt (one ``BlockStored`` of 4-32 blocks), a
finished request's blocks become evictable, and a full cache evicts the least recently used
one per new block (a ``BlockRemoved`` each, as vLLM emits them). Every batch carries its wall
clock time at sending, which is what the lag is measured from.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from typing import Any

from redis_router.kv_events.publisher import Publisher, removed, stored

BLOCK = 16  # tokens per engine block
CAPACITY = 2048  # blocks per replica's cache
RUNNING = 32  # requests decoding at once per replica
NEW_REQUEST = 0.04  # share of stored events that are a new request's prompt
STEP = (0.010, 0.020)  # seconds between scheduler steps (uniform)
VOCAB = range(32_000)  # token ids


class Engine:
    """One replica's prefix cache and the events its steps produce."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.running: list[list[int]] = []  # per request: its blocks' engine hashes
        self.evictable: OrderedDict[int, None] = OrderedDict()  # finished requests' blocks
        self.cached = 0
        self.stored_events = self.removed_events = self.stored_blocks = 0

    def _block_hash(self) -> int:
        return self.rng.getrandbits(63)

    def _tokens(self, n: int) -> list[int]:
        return self.rng.choices(VOCAB, k=n * BLOCK)

    def _make_room(self, n: int, out: list[Any]) -> None:
        while self.cached + n > CAPACITY and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            self.cached -= 1
            self.removed_events += 1
            out.append(removed([h], arrays=True))

    def step(self, events: int) -> list[Any]:
        """About ``events`` events of one scheduler step (evictions come with their store)."""
        out: list[Any] = []
        while len(out) < events:
            if len(self.running) < RUNNING or self.rng.random() < NEW_REQUEST:
                n = self.rng.randint(4, 32)
                hashes = [self._block_hash() for _ in range(n)]
                self._make_room(n, out)
                out.append(stored(list(hashes), None, self._tokens(n), BLOCK, arrays=True))
                self.running.append(hashes)
                if len(self.running) > RUNNING:  # the oldest request finishes
                    self.evictable.update((h, None) for h in self.running.pop(0))
            else:
                req = self.running[self.rng.randrange(len(self.running))]
                h = self._block_hash()
                self._make_room(1, out)
                out.append(stored([h], req[-1], self._tokens(1), BLOCK, arrays=True))
                req.append(h)
                n = 1
            self.cached += n
            self.stored_events += 1
            self.stored_blocks += n
        return out


class Replica:
    """A publisher and its engine, stepping in a thread at ``rate`` events per second."""

    def __init__(self, seed: int, rate: float) -> None:
        self.pub = Publisher()
        self.engine = Engine(random.Random(seed))
        self.rate = rate
        self.sent: list[tuple[int, float, int]] = []  # (seq, ts, events) per batch
        self.thread: threading.Thread | None = None

    def run(self, start: float, seconds: float) -> None:
        """Publish from wall time ``start`` for ``seconds`` (in a thread: see begin())."""
        rng = self.engine.rng
        time.sleep(max(0.0, start - time.time()) + rng.uniform(*STEP))  # engines are not in step
        end = start + seconds
        done = 0
        while True:
            now = time.time()
            if now >= end:
                return
            due = int((now - start) * self.rate) - done
            if due > 0:
                events = self.engine.step(due)
                ts = time.time()
                seq = self.pub.publish(events, ts=ts)
                self.sent.append((seq, ts, len(events)))
                done += len(events)
            time.sleep(rng.uniform(*STEP))

    def begin(self, start: float, seconds: float) -> None:
        self.thread = threading.Thread(target=self.run, args=(start, seconds), daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join()
        self.pub.close()


def serve(conn: Any, replicas: int, rate: float, seed: int) -> None:
    """A process of ``replicas`` replicas at ``rate`` events/s in all, driven over a pipe:
    sends their metadata, takes (start, seconds), sends back per replica what it sent and the
    event mix."""
    reps = [Replica(seed + i, rate / replicas) for i in range(replicas)]
    try:
        conn.send([r.pub.meta() for r in reps])
        start, seconds = conn.recv()
        for r in reps:
            r.begin(start, seconds)
        for r in reps:
            assert r.thread is not None
            r.thread.join()
        mix = {
            "stored_events": sum(r.engine.stored_events for r in reps),
            "removed_events": sum(r.engine.removed_events for r in reps),
            "stored_blocks": sum(r.engine.stored_blocks for r in reps),
        }
        conn.send(([r.sent for r in reps], mix))
        conn.recv()  # keep the replay sockets up until the measurement is over
    finally:
        for r in reps:
            r.close()
