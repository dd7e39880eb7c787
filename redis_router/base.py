"""The one constructor of both balancers: options checked and made into a core
(:func:`~redis_router.core.build_core`), then handed to the flavour's own I/O (``_open``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import validation
from .core import BalancerCore, build_core
from .options import Affinity, Ejection, Groups
from .policy import LeastLoaded, RoutingPolicy
from .scoring import EngineScoring


class BalancerBase:
    """What :class:`~redis_router.RedisLoadBalancer` and
    :class:`~redis_router.AsyncRedisLoadBalancer` share before any I/O."""

    default_policy: type[RoutingPolicy] = LeastLoaded
    # Keywords the flavour's client takes (not options of the core or the policy).
    _client_options: tuple[str, ...] = ("max_connections",)
    _core: BalancerCore
    url: str  # the Redis URL, credentials hidden

    def __init__(
        self,
        servers: Mapping[str, Any] | None = None,
        *,
        redis: Any = None,
        name: str = "default",
        policy: RoutingPolicy | type[RoutingPolicy] | str | None = None,
        lease_ttl: float = 20.0,
        sticky_ttl: float = 3600.0,
        wait_timeout: float = 0.0,
        affinity: Affinity | Mapping[str, Any] | None = None,
        groups: Groups | Mapping[str, Any] | None = None,
        ejection: Ejection | Mapping[str, Any] | None = None,
        engine_scoring: EngineScoring | Mapping[str, Any] | bool | None = None,
        router_kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """A balancer named ``name`` on the Redis at ``redis`` (a URL, a redis-py client, or
        None for ``REDIS_URL`` / localhost), registering ``servers`` ({id: url or metadata})
        if given; every process with the same Redis and name shares it.

        - ``policy``: how new sessions are placed (:mod:`redis_router.policy`; default least
          loaded): an instance, a class or a registered name; its options as keywords.
        - ``lease_ttl`` (s): a silent process's leases are reclaimed this long after its last
          heartbeat. ``sticky_ttl`` (s): how long a session's replica is remembered after
          its last turn. ``wait_timeout`` (s): how long an acquire waits for a place in a
          full pool by default (0: NoCapacity at once).
        - ``affinity`` (:class:`~redis_router.options.Affinity`), ``groups``
          (:class:`~redis_router.options.Groups`), ``ejection``
          (:class:`~redis_router.options.Ejection`), ``engine_scoring``
          (:class:`~redis_router.scoring.EngineScoring`): option groups, as objects or
          mappings of their fields; off by default.
        - ``router_kwargs``: further options as one mapping (a YAML router config's).

        Further keywords: ``max_connections`` (default 100: the pool of the client made from
        the URL; a call finding every connection busy waits for one, then raises
        PoolExhausted), ``max_lease_age`` (s, default one day: a lease its process forgot is
        ended), ``full_determinism`` (a session's replica a function of its id alone; the
        affinity and group options off), ``rng`` (a random.Random for tie-breaks), the
        option groups' fields by their flat names (``eject_after=3``, ``affinity_margin=2``,
        ``spread_sessions=True``..., as YAML configs and CLI flags give them), the asyncio
        balancer's ``coalesce``, and the policy's own options. Bad values raise TypeError
        or ValueError naming the option, before anything is written."""
        client = {k: options.pop(k) for k in self._client_options if k in options}
        self._core, redis = build_core(
            self.default_policy,
            router_kwargs,
            options,
            self._client_options,
            redis=redis,
            name=name,
            policy=policy,
            lease_ttl=lease_ttl,
            sticky_ttl=sticky_ttl,
            wait_timeout=wait_timeout,
            affinity=affinity,
            groups=groups,
            ejection=ejection,
            engine_scoring=engine_scoring,
        )
        self._open(
            validation.servers_mapping(servers) if servers is not None else {}, redis, **client
        )

    def _open(self, servers: dict[str, Any], redis: Any, **client: Any) -> None:
        """Make the flavour's client and I/O; register ``servers`` (checked) if any."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def policy(self) -> RoutingPolicy:
        """How new sessions are placed."""
        return self._core.policy

    def require_acquire_fields(self) -> list[str]:
        """The request fields the policy reads at acquire ([] by default)."""
        return list(self._core.acquire_fields)

    def require_release_fields(self) -> list[str]:
        """The request fields the policy reads at release ([] by default)."""
        return list(self._core.policy.release_fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, redis={self.url!r})"
