"""Target 8: the exact KV-block index lags the replicas' events by at most 50 ms (p99) at
10,000 events/s from 8 replicas.

Eight replicas (:mod:`benchmarks.kv_engine`: a process of publishers in the wire format vLLM
and SGLang use, one batch per scheduler step every 10-20 ms, an engine's mix of stores and
evictions) publish for a warm-up and a measured window; ``KVEventSubscriber`` runs in its own
process(es), as ``redis-router kv-events`` does. A reader thread here polls the index's
applied sequence numbers (``HGETALL kv:stream``, one field per stream) about every
millisecond; a batch's lag is the end of the first poll that shows its stream at or past its
number, minus the wall-clock time the publisher stamped on it just before sending (one machine,
one clock). Each event counts with its batch's lag. Context rows: 2 subscribers, 1,000 events/s,
and the same 10,000 events/s from 64 replicas (8x the batches, each smaller).

Measurement error: the reader sees a batch at most one poll period plus one round trip after
it became visible, and never before, so every lag is overstated by 0 to that much (reported as
``poll_period_s`` in the extra fields; ~1.3 ms here). The reader's polls are in
``redis_cpu_per_event_s`` (INFO cpu) and given apart as ``reader_cpu_per_event_s`` (INFO
commandstats of HGETALL), as the scripts' time is as ``script_cpu_per_event_s`` (of EVALSHA).
"""

from __future__ import annotations

import bisect
import multiprocessing
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from redis_router import RedisLoadBalancer
from redis_router.kv_events import index_states

from . import kv_engine
from .harness import Row, Sizes

REPLICAS = 8
RATE = 10_000.0  # events per second, all replicas together
LIGHT_RATE = 1_000.0
MANY_REPLICAS = 64  # the same events from 8x the streams: 8x the batches, each smaller
TARGET = 0.050
POLL = 0.001  # s the reader sleeps between polls


def _subscribe(url: str, name: str, stop: Any) -> None:
    """A subscriber process: follow the pool until ``stop`` is set."""
    from redis_router.kv_events import KVEventSubscriber

    sub = KVEventSubscriber(url, name).start()
    stop.wait()
    sub.close()


class Reader(threading.Thread):
    """Polls every stream's applied sequence number; keeps (seq, time seen) per change."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.key = f"rr:{{{name}}}:kv:stream"
        self.seen: dict[str, list[tuple[int, float]]] = {}
        self.polls = 0
        self.stop = threading.Event()

    def run(self) -> None:
        last: dict[str, int] = {}
        while not self.stop.is_set():
            raw = self.client.hgetall(self.key)
            t = time.time()
            self.polls += 1
            for key, value in raw.items():
                stream, seq = str(key), int(str(value).split(" ", 1)[0])
                if seq != last.get(stream):
                    last[stream] = seq
                    self.seen.setdefault(stream, []).append((seq, t))
            time.sleep(POLL)

    def applied(self, stream: str) -> int:
        got = self.seen.get(stream)
        return got[-1][0] if got else -1

    def seen_at(self, stream: str, seq: int) -> float | None:
        """When the reader first saw ``stream`` at or past ``seq`` (None: never)."""
        got = self.seen.get(stream, [])
        k = bisect.bisect_left(got, (seq, 0.0))
        return got[k][1] if k < len(got) else None


@dataclass
class Lag:
    """One configuration's measurement."""

    rate: float
    subscribers: int
    lags: list[float] = field(default_factory=list)  # per event, s
    events: int = 0
    window: float = 0.0
    missing: int = 0  # events never seen applied
    redis_cpu: float = 0.0  # s, INFO cpu over the window
    script_cpu: float = 0.0  # s, EVALSHA usec over the window
    reader_cpu: float = 0.0  # s, the reader's HGETALL usec over the window
    poll_period: float = 0.0
    mix: dict[str, int] = field(default_factory=dict)
    worst: list[tuple[float, int, float]] = field(default_factory=list)  # (lag, replica, t)

    def pct(self, q: float) -> float:
        xs = sorted(self.lags)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def summary(self) -> dict[str, Any]:
        return {
            "rate_asked": self.rate,
            "subscribers": self.subscribers,
            "events_per_s": round(self.events / self.window, 1),
            "p50_s": round(self.pct(0.50), 5),
            "p99_s": round(self.pct(0.99), 5),
            "max_s": round(max(self.lags), 5),
            "mean_s": round(statistics.fmean(self.lags), 5),
            "missing_events": self.missing,
            "redis_cpu_per_event_s": self.redis_cpu / max(1, self.events),
            "script_cpu_per_event_s": self.script_cpu / max(1, self.events),
            "reader_cpu_per_event_s": self.reader_cpu / max(1, self.events),
            "poll_period_s": round(self.poll_period, 5),
            "mix": self.mix,
            "worst_batches": [
                {"lag_s": round(lag, 4), "replica": i, "at_s": round(t, 3)}
                for lag, i, t in sorted(self.worst, reverse=True)[:5]
            ],
        }


def _cpu(client: redis.Redis) -> tuple[float, float, float]:
    """(Redis process CPU, EVALSHA server time, HGETALL server time) so far, in s."""
    cpu = client.info("cpu")
    stats = client.info("commandstats")
    verbs = ("evalsha", "fcall", "fcall_ro", "eval")
    scripts = sum(stats.get(f"cmdstat_{v}", {}).get("usec", 0) for v in verbs) / 1e6
    polls = stats.get("cmdstat_hgetall", {}).get("usec", 0) / 1e6
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"], scripts, polls


