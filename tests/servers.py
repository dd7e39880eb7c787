"""Redis Cluster and Sentinel topologies for the tests, built from the library's LocalServer.

Every node is a :class:`redis_router.local_server.LocalServer`: a free loopback port, its own temp
dir, and only processes started here are ever signalled. A cluster node also reserves its bus
port (port + 10000). Built without redis-cli, so any binary found works (Redis 6.2 to Valkey 8.1).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import redis
import redis.cluster
import redis.sentinel

from redis_router.local_server import HOST, LocalServer, ServerBinary, probe_client

CLUSTER_SLOTS = 16384
# Redis derives the cluster bus port as port + 10000; ``--cluster-port`` would avoid that but
# only exists from 7.0 on, so node ports must leave room for it.
CLUSTER_BUS_OFFSET = 10000


def _call(client: Any, *args: Any) -> Any:
    """A raw command (redis-py leaves execute_command untyped)."""
    return client.execute_command(*args)


def _as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _as_dict(reply: Any) -> dict[str, Any]:
    """Normalise a RESP2 flat list or RESP3 map into ``{str: value}``."""
    if isinstance(reply, Mapping):
        return {_as_text(k): v for k, v in reply.items()}
    items = list(reply)
    return {_as_text(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)}


def _wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float,
    interval: float = 0.1,
) -> None:
    """Poll ``check()`` until truthy; RuntimeError naming ``what`` on timeout.

    Connection errors count as "not yet" since nodes are still converging.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last!r})" if last is not None else ""
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def _close_all(servers: Sequence[LocalServer]) -> None:
    for server in servers:
        server.close()


class _ClusterNode(LocalServer):
    """A cluster-enabled server: its bus port (port + 10000) must be free as well.

    A node timeout of 2 s: a killed primary is flagged failing about 2-3 s after its death
    and its replica takes over within about a second more (election delay 0.5-1 s).
    """

    port_offsets = (CLUSTER_BUS_OFFSET,)

    def __init__(self, binary: ServerBinary, extra: Sequence[str] = ()) -> None:
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000",
            *extra,
        ]  # fmt: skip
        super().__init__(binary, args=args)


