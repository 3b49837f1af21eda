"""A real local Redis Cluster for tests: 3 primaries and 3 replicas, each a ``redis-server`` process.

    with RedisCluster() as cluster:                  # the shipped deploy/redis.conf + cluster settings
        store = open_store(cluster.url)              # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...
        cluster.flushall()                           # on every primary (replicas follow)
        victim = cluster.primary_of(key)             # the node that serves a key now
        victim.kill(); cluster.wait_for_failover(victim)

Each node is a :class:`~tests.support.redis_server.RedisServer` (private directory, free port, checked
process id) started with :data:`~tests.support.redis_server.SHIPPED_CONFIG`, so the cluster runs with the
persistence the project ships (AOF, ``appendfsync always``), plus ``cluster-enabled yes``, a short
``cluster-node-timeout`` (failure detection in about a second) and an explicit ``cluster-port`` (the bus
port is otherwise ``port + 10000``, which a free port near the top of the range cannot have). The nodes
are joined by ``redis-cli --cluster create ... --cluster-replicas 1``, and :meth:`RedisCluster.start`
returns once every node says ``cluster_state:ok``, sees all six nodes and every replica's link to its
primary is up (a replica that is not in sync yet would make ``WAIT`` time out).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import redis
from redis.crc import key_slot

from tests.support.redis_server import SHIPPED_CONFIG, RedisServer, _free_port

#: Cluster settings on top of the shipped configuration. The node timeout is short so that a failover
#: takes about two seconds in the tests; production keeps a longer one (see docs/storage.md, "Redis Cluster").
CLUSTER_CONFIG: dict[str, str] = {
    "cluster-enabled": "yes",
    "cluster-config-file": "nodes.conf",
    "cluster-node-timeout": "1000",
    # A replica's first full sync starts at once instead of after the default 5 s wait for more replicas.
    "repl-diskless-sync-delay": "0",
}
PRIMARIES = 3
READY_TIMEOUT_S = 30.0
URL_SCHEME = "redis+cluster"


class ClusterNodeServer(RedisServer):
    """A cluster-enabled ``redis-server``: a fresh bus port with each first launch attempt, then kept (a
    restarted node must come back on the ports recorded in the other nodes' ``nodes.conf``)."""

    def __init__(self, config: Mapping[str, str]) -> None:
        super().__init__(config, config_file=SHIPPED_CONFIG)
        self.bus_port = 0

    def _command(self, port: int) -> list[str]:
        if not self.run_id:  # never started yet: a port conflict makes start() retry, with new ports
            self.bus_port = _free_port()
        return [*super()._command(port), "--cluster-port", str(self.bus_port)]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def info(self, section: str) -> dict[str, str]:
        """``INFO <section>``, or ``CLUSTER INFO`` for ``"cluster"``, as strings."""
        with self.client() as client:
            reply = client.execute_command("CLUSTER INFO") if section == "cluster" else client.info(section)
        return {str(k): str(v) for k, v in reply.items()}

    def cluster_nodes(self) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as this node sees it (redis-py parses it: address, flags, connected, slots)."""
        with self.client() as client:
            reply: dict[str, dict[str, Any]] = client.execute_command("CLUSTER NODES")
        return [{"address": address.split("@")[0], **node} for address, node in reply.items()]


class RedisCluster:
    """Three primaries and three replicas on 127.0.0.1, each in its own temporary directory."""

    def __init__(self, config: Mapping[str, str] | None = None) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
        self.cli = cli
        self.config = {**CLUSTER_CONFIG, **(config or {})}
        self.nodes = [ClusterNodeServer(self.config) for _ in range(2 * PRIMARIES)]

    @property
    def url(self) -> str:
        """The store URL naming every node (any one of them would do: the client discovers the rest)."""
        return f"{URL_SCHEME}://{','.join(n.address for n in self.nodes)}/"

    def running_nodes(self) -> list[ClusterNodeServer]:
        return [n for n in self.nodes if n.running]

    # Lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            addresses = [n.address for n in self.nodes]
            created = subprocess.run(
                [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
            self.wait_until_ready()
        except BaseException:
            self.close()
            raise

    def wait_until_ready(self, timeout: float = READY_TIMEOUT_S, *, replicas: bool = True) -> None:
        """Until every running node says the cluster is ok and knows every running node, and (with
        ``replicas``) each primary has its replica in sync."""
        deadline = time.monotonic() + timeout
        problem = ""
        while time.monotonic() < deadline:
            problem = self._not_ready(replicas)
            if not problem:
                return
            time.sleep(0.05)  # the cluster settles by gossip: there is no event to wait on
        raise RuntimeError(f"the cluster did not become ready within {timeout} s: {problem}")

    def _not_ready(self, replicas: bool) -> str:
        running = self.running_nodes()
        addresses = {n.address for n in running}
        try:
            for node in running:
                info = node.info("cluster")
                if info.get("cluster_state") != "ok":
                    return f"{node.address} says cluster_state:{info.get('cluster_state')}"
                connected = {
                    seen["address"]
                    for seen in node.cluster_nodes()
                    if seen["connected"] and "fail" not in seen["flags"]
                }
                if not addresses <= connected:
                    return f"{node.address} does not see {sorted(addresses - connected)} yet"
                replication = node.info("replication")
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return f"replica {node.address} is not in sync yet"
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            return repr(exc)
        primaries = [n for n in running if n.info("replication")["role"] == "master"]
        if len(primaries) != PRIMARIES:
            return f"{len(primaries)} primaries"
        for primary in primaries if replicas else []:
            if int(primary.info("replication")["connected_slaves"]) < 1:
                return f"primary {primary.address} has no replica connected"
        return ""

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Inspection and faults -----------------------------------------------------------------------------

    def primaries(self) -> list[ClusterNodeServer]:
        return [n for n in self.running_nodes() if n.info("replication")["role"] == "master"]

    def primary_of(self, key: str | bytes) -> ClusterNodeServer:
        """The running primary that serves ``key``'s slot now."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for node in self.primaries():
            myself = next(n for n in node.cluster_nodes() if "myself" in n["flags"])
            for span in myself["slots"]:
                if int(span[0]) <= slot <= int(span[-1]):
                    return node
        raise LookupError(f"no running primary serves slot {slot}")

    def replica_of(self, primary: ClusterNodeServer) -> ClusterNodeServer:
        for node in self.running_nodes():
            replication = node.info("replication")
            if replication["role"] == "slave" and int(replication["master_port"]) == primary.port:
                return node
        raise LookupError(f"{primary.address} has no running replica")

    def flushall(self) -> None:
        """Empty the cluster: FLUSHALL on every primary (their replicas follow)."""
        for node in self.primaries():
            with node.client() as client:
                client.flushall()

    def clients(self) -> Iterator[redis.Redis]:
        """A plain client of each running primary, for inspection (each closed after use)."""
        for node in self.primaries():
            with node.client() as client:
                yield client

    def wait_for_failover(self, dead: ClusterNodeServer, timeout: float = READY_TIMEOUT_S) -> float:
        """After ``dead`` was killed: seconds until its replica has taken over and the cluster is ok."""
        started = time.monotonic()
        self.wait_until_ready(timeout, replicas=False)
        return time.monotonic() - started
