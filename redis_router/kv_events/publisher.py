"""A small KV-events publisher in the wire format vLLM and SGLang use (needs msgspec, pyzmq), so
the subscriber can be tested and benchmarked without an engine: PUB (topic, 8-byte big-endian
sequence number, msgpack batch) and a ROUTER replay socket answering ``["", seq]`` with every
buffered batch from seq, then the end marker. Used by tests/test_kv_events.py and
benchmarks/kv_lag.py."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

__all__ = ["Publisher", "cleared", "removed", "stored"]

import msgspec
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], bs: int, *, arrays: bool, **extra: Any
) -> Any:
    """A BlockStored event, array-like (SGLang, older vLLM) or a tagged map (vLLM 0.33)."""
    if arrays:
        return ["BlockStored", hashes, parent, tokens, bs, None, "GPU", None, *extra.values()]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": bs,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes: list[int], *, arrays: bool) -> Any:
    """A BlockRemoved event, array-like or a tagged map."""
    if arrays:
        return ["BlockRemoved", hashes, "GPU"]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def cleared(*, arrays: bool) -> Any:
    """An AllBlocksCleared event, array-like or a tagged map."""
    return ["AllBlocksCleared"] if arrays else {"type": "AllBlocksCleared"}


class Publisher:
    """Publishes batches of events; ``skip_live`` sends a batch to the replay buffer only (a
    message the subscriber never saw); ``buffer`` bounds the replay buffer. ``replays`` lists
    the first sequence number of each replay request answered."""

    def __init__(
        self,
        port: int = 0,
        replay_port: int = 0,
        *,
        buffer: int = 10_000,
        with_topic: bool = True,
        clock: float | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.port = self._bind(self.pub, port)
        self.replay_port = self._bind(self.router, replay_port)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.with_topic = with_topic
        self.seq = 0
        self.clock = time.time() if clock is None else clock
        self.lock = threading.Lock()
        self.replays: list[int] = []
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket[Any], port: int) -> int:
        if port:
            for _ in range(50):  # the previous owner of the port may take a moment to let go
                try:
                    sock.bind(f"tcp://127.0.0.1:{port}")
                    return port
                except zmq.ZMQError:
                    time.sleep(0.1)
            raise RuntimeError(f"port {port} stays busy")
        return sock.bind_to_random_port("tcp://127.0.0.1")

    def meta(self) -> dict[str, Any]:
        return {"kv_events": self.endpoint, "kv_events_replay": self.replay_endpoint}

    def publish(
        self, events: list[Any], *, skip_live: bool = False, ts: float | None = None
    ) -> int:
        """Publish one batch; returns its sequence number. Its time is ``ts`` (e.g. the wall
        clock when it is sent, as an engine stamps it) or else 1 ms after the last batch's."""
        self.clock = self.clock + 0.001 if ts is None else ts
        payload = msgspec.msgpack.encode([self.clock, events, 0])
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if not skip_live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def _serve(self) -> None:
        while self.running:
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self.lock:
                todo = [(s, p) for s, p in self.buffer if s >= first]
                self.replays.append(first)
            for s, p in todo:
                topic = [b""] if self.with_topic else []
                self.router.send_multipart([client, b"", *topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", *([b""] if self.with_topic else []), END, b""])

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()
