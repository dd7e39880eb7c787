"""Exceptions raised by redis-router. Every one derives from :class:`RedisRouterError`."""

from __future__ import annotations


class RedisRouterError(Exception):
    """Base class of every error this library raises on purpose."""


class NoServersAvailable(RedisRouterError, RuntimeError):
    """No replica can take the request: the pool is empty or every replica is draining.

    A ``RuntimeError``, as verl's balancer raises, so callers written for verl keep working.
    """


class NoCapacity(NoServersAvailable):
    """Every replica that could take the request is full (its declared capacity reached) or
    ejected, or earlier requests are waiting for a place and go first; raised at once, or
    when an acquire's wait ran out. A NoServersAvailable, so callers that handle an empty
    pool handle this too."""


class ReplicaEjected(NoCapacity):
    """A sticky session's replica is ejected and the balancer's ``ejected_sticky="wait"``
    keeps the session there: raised at once, or when the acquire's wait ran out before the
    ejection ended. ``server_id`` is the replica, ``seconds_left`` how long its ejection
    still lasts."""

    def __init__(self, message: str, server_id: str = "", seconds_left: float = 0.0) -> None:
        super().__init__(message)
        self.server_id, self.seconds_left = server_id, seconds_left


class RedisUnavailable(RedisRouterError, ConnectionError):
    """Redis could not be reached or answered too late. The message names the URL, never its
    password. Calls fail fast with this during an outage and work again once Redis is back."""


class RedisConfigError(RedisRouterError):
    """Redis refused this process's connection settings, or the URL names no host that
    exists: a configuration error, which retrying cannot mend. Not a RedisUnavailable, so
    callers that ride out an outage by retrying fail at once on this instead. The message
    says what was refused and what to check, never the password."""


class CredentialsRefused(RedisConfigError):
    """Redis refused the URL's user name or password (a wrong password, an unknown or
    disabled ACL user), or requires a password that the URL does not give."""


class UnknownRedisHost(RedisConfigError):
    """The URL's host name does not resolve (no such host in DNS)."""


class BalancerClosed(RedisRouterError):
    """The balancer was closed: its leases were ended and nothing keeps new ones alive, so
    it routes nothing more. Create a new balancer."""


class RedisOutOfMemory(RedisUnavailable):
    """Redis refused a write because it is out of memory (``used_memory`` above ``maxmemory``
    with ``maxmemory-policy noeviction``); the script that was refused wrote nothing, so a
    call may simply be retried once memory is freed. A RedisUnavailable, so callers that ride
    out an outage ride this out too. The message says what to do; ``reply`` is Redis's own."""

    def __init__(self, message: str, reply: str = "") -> None:
        super().__init__(message)
        self.reply = reply


class ConfigMismatch(RedisRouterError, ValueError):
    """This process's settings disagree with the ones pinned in Redis by the balancer's first
    process (all processes of one balancer must share them)."""


class RouterConfigError(RedisRouterError, ValueError):
    """A router could not be loaded: a missing or malformed config file, a missing
    ``router_class``, a module or class that cannot be found, or a class that does not
    implement :class:`~redis_router.RequestLoadBalancer`. The message names what was wrong and
    what to fix."""


class PoolExhausted(RedisRouterError):
    """Every connection of the balancer's pool stayed busy for the whole wait: the process
    makes more concurrent calls than its pool holds (or a stalled Redis keeps them busy).
    Not a RedisUnavailable: Redis may be healthy, and retrying as in an outage only adds
    load. The message names the pool's size and how to raise it (``max_connections``);
    ``max_connections`` is that size."""

    def __init__(self, message: str, max_connections: int = 0) -> None:
        super().__init__(message)
        self.max_connections = max_connections
