"""redis-router: one global load balancer for LLM inference replicas, shared through Redis."""

from .aio import AsyncLease, AsyncRedisLoadBalancer
from .balancer import Lease, RedisLoadBalancer
from .errors import ConfigMismatch, NoServersAvailable, RedisRouterError, RedisUnavailable

__all__ = [
    "AsyncLease",
    "AsyncRedisLoadBalancer",
    "ConfigMismatch",
    "Lease",
    "NoServersAvailable",
    "RedisLoadBalancer",
    "RedisRouterError",
    "RedisUnavailable",
]
__version__ = "0.1.0"
