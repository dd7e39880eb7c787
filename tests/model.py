"""A small pure-Python model of the balancer's semantics, for the model-based fuzz tests.

It knows the pool (replica -> draining), the live leases (token -> replica, request, holder,
weight, when it was acquired), the sticky map (request -> replica; sticky_ttl is long in the
fuzz tests, so entries only go by clear_sticky), the reclaimed counters, and for the
prefix-cache router the prefix index (block hash -> replicas it was sent to). Leases do not
expire by time: a lease ends when it is released, when its replica is removed, or when its
holder is dead and someone reclaims it (``reclaim``).

Health and admission: replicas may declare a capacity, and failed releases eject a replica
(``EJECT_AFTER`` in a row, at most ``MAX_EJECTED`` of the pool; ejections outlast the run). A
replica is "off" (takes no acquire, new or sticky) while it is ejected or holds its capacity;
least loaded then compares count / capacity (an undeclared one as the largest declared).

Where the real balancer breaks ties at random, the model returns the set of allowed answers
instead of one answer. Leases in ``limbo`` (a dead holder's, which any call may be reclaiming
concurrently) count as "maybe there": the allowed sets then hold every replica that could be
the answer for some subset of them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from fractions import Fraction

ROUTERS = ("core", "least_tokens", "prefix_cache")


@dataclass
class ModelLease:
    server_id: str
    request_id: str
    holder: str
    acquired_from: float  # monotonic time before the call that took it
    acquired_by: float  # ... and after it
    weight: int = 0  # prompt tokens (least_tokens)


@dataclass(frozen=True)
class Prompt:
    """What a router reads of a request's prompt: its length (least_tokens) and its prefix
    hashes at the sampled depths with the 1-based index of the first deep enough to count
    (prefix_cache). ``hashes`` is empty for no prompt or one shorter than a block."""

    weight: int = 0
    hashes: tuple[str, ...] = ()
    first: int = 1


NO_PROMPT = Prompt()


@dataclass(frozen=True)
class PrefixPolicy:
    """prefix_cache's load-balance thresholds (the index's bounds are never reached here)."""

    balance_abs: float
    balance_rel: float
    record: bool = True


FAR = 4  # prefix_cache.lua: a replica this many times balance_abs over the least is hot
WHOLE = 2  # ... and for a request whose whole prompt it holds, this many times (no median test)
EJECT_AFTER = 2  # failures in a row that eject a replica (the fuzz balancers' eject_after)
MAX_EJECTED = 0.5


class NoServers(Exception):
    """The model's NoServersAvailable; ``capacity``: its NoCapacity."""

    def __init__(self, capacity: bool = False) -> None:
        super().__init__(capacity)
        self.capacity = capacity


