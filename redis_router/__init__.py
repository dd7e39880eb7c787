"""redis-router: one global load balancer for LLM inference replicas, shared through Redis."""

from .aio import AsyncLease, AsyncRedisLoadBalancer, AsyncReleased
from .aio_sharded import AsyncShardedLoadBalancer
from .balancer import Lease, RedisLoadBalancer
from .client import RouterClient
from .engine import EngineLoad
from .errors import (
    BalancerClosed,
    ConfigMismatch,
    CredentialsRefused,
    NoCapacity,
    NoServersAvailable,
    PoolExhausted,
    RedisConfigError,
    RedisOutOfMemory,
    RedisRouterError,
    RedisUnavailable,
    ReplicaEjected,
    RouterConfigError,
    UnknownRedisHost,
)
from .loader import get_router_handle
from .options import Affinity, Ejection, Groups
from .outbox import Released
from .protocol import AsyncRequestLoadBalancer, RequestLoadBalancer
from .scoring import EngineScoring
from .sharded import ShardedLoadBalancer
from .verl import VerlRouter

__all__ = [
    "Affinity",
    "AsyncLease",
    "AsyncRedisLoadBalancer",
    "AsyncReleased",
    "AsyncRequestLoadBalancer",
    "AsyncShardedLoadBalancer",
    "BalancerClosed",
    "ConfigMismatch",
    "CredentialsRefused",
    "Ejection",
    "EngineLoad",
    "EngineScoring",
    "Groups",
    "Lease",
    "NoCapacity",
    "NoServersAvailable",
    "PoolExhausted",
    "RedisConfigError",
    "RedisLoadBalancer",
    "RedisOutOfMemory",
    "RedisRouterError",
    "RedisUnavailable",
    "Released",
    "ReplicaEjected",
    "RequestLoadBalancer",
    "RouterClient",
    "RouterConfigError",
    "ShardedLoadBalancer",
    "UnknownRedisHost",
    "VerlRouter",
    "get_router_handle",
]
__version__ = "0.1.0"
