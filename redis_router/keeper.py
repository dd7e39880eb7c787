"""Keep a balancer's leases alive from the background, one heartbeat per period for all.

A lease lives as long as its holder (one balancer instance in one process) keeps sending
heartbeats, however long its request runs; when the process dies, the heartbeats stop and any
process reclaims its leases once lease_ttl has passed (Redisson's lock watchdog, etcd's lease
keep-alive and ZooKeeper's ephemeral nodes work the same way). The sync balancer beats from a
daemon thread, the asyncio one from a task on its event loop; both start with the first
acquire, so a balancer that only reads never writes. A forked child takes a holder of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .core import HEARTBEATS_PER_TTL, BalancerCore, Heartbeat
from .errors import RedisRouterError

log = logging.getLogger("redis_router")

# Every balancer of this process, so that a forked child can give each a holder of its own.
_instances: weakref.WeakSet[Any] = weakref.WeakSet()


def track(balancer: Any) -> None:
    """Register a balancer with a ``_forked()`` method to call in a forked child."""
    _instances.add(balancer)


def _after_fork_in_child() -> None:
    for balancer in list(_instances):
        balancer._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def report(core: BalancerCore, beat: Heartbeat) -> None:
    """Log what a heartbeat found that the process should know about."""
    if beat.registered_anew:
        log.warning(
            "balancer %r: this process's holder %s had been declared dead (no heartbeat for "
            "lease_ttl=%gs: Redis unreachable, the process paused, or Redis lost its keys); "
            "its leases were reclaimed and their releases will return False",
            core.name,
            core.holder,
            core.lease_ttl,
        )
    if beat.overdue:
        log.warning(
            "balancer %r: ended %d lease(s) held longer than max_lease_age=%gs and never "
            "released (tokens %s)",
            core.name,
            len(beat.overdue),
            core.max_lease_age,
            ", ".join(beat.overdue[:8]),
        )


class ThreadKeeper:
    """Calls ``beat()`` every ``period`` seconds from a daemon thread until stopped. ``beat``
    reaches the balancer through a weak reference, so a forgotten balancer is not kept
    alive by its keeper."""

    def __init__(self, beat: Callable[[], bool], period: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(beat, period), name="redis-router-keeper", daemon=True
        )
        self._thread.start()

    def _loop(self, beat: Callable[[], bool], period: float) -> None:
        while not self._stop.wait(period):
            try:
                if not beat():
                    return
            except Exception:  # a keeper that stopped would let this process's leases lapse
                log.exception("redis-router keeper: a heartbeat failed unexpectedly; retrying")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


# maxmemory-policy values under which Redis may evict any key, a balancer's counts and
# lease records included (volatile-* evict only keys with an expiry: sticky buckets and wake
# keys, whose loss costs locality, never a count).
EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


def memory_policy(info: Any) -> str | None:
    """The maxmemory-policy from an INFO memory reply (a Cluster client's: any node's)."""
    if not isinstance(info, dict):
        return None
    policy = info.get("maxmemory_policy")
    if policy is None:
        for value in info.values():  # RedisCluster.info(): node -> its reply
            if isinstance(value, dict) and "maxmemory_policy" in value:
                policy = value["maxmemory_policy"]
                break
    return None if policy is None else str(policy)


def warn_if_evicting(core: BalancerCore, policy: str | None) -> None:
    """Say loudly, once per balancer, that an evicting policy can corrupt counts."""
    if policy in EVICTING:
        log.error(
            "balancer %r: Redis runs with maxmemory-policy %s, which may evict the balancer's "
            "lease records and counts when memory runs out (counts that no lease backs, or "
            "leases counted nowhere). Set `CONFIG SET maxmemory-policy noeviction` (or "
            "volatile-lru), or give the balancer a Redis of its own; keepers repair the "
            "counts they can (heal), but a lost lease record cannot be recovered",
            core.name,
            policy,
        )


class Failures:
    """A keeper's streak of failed beats: the first is logged in full, the rest as one line
    each at debug level, and the recovery once, so an outage (or an out-of-memory spell)
    does not fill the log with a traceback per beat."""

    def __init__(self) -> None:
        self.streak = 0

    def failed(self, core: BalancerCore, exc: BaseException, expected: bool) -> None:
        self.streak += 1
        if self.streak > 1:
            log.debug(
                "balancer %r: heartbeat failed again (%d in a row): %s", core.name, self.streak, exc
            )
        elif expected:  # Redis unreachable, refusing writes, settings changed
            log.warning(
                "balancer %r: heartbeat failed: %s (retrying every %gs; logged once "
                "until it succeeds)",
                core.name,
                exc,
                core.heartbeat_every,
            )
        else:  # a keeper that stopped would let this process's leases lapse
            log.exception(
                "balancer %r: a heartbeat failed unexpectedly; retrying every %gs "
                "(logged once until it succeeds)",
                core.name,
                core.heartbeat_every,
            )

    def succeeded(self, core: BalancerCore) -> None:
        if self.streak:
            log.warning(
                "balancer %r: heartbeats reach Redis again after %d failed", core.name, self.streak
            )
            self.streak = 0


def _failures(lb: Any) -> Failures:
    failures: Failures | None = getattr(lb, "_beat_failures", None)
    if failures is None:
        failures = lb._beat_failures = Failures()
    return failures


def report_close_failed(core: BalancerCore, exc: BaseException) -> None:
    """close() could not end the leases (Redis unreachable, or refusing writes): they go once
    the holder's deadline passes, as a dead process's."""
    log.warning(
        "balancer %r: close() could not end this process's leases now (%s); they are reclaimed "
        "within lease_ttl=%gs",
        core.name,
        type(exc).__name__,
        core.lease_ttl,
    )


def report_healed(core: BalancerCore, healed: tuple[int, int]) -> None:
    dropped, fixed = healed
    if dropped or fixed:
        log.error(
            "balancer %r: repaired %d count(s) and dropped %d lease entr(ies) with no lease "
            "record: Redis lost some of the balancer's keys (an evicting maxmemory-policy, or "
            "keys deleted by hand)",
            core.name,
            fixed,
            dropped,
        )


def beat_sync(ref: weakref.ref[Any]) -> bool:
    """One heartbeat of a sync balancer; False when the balancer is gone."""
    lb = ref()
    if lb is None:
        return False
    failures = _failures(lb)
    try:
        if not getattr(lb, "_policy_checked", False):
            lb._policy_checked = True
            try:
                warn_if_evicting(lb._core, memory_policy(lb._client.info("memory")))
            except Exception:  # INFO refused (ACL) or unreachable: the check is advisory
                log.debug("balancer %r: could not read maxmemory-policy", lb._core.name)
        report(lb._core, lb._run(lb._core.heartbeat()))
        if _reconcile_due(lb):
            report_reconciled(lb._core, lb._run(lb._core.reconcile()))
            report_healed(lb._core, lb._run(lb._core.heal()))
        failures.succeeded(lb._core)
    except RedisRouterError as exc:  # Redis unreachable, settings changed: try next period
        failures.failed(lb._core, exc, True)
    except Exception as exc:
        failures.failed(lb._core, exc, False)
    return True


async def keep_alive_async(ref: weakref.ref[Any], period: float) -> None:
    """The asyncio keeper: a task that beats every ``period`` seconds while it is its
    balancer's keeper. It checks that after every call instead of relying on cancellation
    alone: before Python 3.12, ``asyncio.wait_for`` (redis-py sends every command through it)
    loses a cancel that arrives as the send completes, and a keeper that outlived ``close()``
    would register the retired holder again and keep its leases from being reclaimed."""
    me = asyncio.current_task()
    while True:
        await asyncio.sleep(period)
        lb = ref()
        if lb is None or lb._keeper is not me:
            return
        failures = _failures(lb)
        try:
            if not getattr(lb, "_policy_checked", False):
                lb._policy_checked = True
                try:
                    warn_if_evicting(lb._core, memory_policy(await lb._client.info("memory")))
                except Exception:  # INFO refused (ACL) or unreachable: the check is advisory
                    log.debug("balancer %r: could not read maxmemory-policy", lb._core.name)
            report(lb._core, await lb._run(lb._core.heartbeat()))
            if lb._keeper is not me:
                return
            if _reconcile_due(lb):
                report_reconciled(lb._core, await lb._run(lb._core.reconcile()))
                report_healed(lb._core, await lb._run(lb._core.heal()))
            failures.succeeded(lb._core)
        except RedisRouterError as exc:  # Redis unreachable, settings changed: next period
            failures.failed(lb._core, exc, True)
        except Exception as exc:  # a keeper that stopped would let this process's leases lapse
            failures.failed(lb._core, exc, False)
        finally:
            del lb  # hold no reference while sleeping


def _reconcile_due(lb: Any) -> bool:
    """Every HEARTBEATS_PER_TTL-th heartbeat (once per lease_ttl) compares the leases."""
    lb._beats = getattr(lb, "_beats", 0) + 1
    return bool(lb._beats % HEARTBEATS_PER_TTL == 0)


def report_reconciled(core: BalancerCore, ended: int) -> None:
    if ended:
        log.warning(
            "balancer %r: ended %d lease(s) Redis still counted for this process although it "
            "no longer held them (a release lost in a failover or an outage, or an acquire "
            "whose reply never arrived)",
            core.name,
            ended,
        )
