"""Follow every replica of a balancer and keep the exact index in Redis (needs pyzmq, msgspec).

One SUB socket per publisher (a replica's dp rank), all served by one thread. Each batch goes
to ``kv_index_apply.lua`` with its sequence number, the batches every stream has ready sent
together in one pipeline (one round trip, however many replicas: the lag would otherwise grow
with replicas times the round trip); when the index answers that it wants an
earlier batch (a gap, a first connect, a restart), the subscriber asks the publisher's replay
socket (a DEALER to vLLM's ROUTER: ``["", seq]``, answered with ``["", topic, seq, payload]``
per buffered batch, then ``["", "", -1, ""]``; SGLang's replies lack the topic) and, if the
replay cannot fill it, applies the batch as a gap. On (re)connect it asks for the last applied
batch again: the same sequence number at a later time means the replica restarted.

A SUB socket receives nothing until its subscription has reached the publisher, some time after
the connection is made, and a batch published meanwhile is dropped. A later batch reveals such a
loss as a gap; the last one before a quiet spell would stay missing. So after a (re)connect,
until a batch arrives live, the subscriber asks the replay for the batches from the last applied
on a few times (JOIN_CHECKS).

Safe to run several at once: they send the same batches and the index applies each once.
None is needed for routing: without one, replicas are not trusted as exact after ``stale`` s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from redis import exceptions as rx
from zmq.utils.monitor import recv_monitor_message

from ..connection import client_for
from .endpoints import StreamEndpoint, streams_of
from .index import DEFAULT_MAX_BLOCKS, DEFAULT_STALE, Applied, Event, KVIndex
from .wire import decode_batch, decode_seq

__all__ = ["KVEventSubscriber"]

log = logging.getLogger("redis_router.kv_events")

MAX_HELD = 100_000  # batches held per stream while Redis is unreachable or a gap is filled
PIPELINE = 256  # batches applied per round trip at most
END_SEQ = -1
JOIN_CHECKS = (0.25, 1.0, 4.0)  # s after a (re)connect: look for missed batches (a replay each)


class _Stream:
    """One publisher as this subscriber sees it."""

    def __init__(self, ctx: zmq.Context[Any], ep: StreamEndpoint) -> None:
        self.ep = ep
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sub.connect(ep.endpoint)
        self.held: dict[int, tuple[float, list[Event]]] = {}
        self.last_live = -1  # the last sequence number seen on the live socket
        self.link = "0"  # "1" while connected
        self.empty = False  # the replay answered with nothing: the publisher published nothing
        self.needs_sync = True
        self.checks: list[float] = []  # when to ask the replay for batches missed while joining

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)


class KVEventSubscriber:
    """Keeps the exact index of balancer ``name`` from its replicas' KV-cache events.

    ``redis``: a URL or a redis-py client, as for RedisLoadBalancer. ``stale``: seconds a
    replica stays trusted without a subscriber (each vouches every ``heartbeat`` s).
    ``poll``: seconds between reads of the pool (replicas added, removed, endpoints changed).
    ``replay_timeout``: seconds to wait for a replay's end marker."""

    def __init__(
        self,
        redis: Any = None,
        name: str = "default",
        *,
        stale: float = DEFAULT_STALE,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        poll: float = 2.0,
        heartbeat: float = 1.0,
        replay_timeout: float = 5.0,
    ) -> None:
        self.client, self.url, self._owned = client_for(redis, asyncio=False)
        self.index = KVIndex(self.client, name, stale=stale, max_blocks=max_blocks)
        if not heartbeat < stale:
            raise ValueError(
                f"heartbeat ({heartbeat:g} s) must be shorter than stale ({stale:g} s)"
            )
        self.poll, self.heartbeat_every, self.replay_timeout = poll, heartbeat, replay_timeout
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._next_poll = self._next_beat = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_change: Callable[[str], None] | None = None  # told of replicas followed/left

    @property
    def name(self) -> str:
        return self.index.name

    def streams(self) -> list[StreamEndpoint]:
        """The publishers followed now."""
        return [s.ep for s in self._streams.values()]

    # -- the pool --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Follow the replicas registered now; forget the index of those that left."""
        raw = self.client.hgetall(self.index.prefix + "servers")
        wanted: dict[tuple[str, int], StreamEndpoint] = {}
        for sid, meta in raw.items():
            sid = sid.decode() if isinstance(sid, bytes) else sid
            try:
                eps = streams_of(sid, json.loads(meta))
            except ValueError as exc:
                log.warning("not following %s: %s", sid, exc)
                continue
            for ep in eps:
                wanted[(sid, ep.rank)] = ep
        for key in [k for k, s in self._streams.items() if wanted.get(k) != s.ep]:
            self._streams.pop(key).close()
            self._tell(f"stopped following {key[0]} rank {key[1]}")
        for key, ep in wanted.items():
            if key not in self._streams:
                self._streams[key] = _Stream(self._ctx, ep)
                self._tell(f"following {key[0]} rank {key[1]} at {ep.endpoint}")
        indexed = {
            (k.decode() if isinstance(k, bytes) else k).split(":", 1)[1]
            for k in self.client.hkeys(self.index.prefix + "kv:stream")
        }
        gone = sorted(indexed - {sid.decode() if isinstance(sid, bytes) else sid for sid in raw})
        if gone:
            forgotten, _ = self.index.drop(gone)
            if forgotten:
                self._tell(f"dropped the index of {', '.join(gone)} (left the pool)")

    def _tell(self, text: str) -> None:
        log.info(text)
        if self.on_change is not None:
            self.on_change(text)

    # -- applying batches ------------------------------------------------------------------

    def _replay(self, s: _Stream, start: int) -> tuple[bool, dict[int, tuple[float, list[Event]]]]:
        """Ask the publisher for its buffered batches from ``start``: (answered, batches)."""
        got: dict[int, tuple[float, list[Event]]] = {}
        if s.ep.replay is None:
            return False, got
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(s.ep.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    log.warning("replay of %s rank %d timed out", s.ep.server_id, s.ep.rank)
                    return False, got
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                try:
                    seq = decode_seq(frames[-2])
                    if seq == END_SEQ:
                        return True, got
                    ts, events, _ = decode_batch(frames[-1])
                except ValueError as exc:  # left out: the index sees a gap it cannot fill
                    log.warning(
                        "%s rank %d: undecodable replay: %s", s.ep.server_id, s.ep.rank, exc
                    )
                    continue
                got[seq] = (ts, events)
        finally:
            sock.close(linger=0)

    def _last_applied(self, s: _Stream) -> tuple[int, str | None]:
        """The stream's last applied sequence number in the index (-1: none) and its time
        (None when the index has never seen the stream)."""
        ep = s.ep
        raw = self.client.hget(self.index.prefix + "kv:stream", f"{ep.rank}:{ep.server_id}")
        if not raw:
            return -1, None
        fields = (raw.decode() if isinstance(raw, bytes) else raw).split(" ")
        return int(fields[0]), fields[1]

    def _sync(self, s: _Stream) -> None:
        """On (re)connect: replay from the last applied batch (whose time tells a restart)."""
        ep = s.ep
        last, ts = self._last_applied(s)
        answered, got = self._replay(s, max(last, 0))
        if answered and not got and last >= 0:
            # Nothing from the last applied batch on: the publisher restarted since.
            answered, got = self._replay(s, 0)
            if answered and not got and ts is not None:  # ... and published nothing yet
                self.index.restarted(ep.server_id, ep.rank, ep.ranks, last, ts)
        s.empty = answered and not got and ts is None
        s.held.update(got)
        s.needs_sync = False
        now = time.monotonic()
        s.checks = [now + d for d in JOIN_CHECKS] if answered else []
        self._pump(s)

    def _check_tail(self, s: _Stream) -> None:
        """Ask the replay for the batches from the last applied one on: those after it were
        published while the subscription was on its way. The last applied one comes again, so
        a publisher that restarted unseen shows by its time, as in _sync. Stops checking when
        the replay does not answer."""
        last, _ = self._last_applied(s)
        answered, got = self._replay(s, max(last, 0))
        if not answered:
            s.checks.clear()
        for k, v in got.items():
            s.held.setdefault(k, v)

    def _apply(self, s: _Stream, seq: int, gap_ok: bool) -> Applied:
        ts, events = s.held[seq]
        ep = s.ep
        return self.index.apply(ep.server_id, ep.rank, ep.ranks, seq, ts, events, gap_ok=gap_ok)

    def _pump(self, s: _Stream) -> int:
        """Apply held batches in order, filling gaps from the replay. Returns how many went."""
        done = 0
        asked: set[int] = set()
        while s.held:
            seq = min(s.held)
            res = self._apply(s, seq, gap_ok=False)
            if res.outcome == "need":
                if res.need not in asked:  # ask the replay once per number wanted
                    asked.add(res.need)
                    _, got = self._replay(s, res.need)
                    for k, v in got.items():
                        if k >= res.need:
                            s.held.setdefault(k, v)
                    continue
                log.warning(
                    "%s rank %d: batches from %d to %d are not replayable; the index is not "
                    "exact until the replica clears its cache or restarts",
                    s.ep.server_id,
                    s.ep.rank,
                    res.need,
                    seq - 1,
                )
                res = self._apply(s, seq, gap_ok=True)
            if res.outcome == "ok" and res.unchained:
                log.debug("%s: %d blocks without a known parent", s.ep.server_id, res.unchained)
            s.empty = False
            del s.held[seq]
            done += 1
        return done

    def _receive(self, s: _Stream) -> None:
        """Take every message waiting on the live socket (applied by _apply_held)."""
        while True:
            try:
                frames = s.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 2:
                continue
            try:
                seq = decode_seq(frames[-2])
                ts, events, _ = decode_batch(frames[-1])
            except ValueError as exc:
                log.warning("%s rank %d: undecodable batch: %s", s.ep.server_id, s.ep.rank, exc)
                continue
            s.checks.clear()  # the subscription works: a later loss shows as a gap
            if seq < s.last_live:  # numbers start again: the publisher restarted
                s.held.clear()
            s.last_live = seq
            if len(s.held) >= MAX_HELD:
                s.held.pop(min(s.held))
            s.held[seq] = (ts, events)

    def _apply_held(self, streams: list[_Stream]) -> int:
        """Apply the streams' held batches, each stream's in order, up to PIPELINE per round
        trip, however many streams have some. A stream whose next batch the index wants an
        earlier one for (a gap, a restart) is left to _pump, which asks its replay. Returns how
        many batches went."""
        done = 0
        todo = [s for s in streams if s.held]
        while todo:
            calls: list[tuple[_Stream, int]] = []
            for s in todo:
                calls += [(s, seq) for seq in sorted(s.held)[: PIPELINE - len(calls)]]
            results = self.index.apply_many(
                [(s.ep.server_id, s.ep.rank, s.ep.ranks, seq, *s.held[seq]) for s, seq in calls]
            )
            stuck: set[int] = set()
            for (s, seq), res in zip(calls, results, strict=True):
                if id(s) in stuck:
                    continue
                if res.outcome == "need":
                    stuck.add(id(s))
                    continue
                del s.held[seq]
                s.empty = False
                done += 1
            for s in todo:
                if id(s) in stuck:
                    done += self._pump(s)
            todo = [s for s in todo if s.held]
        return done

    def _monitor(self, s: _Stream) -> None:
        while s.monitor.poll(0):
            event = recv_monitor_message(s.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                s.link, s.needs_sync = "1", True
            elif event == zmq.EVENT_DISCONNECTED:
                s.link = "0"

    def _beat(self) -> None:
        streams = [
            (s.ep.server_id, s.ep.rank, s.ep.ranks, "e" if s.empty and s.link == "1" else s.link)
            for s in self._streams.values()
        ]
        waiting, _ = self.index.heartbeat(streams)
        while waiting:
            waiting, _ = self.index.heartbeat([])

    # -- the loop --------------------------------------------------------------------------

    def step(self, timeout: float = 0.1) -> int:
        """Wait up to ``timeout`` s for events, apply them, and do whatever polling or
        heartbeat is due. Returns how many batches were applied (or found applied)."""
        now = time.monotonic()
        if now >= self._next_poll:
            self.refresh()
            self._next_poll = now + self.poll
        poller = zmq.Poller()
        for s in self._streams.values():
            poller.register(s.sub, zmq.POLLIN)
            poller.register(s.monitor, zmq.POLLIN)
        due = [s.checks[0] - now for s in self._streams.values() if s.checks]
        wait = max(0.0, min(timeout, self._next_beat - now, self._next_poll - now, *due))
        ready = dict(poller.poll(int(wait * 1000))) if self._streams else {}
        if not self._streams:
            time.sleep(wait)
        done = 0
        for s in list(self._streams.values()):
            if s.monitor in ready:
                self._monitor(s)
            if s.needs_sync and s.link == "1":
                self._sync(s)
            if s.sub in ready:
                self._receive(s)
            now = time.monotonic()
            if s.checks and s.checks[0] <= now and s.link == "1" and not s.needs_sync:
                s.checks = [t for t in s.checks if t > now]
                self._check_tail(s)
        done += self._apply_held(list(self._streams.values()))
        if time.monotonic() >= self._next_beat:
            self._beat()
            self._next_beat = time.monotonic() + self.heartbeat_every
        return done

    def run(self, stop: threading.Event | None = None) -> None:
        """Follow the pool until ``stop`` is set (or close() is called). A Redis outage is
        logged and retried; the batches received meanwhile are held and applied after."""
        stop = stop or self._stop
        while not (stop.is_set() or self._stop.is_set()):
            try:
                self.step(0.2)
            except (rx.ConnectionError, rx.TimeoutError) as exc:
                log.warning("redis unreachable at %s: %s; retrying", self.url, exc)
                self._stop.wait(1.0)

    def start(self) -> KVEventSubscriber:
        """Run in a daemon thread (close() stops it)."""
        self._thread = threading.Thread(target=self.run, name="kv-events", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for s in self._streams.values():
            s.close()
        self._streams.clear()
        self._ctx.term()
        if self._owned:
            self.client.close()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
