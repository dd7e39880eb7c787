"""A small pure-Python model of the balancer's semantics, for the model-based fuzz test.

It knows the pool (replica -> draining), the live leases (token -> replica, request, when its
expiry was last set) and the sticky map (request -> replica; sticky_ttl is long in the fuzz
test, so entries only go by clear_sticky). Where the real balancer breaks ties at random, the
model returns the set of allowed answers instead of one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelLease:
    server_id: str
    request_id: str
    set_from: float  # monotonic time before the call that set its expiry
    set_by: float  # ... and after it


class NoServers(Exception):
    """The model's NoServersAvailable."""


@dataclass
class Model:
    servers: dict[str, bool] = field(default_factory=dict)  # id -> draining
    leases: dict[str, ModelLease] = field(default_factory=dict)  # in grant order
    sticky: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(self.servers, 0)
        for lease in self.leases.values():
            out[lease.server_id] += 1
        return out

    # -- acquire ---------------------------------------------------------------------------

    def destination(
        self, request_id: str, token: str, counts: dict[str, int]
    ) -> tuple[set[str], int]:
        """(allowed replicas, how: 0 balanced / 1 sticky / 2 retry) for one request."""
        if token in self.leases:
            return {self.leases[token].server_id}, 2
        sid = self.sticky.get(request_id)
        if sid is not None and sid in self.servers:
            return {sid}, 1
        taking = [s for s, draining in self.servers.items() if not draining]
        if not taking:
            raise NoServers
        low = min(counts[s] for s in taking)
        return {s for s in taking if counts[s] == low}, 0

    def check_batch(self, requests: list[tuple[str, str]]) -> None:
        """Raise NoServers if the batch is refused (before anything is written)."""
        if any(not d for d in self.servers.values()):
            return
        for rid, token in requests:
            self.destination(rid, token, self.counts())

    def grant(
        self, request_id: str, token: str, server_id: str, how: int, t0: float, t1: float
    ) -> None:
        """Record what the real balancer granted (after checking it was allowed)."""
        if how == 2:
            return
        self.leases[token] = ModelLease(server_id, request_id, t0, t1)
        self.sticky[request_id] = server_id

    # -- release ---------------------------------------------------------------------------

    def release_token(self, token: str) -> bool:
        return self.leases.pop(token, None) is not None

    def release_request(self, server_id: str, request_id: str) -> bool:
        for token, lease in self.leases.items():
            if (lease.server_id, lease.request_id) == (server_id, request_id):
                del self.leases[token]
                return True
        return False

    def oldest_candidates(self, server_id: str) -> set[str]:
        """Tokens that may be the lease on server_id closest to expiry (release by server)."""
        mine = {t: x for t, x in self.leases.items() if x.server_id == server_id}
        if not mine:
            return set()
        latest_first = min(x.set_by for x in mine.values()) + 0.002  # ms resolution in Redis
        return {t for t, x in mine.items() if x.set_from <= latest_first}

    # -- the pool --------------------------------------------------------------------------

    def add(self, ids: list[str]) -> int:
        new = [s for s in dict.fromkeys(ids) if s not in self.servers]
        for s in new:
            self.servers[s] = False
        return len(new)

    def remove(self, ids: list[str]) -> int:
        n = 0
        for s in ids:
            if s in self.servers:
                del self.servers[s]
                n += 1
                for t in [t for t, x in self.leases.items() if x.server_id == s]:
                    del self.leases[t]
        return n

    def set_draining(self, ids: list[str], draining: bool) -> int:
        n = 0
        for s in ids:
            if s in self.servers and self.servers[s] != draining:
                self.servers[s] = draining
                n += 1
        return n