@dataclass
class Model:
    router: str = "core"
    prefix: PrefixPolicy | None = None
    servers: dict[str, bool] = field(default_factory=dict)  # id -> draining
    leases: dict[str, ModelLease] = field(default_factory=dict)  # in grant order
    sticky: dict[str, str] = field(default_factory=dict)
    limbo: set[str] = field(default_factory=set)  # tokens that may be reclaimed any moment
    reclaimed: dict[str, int] = field(default_factory=dict)  # replica -> counter
    index: dict[str, set[str]] = field(default_factory=dict)  # prefix hash -> replicas
    capacity: dict[str, int] = field(default_factory=dict)  # replica -> declared capacity
    ejected: set[str] = field(default_factory=set)
    fails: dict[str, int] = field(default_factory=dict)  # replica -> failures in a row
    # holder -> tokens of other holders' leases it was granted by a retry (acquire with that
    # token): its client holds them too, so its hint may name them
    retried: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.router in ROUTERS, self.router

    def copy(self) -> Model:
        return copy.deepcopy(self)

    # -- derived state ---------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(self.servers, 0)
        for lease in self.leases.values():
            out[lease.server_id] += 1
        return out

    def weights(self) -> dict[str, int]:
        out = dict.fromkeys(self.servers, 0)
        for lease in self.leases.values():
            out[lease.server_id] += lease.weight
        return out

    def _bounds(self, weighted: bool) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica, the lowest and highest count (or weight) the real balancer may see:
        leases in limbo may already be gone."""
        hi = self.weights() if weighted else self.counts()
        lo = dict(hi)
        for token in self.limbo:
            lease = self.leases[token]
            lo[lease.server_id] -= lease.weight if weighted else 1
        return lo, hi

    def off(self, sid: str) -> bool:
        """Full or ejected: takes no acquire (counts are exact whenever capacities exist)."""
        cap = self.capacity.get(sid)
        return sid in self.ejected or (cap is not None and self.counts()[sid] >= cap)

    def in_pool(self, sid: str | None) -> bool:
        """In `load` or `draining`: where an acquire may count it."""
        return sid is not None and sid in self.servers and not self.off(sid)

    def taking(self) -> list[str]:
        return [s for s, draining in self.servers.items() if not draining and not self.off(s)]

    def refusal(self) -> NoServers:
        """NoCapacity while some replica is off, else NoServersAvailable."""
        return NoServers(any(self.off(s) for s in self.servers))

    def _relative_least(self, taking: list[str]) -> set[str]:
        """Least count / capacity, exactly (an undeclared capacity counts as the largest
        declared among the replicas taking new sessions)."""
        assert not self.limbo, "capacities are never combined with leases in limbo"
        counts = self.counts()
        top = max([1, *(self.capacity[s] for s in taking if s in self.capacity)])
        rel = {s: Fraction(counts[s], self.capacity.get(s, top)) for s in taking}
        best = min(rel.values())
        return {s for s in taking if rel[s] == best}

    def tokens_of(self, holder: str) -> list[str]:
        return [t for t, x in self.leases.items() if x.holder == holder]

    # -- acquire ---------------------------------------------------------------------------

    def destination(self, request_id: str, token: str, prompt: Prompt) -> tuple[set[str], int]:
        """(allowed replicas, how: 0 balanced / 1 sticky / 2 retry) for one request."""
        if token in self.leases:
            assert token not in self.limbo, "the fuzz tests never retry a token in limbo"
            return {self.leases[token].server_id}, 2
        sid = self.sticky.get(request_id)
        if self.in_pool(sid):
            assert sid is not None
            return {sid}, 1
        taking = self.taking()
        if not taking:
            raise self.refusal()
        if self.router == "least_tokens":
            return _least(taking, *self._bounds(True)), 0
        lo, hi = self._bounds(False)
        # least_loaded (the core's, and prefix_cache's fallback) is relative to capacity.
        least = self._relative_least(taking) if self.capacity else _least(taking, lo, hi)
        if self.router == "core" or not prompt.hashes:
            return least, 0
        found = self._prefix_holders(prompt, set(taking))
        if found is None:
            return least, 0
        holders, whole = found
        allowed: set[str] = set()
        for h in _least(sorted(holders), lo, hi):
            hot = self._hot(taking, lo, hi, h, whole)
            if True in hot:
                allowed |= least
            if False in hot:
                allowed.add(h)
        return allowed, 0

    def _prefix_holders(self, prompt: Prompt, taking: set[str]) -> tuple[set[str], bool] | None:
        """The replicas taking new sessions that received the deepest prefix of the prompt
        that any of them received, among the deepest hash and those from ``first`` on, and
        whether that prefix is the whole prompt (its deepest hash)."""
        n = len(prompt.hashes)
        for k in [n, *range(n - 1, prompt.first - 1, -1)]:
            got = self.index.get(prompt.hashes[k - 1], set()) & taking
            if got:
                return got, k == n
        return None

    def _hot(
        self, taking: list[str], lo: dict[str, int], hi: dict[str, int], h: str, whole: bool
    ) -> set[bool]:
        """Whether one more request would make holder ``h`` a hot spot (its count then exceeds
        the median count of the replicas taking new sessions by more than balance_abs and is
        more than balance_rel times it, or exceeds the least count by more than FAR times
        balance_abs and is more than balance_rel times it; for a request whose whole prompt
        ``h`` holds, only the latter, with WHOLE), for every count the replicas may have:
        {True}, {False} or both."""
        assert self.prefix is not None
        p = self.prefix
        if any(lo[s] != hi[s] for s in taking):
            return {True, False}  # counts not known exactly: either branch is allowed
        counts = sorted(hi[s] for s in taking)
        med, load, mn = counts[(len(counts) - 1) // 2], hi[h] + 1, counts[0]
        over_median = load - med > p.balance_abs and load > p.balance_rel * med
        far = WHOLE if whole else FAR
        over_least = load - mn > far * p.balance_abs and load > p.balance_rel * mn
        return {(over_median and not whole) or over_least}

    def check_batch(self, requests: list[tuple[str, str]]) -> None:
        """Raise NoServers if a batch is refused whole (before anything is written): with
        capacities, more of its requests are not granted yet than there are free places in
        the replicas taking new sessions (NoCapacity); or no replica takes new sessions and
        some request is neither a retry nor sticky to a replica in the pool."""
        if self.capacity and len(requests) > 1:
            fresh = sum(token not in self.leases for _, token in requests)
            counts = self.counts()
            taking = self.taking()
            if fresh and all(s in self.capacity for s in taking):
                room = sum(self.capacity[s] - counts[s] for s in taking)
                if room < fresh:
                    raise NoServers(True)
        if self.taking():
            return
        for rid, token in requests:
            self.destination(rid, token, NO_PROMPT)

    def grant(
        self,
        request_id: str,
        token: str,
        server_id: str,
        how: int,
        holder: str,
        t0: float,
        t1: float,
        prompt: Prompt = NO_PROMPT,
    ) -> None:
        """Record what the real balancer granted (after checking it was allowed)."""
        if how == 2:
            lease = self.leases.get(token)
            if lease is not None and lease.holder != holder:
                self.retried.setdefault(holder, set()).add(token)
            return
        weight = prompt.weight if self.router == "least_tokens" else 0
        self.leases[token] = ModelLease(server_id, request_id, holder, t0, t1, weight)
        self.sticky[request_id] = server_id
        if self.router == "prefix_cache" and self.prefix and self.prefix.record:
            for h in prompt.hashes:
                self.index.setdefault(h, set()).add(server_id)

    # -- release ---------------------------------------------------------------------------

    def release_token(self, token: str, succeeded: bool | None = True) -> bool:
        """A lease ends; ``succeeded``: its request's outcome (None: not a release, e.g. its
        replica was removed). A success ends its replica's failure streak; a failure counts
        toward ejecting it."""
        self.limbo.discard(token)
        lease = self.leases.pop(token, None)
        if lease is None:
            return False
        sid = lease.server_id
        if succeeded:
            self.fails.pop(sid, None)
        elif succeeded is False:
            self.fails[sid] = self.fails.get(sid, 0) + 1
            room = int(len(self.servers) * MAX_EJECTED + 1e-9)
            if (
                self.fails[sid] >= EJECT_AFTER
                and sid not in self.ejected
                and len(self.ejected) + 1 <= room
            ):
                self.ejected.add(sid)
                del self.fails[sid]
        return True

    def first_of_request(self, server_id: str, request_id: str) -> str | None:
        """The lease a release by request id ends: that request's oldest on that replica."""
        for token, lease in self.leases.items():
            if (lease.server_id, lease.request_id) == (server_id, request_id):
                return token
        return None

    def ended_by_request(self, server_id: str, request_id: str, mine: str | None) -> str | None:
        """The lease a release by request id ends when the releasing balancer names ``mine``
        (its last lease of that request there, its hint): that one while it lasts, else none
        (the request's other leases there are other processes' turns); without a hint (it
        never held the request there), the request's oldest there."""
        if mine is None:
            return self.first_of_request(server_id, request_id)
        lease = self.leases.get(mine)
        if lease is not None and (lease.server_id, lease.request_id) == (server_id, request_id):
            return mine
        return None

    def request_candidates(self, server_id: str, request_id: str, holder: str) -> set[str]:
        """The leases a release by request id from ``holder`` may end when its hint is not
        known: one of its own leases of that request there (including another holder's it
        was granted by a retry), or the request's oldest there."""
        mine = self.retried.get(holder, set())
        own = {
            t
            for t, lease in self.leases.items()
            if (lease.server_id, lease.request_id) == (server_id, request_id)
            and (lease.holder == holder or t in mine)
        }
        oldest = self.first_of_request(server_id, request_id)
        return own | ({oldest} if oldest else set())

    def release_request(self, server_id: str, request_id: str) -> bool:
        token = self.first_of_request(server_id, request_id)
        return token is not None and self.release_token(token)

    def server_candidates(self, server_id: str, holder: str) -> set[str]:
        """Tokens a release by replica only from ``holder`` may end: one of its own leases
        there (the client picks from its ledger), else the replica's oldest."""
        mine = self.retried.get(holder, set())
        own = {
            t
            for t, lease in self.leases.items()
            if lease.server_id == server_id and (lease.holder == holder or t in mine)
        }
        return own | self.oldest_candidates(server_id)

    def oldest_candidates(self, server_id: str) -> set[str]:
        """Tokens that may be the oldest lease on server_id (release by replica only): those
        that may have been acquired in the same Redis millisecond as the first one."""
        mine = {t: x for t, x in self.leases.items() if x.server_id == server_id}
        if not mine:
            return set()
        latest_first = min(x.acquired_by for x in mine.values()) + 0.002  # ms resolution
        return {t for t, x in mine.items() if x.acquired_from <= latest_first}

    # -- dead holders ----------------------------------------------------------------------

    def reclaim(self, token: str) -> None:
        """A dead holder's lease was reclaimed: gone, and counted on its replica."""
        lease = self.leases.pop(token)
        self.limbo.discard(token)
        self.reclaimed[lease.server_id] = self.reclaimed.get(lease.server_id, 0) + 1

    # -- the pool --------------------------------------------------------------------------

    def add(self, ids: list[str], capacity: int | None = None) -> int:
        """Register ids; each gets ``capacity`` (None: a declared one is lifted)."""
        new = [s for s in dict.fromkeys(ids) if s not in self.servers]
        for s in new:
            self.servers[s] = False
        for s in ids:
            if capacity is None:
                self.capacity.pop(s, None)
            else:
                self.capacity[s] = capacity
        return len(new)

    def remove(self, ids: list[str]) -> int:
        n = 0
        for s in ids:
            if s in self.servers:
                del self.servers[s]
                self.reclaimed.pop(s, None)
                n += 1
                for t in [t for t, x in self.leases.items() if x.server_id == s]:
                    self.release_token(t, None)
                self.capacity.pop(s, None)
                self.ejected.discard(s)
                self.fails.pop(s, None)
        return n

    def set_draining(self, ids: list[str], draining: bool) -> int:
        n = 0
        for s in ids:
            if s in self.servers and self.servers[s] != draining:
                self.servers[s] = draining
                n += 1
        return n

    def clear_sticky(self) -> dict[str, object]:
        """What clear_sticky_cache returns: every entry goes (those of removed replicas too,
        which stay until their session's next turn), and the load of every replica."""
        out = {"cleared_entries": len(self.sticky), "server_loads": self.counts()}
        self.sticky.clear()
        return out


def _least(candidates: list[str], lo: dict[str, int], hi: dict[str, int]) -> set[str]:
    """The candidates that may hold the minimum: exact ties when lo == hi."""
    ceiling = min(hi[s] for s in candidates)
    return {s for s in candidates if lo[s] <= ceiling}