def _recv(conn: Any, proc: Any, timeout: float) -> Any:
    """The publisher process's next message; RuntimeError if it died or stays silent."""
    end = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive() or time.monotonic() > end:
            raise RuntimeError(f"the publisher process did not answer (exit {proc.exitcode})")
    return conn.recv()


def _wait_exact(client: redis.Redis, name: str, metas: dict[str, Any], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = index_states(client, name, metas)
        if all(s["state"] == "exact" for s in states.values()):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the index of {name} did not become exact: {states}")


def measure(
    url: str, name: str, rate: float, subscribers: int, sizes: Sizes, replicas: int = REPLICAS
) -> Lag:
    """``replicas`` publish at ``rate`` in all for the warm-up and window of ``sizes``; the lags
    of the window's events."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    pubs = ctx.Process(target=kv_engine.serve, args=(there, replicas, rate, 7), daemon=True)
    pubs.start()
    stop = ctx.Event()
    subs: list[Any] = []
    client = redis.Redis.from_url(url, decode_responses=True)
    reader = Reader(url, name)
    out = Lag(rate, subscribers)
    try:
        metas = {f"r{i}": m for i, m in enumerate(_recv(here, pubs, 60))}
        RedisLoadBalancer(metas, redis=url, name=name).close()
        for _ in range(subscribers):
            subs.append(ctx.Process(target=_subscribe, args=(url, name, stop), daemon=True))
            subs[-1].start()
        _wait_exact(client, name, metas, 60)
        reader.start()
        start = time.time() + 0.3
        here.send((start, sizes.kv_warmup + sizes.kv_seconds))
        lo, hi = start + sizes.kv_warmup, start + sizes.kv_warmup + sizes.kv_seconds
        time.sleep(max(0.0, lo - time.time()))
        cpu0, script0, poll0 = _cpu(client)
        polls0, t0 = reader.polls, time.time()
        time.sleep(max(0.0, hi - time.time()))
        cpu1, script1, poll1 = _cpu(client)
        out.poll_period = (time.time() - t0) / max(1, reader.polls - polls0)
        sent, out.mix = _recv(here, pubs, 60)
        end = time.monotonic() + 30
        while (
            time.monotonic() < end
            and all(p.is_alive() for p in subs)
            and any(b and reader.applied(f"0:r{i}") < b[-1][0] for i, b in enumerate(sent))
        ):
            time.sleep(0.01)
        reader.stop.set()
        reader.join()
        here.send("done")
        out.redis_cpu, out.script_cpu, out.window = cpu1 - cpu0, script1 - script0, hi - lo
        out.reader_cpu = poll1 - poll0
        for i, batches in enumerate(sent):
            for seq, ts, n in batches:
                if not lo <= ts < hi:
                    continue
                out.events += n
                seen = reader.seen_at(f"0:r{i}", seq)
                if seen is None:
                    out.missing += n
                else:
                    out.lags += [seen - ts] * n
                    out.worst.append((seen - ts, i, ts - lo))
    finally:
        reader.stop.set()
        stop.set()
        for p in [*subs, pubs]:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
        client.delete(*client.keys(f"rr:{{{name}}}:*") or ["-"])
        client.close()
        reader.client.close()
    return out


def _note(m: Lag) -> str:
    s = m.summary()
    return (
        f"p50 {s['p50_s'] * 1e3:.1f} ms, max {s['max_s'] * 1e3:.1f} ms; "
        f"{s['events_per_s']:,.0f} events/s achieved; Redis CPU "
        f"{s['redis_cpu_per_event_s'] * 1e6:.1f} us/event "
        f"(scripts {s['script_cpu_per_event_s'] * 1e6:.1f} us)"
    )


def run(url: str, sizes: Sizes) -> list[Row]:
    one = measure(url, "bench-kv-lag-1", RATE, 1, sizes)
    two = measure(url, "bench-kv-lag-2", RATE, 2, sizes)
    light = measure(url, "bench-kv-lag-light", LIGHT_RATE, 1, sizes)
    many = measure(url, "bench-kv-lag-many", RATE, 1, sizes, replicas=MANY_REPLICAS)
    p99 = one.pct(0.99)
    return [
        Row(
            "kv_lag_p99",
            "(8) KV index lag p99, 10,000 events/s, 8 replicas, 1 subscriber",
            p99,
            "s",
            target=("<=", TARGET),
            note=_note(one),
            extra=one.summary(),
        ),
        Row(
            "kv_lag_p99_2_subscribers",
            "    the same with 2 subscribers (each batch sent twice)",
            two.pct(0.99),
            "s",
            "1 subscriber",
            p99,
            two.pct(0.99) / p99,
            note="  " + _note(two),
            extra=two.summary(),
        ),
        Row(
            "kv_lag_p99_vs_light_load",
            "    p99 at 10,000 events/s vs at 1,000 events/s",
            p99,
            "s",
            "1,000 events/s",
            light.pct(0.99),
            p99 / light.pct(0.99),
            note="  " + _note(light),
            extra=light.summary(),
        ),
        Row(
            "kv_lag_p99_64_replicas",
            "    the same events from 64 replicas (8x the batches)",
            many.pct(0.99),
            "s",
            "8 replicas",
            p99,
            many.pct(0.99) / p99,
            note="  " + _note(many),
            extra=many.summary(),
        ),
        Row(
            "kv_redis_cpu_per_event",
            "    Redis CPU per event (INFO cpu), 1 subscriber",
            one.redis_cpu / max(1, one.events),
            "s",
            extra={"script_cpu_per_event_s": one.script_cpu / max(1, one.events)},
        ),
    ]