class ClusterNodeView:
    """One line of CLUSTER NODES, as one node sees another."""

    def __init__(self, line: str) -> None:
        parts = line.split()
        self.id = parts[0]
        address = parts[1].split(",", 1)[0].split("@", 1)[0]  # ip:port@cport[,hostname]
        self.host, port = address.rsplit(":", 1)
        self.port = int(port) if port.isdigit() else 0
        self.flags = set(parts[2].split(","))
        self.master_id = None if parts[3] == "-" else parts[3]
        self.link = parts[7] if len(parts) > 7 else ""
        self.slots: list[tuple[int, int]] = []
        for item in parts[8:]:
            if item.startswith("["):  # a slot being imported or migrated
                continue
            first, _, last = item.partition("-")
            self.slots.append((int(first), int(last or first)))

    @property
    def primary(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool({"fail", "fail?"} & self.flags)

    def __repr__(self) -> str:
        return f"<{self.port} {','.join(sorted(self.flags))} slots={self.slots}>"


class LocalCluster:
    """A real Redis Cluster of ``masters`` primaries, each with ``replicas`` replicas, from
    one binary.

    Built without redis-cli: slots are assigned per primary, config epochs set, then nodes
    MEET; each replica is then attached with CLUSTER REPLICATE. So it works on any binary we
    can find. ``nodes`` lists the primaries first (in :meth:`slot_ranges` order), then the
    replicas (primary i's j-th replica at ``masters + i * replicas + j``); after a failover
    a node's role is what :meth:`view` says, not its place in ``nodes``.

    ``require_full_coverage=False`` lets the primaries that still serve their slots answer
    while another primary is down and not yet replaced (Redis' default stops the whole
    cluster with CLUSTERDOWN from the moment a primary is flagged failing until its replica
    takes over).
    """

    def __init__(
        self,
        binary: ServerBinary,
        masters: int = 3,
        replicas: int = 0,
        *,
        require_full_coverage: bool = True,
    ) -> None:
        if masters < 1:
            raise ValueError("masters must be >= 1")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        self.binary = binary
        self.masters = masters
        self.replicas = replicas
        self.require_full_coverage = require_full_coverage
        self.nodes: list[_ClusterNode] = []
        self.node_ids: dict[int, str] = {}  # port -> cluster node id
        self._orphans: dict[int, list[_ClusterNode]] = {}  # killed primary's port -> replicas

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(node.host, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.startup_nodes)
        return f"redis+cluster://{hosts}"

    def slot_ranges(self) -> list[tuple[int, int]]:
        """Inclusive slot range owned by each primary at start, split as evenly as possible."""
        n = self.masters
        return [(i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1) for i in range(n)]

    def _node_args(self) -> list[str]:
        """Options beyond _ClusterNode's own: none for a cluster of primaries only."""
        args: list[str] = []
        if self.replicas:
            # 7.0+ delays a diskless full sync by 5 s by default; replicas attach at once.
            args += ["--repl-diskless-sync-delay", "0"]
        if not self.require_full_coverage:
            args += ["--cluster-require-full-coverage", "no"]
        return args

    def start(self, timeout: float = 30.0) -> LocalCluster:
        if self.nodes:
            return self
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                node = _ClusterNode(self.binary, self._node_args())
                self.nodes.append(node)
                node.start()
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        primaries, replicas = self.nodes[: self.masters], self.nodes[self.masters :]
        clients = [probe_client(n.host, n.port) for n in self.nodes]
        total = len(self.nodes)
        try:
            for node, client in zip(self.nodes, clients, strict=True):
                self.node_ids[node.port] = _as_text(_call(client, "CLUSTER", "MYID"))
            for epoch, (client, (first, last)) in enumerate(
                zip(clients, self.slot_ranges(), strict=False), start=1
            ):
                self._add_slots(client, first, last)
                # Distinct epochs up front avoid a round of epoch-collision
                # resolution once nodes meet (what redis-cli does too).
                _call(client, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for node in self.nodes[1:]:
                _call(clients[0], "CLUSTER", "MEET", node.host, node.port)

            # primary of each replica (by port), for CLUSTER REPLICATE and the check below
            want_primary: dict[int, str] = {}
            for i, primary in enumerate(primaries):
                for node in replicas[i * self.replicas : (i + 1) * self.replicas]:
                    want_primary[node.port] = self.node_ids[primary.port]
            for node in replicas:
                client = clients[self.nodes.index(node)]
                primary_id = want_primary[node.port]

                def attach(c: redis.Redis = client, p: str = primary_id) -> Any:
                    return _call(c, "CLUSTER", "REPLICATE", p)

                # "ERR Unknown node" until gossip has told this node about its primary.
                _wait_for(
                    f"node {node.port} to replicate {primary_id}",
                    attach,
                    max(1.0, deadline - time.monotonic()),
                )

            def converged() -> bool:
                for node, client in zip(self.nodes, clients, strict=True):
                    info = _as_text(_call(client, "CLUSTER", "INFO"))
                    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
                    if fields.get("cluster_state") != "ok":
                        return False
                    if fields.get("cluster_known_nodes") != str(total):
                        return False
                    if fields.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                        return False
                    nodes = _as_text(_call(client, "CLUSTER", "NODES"))
                    lines = [line.split() for line in nodes.splitlines() if line.strip()]
                    if len(lines) != total:
                        return False
                    if any(len(p) < 8 or p[7] != "connected" for p in lines):
                        return False
                    if want_primary:
                        seen = {v.port: v for v in map(ClusterNodeView, nodes.splitlines())}
                        for port, primary_id in want_primary.items():
                            if port not in seen or seen[port].master_id != primary_id:
                                return False
                        if node.port in want_primary:
                            link = client.info("replication").get("master_link_status")
                            if link != "up":
                                return False
                return True

            what = "cluster_state:ok on every node"
            if replicas:
                what += ", every replica attached and synced"
            _wait_for(what, converged, max(1.0, deadline - time.monotonic()))
        finally:
            for client in clients:
                client.close()

    @staticmethod
    def _add_slots(client: redis.Redis, first: int, last: int) -> None:
        """ADDSLOTSRANGE (7.0+), else ADDSLOTS in chunks (6.2 lacks the former)."""
        try:
            _call(client, "CLUSTER", "ADDSLOTSRANGE", first, last)
            return
        except redis.ResponseError as exc:
            if "unknown" not in str(exc).lower():
                raise
        for lo in range(first, last + 1, 1000):
            chunk = range(lo, min(lo + 1000, last + 1))
            _call(client, "CLUSTER", "ADDSLOTS", *chunk)

    # -- topology, as the running nodes see it ----------------------------------------------

    def node_at(self, port: int) -> _ClusterNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise KeyError(f"no node of this cluster listens on port {port}")

    def view(self, node: LocalServer | None = None) -> list[ClusterNodeView]:
        """CLUSTER NODES as ``node`` (by default the first running node) sees the cluster."""
        if node is None:
            node = next((n for n in self.nodes if n.running), None)
            if node is None:
                raise RuntimeError("no node of the cluster is running")
        client = probe_client(node.host, node.port)
        try:
            text = _as_text(_call(client, "CLUSTER", "NODES"))
        finally:
            client.close()
        return [ClusterNodeView(line) for line in text.splitlines() if line.strip()]

    def primaries(self) -> list[_ClusterNode]:
        """The nodes serving slots now (as the first running node sees it), by port."""
        serving = [v for v in self.view() if v.primary and v.slots and not v.failing]
        return sorted((self.node_at(v.port) for v in serving), key=lambda n: n.port)

    def replicas_of(self, primary: _ClusterNode) -> list[_ClusterNode]:
        """The nodes replicating ``primary`` now (as the first running node sees it)."""
        primary_id = self.node_ids[primary.port]
        return [self.node_at(v.port) for v in self.view() if v.master_id == primary_id]

    def node_for_slot(self, slot: int) -> _ClusterNode:
        """The primary serving ``slot`` now (as the first running node sees it)."""
        for v in self.view():
            if v.primary and not v.failing and any(lo <= slot <= hi for lo, hi in v.slots):
                return self.node_at(v.port)
        raise LookupError(f"no running primary serves slot {slot}")

    # -- failures -------------------------------------------------------------------------------

    def kill_primary(self, pid: int) -> _ClusterNode:
        """SIGKILL the primary whose process id is ``pid``: only a node this cluster started
        (its own Popen is signalled, never a bare PID), and only while it is a primary.
        Returns the node; :meth:`wait_for_failover` waits for a replica to replace it."""
        node = next((n for n in self.nodes if n.pid is not None and n.pid == pid), None)
        if node is None:
            raise ValueError(f"PID {pid} is no running node of this cluster")
        if node not in self.primaries():
            raise ValueError(f"node {node.port} (PID {pid}) is not a primary serving slots")
        self._orphans[node.port] = self.replicas_of(node)
        node.kill()
        return node

    def wait_for_failover(self, dead: _ClusterNode, timeout: float = 30.0) -> _ClusterNode:
        """Wait (at most ``timeout`` s) until a replica of the killed primary ``dead`` serves
        its slots and every running node says cluster_state:ok with every slot served;
        return the promoted node."""
        if dead.running:
            raise ValueError(f"node {dead.port} is still running")
        candidates = self._orphans.get(dead.port)
        if not candidates:
            raise ValueError(f"node {dead.port} was not killed by kill_primary() or had no replica")
        dead_id = self.node_ids[dead.port]
        promoted: list[_ClusterNode] = []

        def replaced() -> bool:
            live = [n for n in self.nodes if n.running]
            chosen: set[int] = set()
            for node in live:
                client = probe_client(node.host, node.port)
                try:
                    info = _as_text(_call(client, "CLUSTER", "INFO"))
                finally:
                    client.close()
                fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
                if fields.get("cluster_state") != "ok":
                    return False
                if fields.get("cluster_slots_ok") != str(CLUSTER_SLOTS):
                    return False
                views = {v.id: v for v in self.view(node)}
                if dead_id in views and views[dead_id].slots:
                    return False  # still owns slots: not replaced yet in this node's view
                new = [
                    views[self.node_ids[c.port]]
                    for c in candidates
                    if self.node_ids[c.port] in views
                ]
                up = [v for v in new if v.primary and v.slots and not v.failing]
                if len(up) != 1:
                    return False
                chosen.add(up[0].port)
            if len(chosen) != 1:
                return False
            node = self.node_at(chosen.pop())
            client = probe_client(node.host, node.port)
            try:
                if _as_text(_call(client, "ROLE")[0]) != "master":
                    return False
            finally:
                client.close()
            promoted[:] = [node]
            return True

        _wait_for(f"a replica of node {dead.port} to take over its slots", replaced, timeout)
        return promoted[0]

    def client(self, **kw: Any) -> redis.cluster.RedisCluster:
        """A redis-py cluster client seeded with every node."""
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in self.startup_nodes]  # type: ignore[no-untyped-call]
        return redis.cluster.RedisCluster(startup_nodes=nodes, **kw)

    def stop(self) -> None:
        """Stop every node and delete their dirs; idempotent."""
        nodes, self.nodes = self.nodes, []
        _close_all(nodes)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _SentinelServer(LocalServer):
    """The binary in sentinel mode, driven by a config file it may rewrite."""

    def __init__(
        self,
        binary: ServerBinary,
        *,
        service_name: str,
        master: tuple[str, int],
        quorum: int,
    ) -> None:
        super().__init__(binary)
        self.service_name = service_name
        self._monitor = master
        self._quorum = quorum
        self._conf_port: int | None = None

    @property
    def conf_path(self) -> str:
        return os.path.join(self.dir, "sentinel.conf")

    def _command(self, port: int) -> list[str]:
        # Keep a conf the sentinel already rewrote (restart keeps its state);
        # write a fresh one for a first start or a retry on a new port.
        if self._conf_port != port or not os.path.exists(self.conf_path):
            name = self.service_name
            host, master_port = self._monitor
            lines = [
                f"port {port}",
                f"bind {HOST}",
                f'dir "{self.dir}"',
                f'logfile "{self.log_path}"',
                "daemonize no",
                f"sentinel monitor {name} {host} {master_port} {self._quorum}",
                f"sentinel down-after-milliseconds {name} 1000",
                f"sentinel failover-timeout {name} 5000",
                f"sentinel parallel-syncs {name} 1",
            ]
            with open(self.conf_path, "w") as fh:
                fh.write("\n".join(lines) + "\n")
            self._conf_port = port
        return [self.binary.path, self.conf_path, "--sentinel", *self.args]


class LocalSentinelGroup:
    """One master, one replica and ``sentinels`` sentinels, for failover tests."""

    def __init__(
        self,
        binary: ServerBinary,
        service_name: str = "mymaster",
        sentinels: int = 3,
    ) -> None:
        if sentinels < 1:
            raise ValueError("sentinels must be >= 1")
        self.binary = binary
        self.service_name = service_name
        self.sentinel_count = sentinels
        self.quorum = min(2, sentinels)
        self._master: LocalServer | None = None
        self._replica: LocalServer | None = None
        self.sentinels: list[LocalServer] = []

    @property
    def master(self) -> LocalServer:
        """The server currently holding the master role (swapped by failover())."""
        if self._master is None:
            raise RuntimeError("group not started")
        return self._master

    @property
    def replica(self) -> LocalServer:
        if self._replica is None:
            raise RuntimeError("group not started")
        return self._replica

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(s.host, s.port) for s in self.sentinels]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel_addresses)
        return f"redis+sentinel://{hosts}/{self.service_name}"

    def start(self, timeout: float = 30.0) -> LocalSentinelGroup:
        """Start master, replica (fully synced), then sentinels; return once
        every sentinel knows the replica and all other sentinels, so that a
        failover can be requested immediately."""
        if self._master is not None:
            return self
        deadline = time.monotonic() + timeout
        try:
            # 7.0+ delays diskless full syncs by 5 s by default; skip the wait.
            self._master = LocalServer(
                self.binary, args=["--repl-diskless-sync-delay", "0"]
            ).start()
            master = self._master
            self._replica = LocalServer(
                self.binary,
                args=[
                    "--replicaof", master.host, str(master.port),
                    "--repl-diskless-sync-delay", "0",
                ],
            ).start()  # fmt: skip
            replica_client = probe_client(self._replica.host, self._replica.port)
            try:
                _wait_for(
                    "replica to sync",
                    lambda: replica_client.info("replication").get("master_link_status") == "up",
                    max(1.0, deadline - time.monotonic()),
                )
            finally:
                replica_client.close()
            for _ in range(self.sentinel_count):
                sentinel = _SentinelServer(
                    self.binary,
                    service_name=self.service_name,
                    master=(master.host, master.port),
                    quorum=self.quorum,
                )
                self.sentinels.append(sentinel)
                sentinel.start()
            _wait_for(
                "sentinels to discover the replica and each other",
                self._sentinels_ready,
                max(1.0, deadline - time.monotonic()),
                interval=0.2,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinel_call(self, sentinel: LocalServer, *args: Any) -> Any:
        client = probe_client(sentinel.host, sentinel.port)
        try:
            return _call(client, "SENTINEL", *args)
        finally:
            client.close()

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            state = _as_dict(self._sentinel_call(sentinel, "MASTER", self.service_name))
            if int(state.get("num-other-sentinels", -1)) != len(self.sentinels) - 1:
                return False
            replicas = [
                _as_dict(r) for r in self._sentinel_call(sentinel, "REPLICAS", self.service_name)
            ]
            healthy = [
                r
                for r in replicas
                if not {"s_down", "o_down", "disconnected"}
                & set(_as_text(r.get("flags", "")).split(","))
            ]
            if not healthy:
                return False
        return True

    def master_address(self, sentinel: LocalServer | None = None) -> tuple[str, int]:
        """The master address as reported by one sentinel (the first by default)."""
        target = sentinel if sentinel is not None else self.sentinels[0]
        host, port = self._sentinel_call(target, "GET-MASTER-ADDR-BY-NAME", self.service_name)
        return _as_text(host), int(port)

    def failover(self, timeout: float = 30.0) -> tuple[str, int]:
        """Force a failover and return the new master's address.

        Waits until every sentinel reports the new address and that server
        answers ROLE with "master"; ``master``/``replica`` are swapped to match.
        """
        old = self.master_address()
        self._sentinel_call(self.sentinels[0], "FAILOVER", self.service_name)
        new: list[tuple[str, int]] = []

        def switched() -> bool:
            addresses = {self.master_address(s) for s in self.sentinels}
            if len(addresses) != 1:
                return False
            (address,) = addresses
            if address == old:
                return False
            client = probe_client(*address)
            try:
                role = _call(client, "ROLE")
            finally:
                client.close()
            if _as_text(role[0]) != "master":
                return False
            new[:] = [address]
            return True

        _wait_for(f"failover of {self.service_name} away from {old}", switched, timeout)
        address = new[0]
        if self._replica is not None and address[1] == self._replica.port:
            self._master, self._replica = self._replica, self._master
        return address

    def sentinel_client(self, **kw: Any) -> redis.sentinel.Sentinel:
        """A redis-py Sentinel object pointed at every sentinel of the group."""
        return redis.sentinel.Sentinel(self.sentinel_addresses, **kw)  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        """Stop sentinels first (so they do not react), then the data nodes."""
        sentinels, self.sentinels = self.sentinels, []
        _close_all(sentinels)
        servers = [s for s in (self._replica, self._master) if s is not None]
        self._master = self._replica = None
        _close_all(servers)

    def __enter__(self) -> LocalSentinelGroup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
