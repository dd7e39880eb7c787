"""redis-router: one global load balancer for LLM inference replicas, shared through Redis."""

from .aio import AsyncLease, AsyncRedisLoadBalancer
from .balancer import Lease, RedisLoadBalancer
from .client import RouterClient
from .errors import (
    ConfigMismatch,
    NoCapacity,
    NoServersAvailable,
    RedisOutOfMemory,
    RedisRouterError,
    RedisUnavailable,
    ReplicaEjected,
    RouterConfigError,
)
from .loader import get_router_handle
from .protocol import AsyncRequestLoadBalancer, RequestLoadBalancer
from .verl import VerlRouter

__all__ = [
    "AsyncLease",
    "AsyncRedisLoadBalancer",
    "AsyncRequestLoadBalancer",
    "ConfigMismatch",
    "Lease",
    "NoCapacity",
    "NoServersAvailable",
    "RedisLoadBalancer",
    "RedisOutOfMemory",
    "RedisRouterError",
    "RedisUnavailable",
    "ReplicaEjected",
    "RequestLoadBalancer",
    "RouterClient",
    "RouterConfigError",
    "VerlRouter",
    "get_router_handle",
]
__version__ = "0.1.0"
