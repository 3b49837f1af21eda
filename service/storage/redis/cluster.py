"""Redis Cluster transport of the Redis backend (:mod:`caller_memory.service.storage.redis.store`): store URLs, routing, replication waits.

The Redis backend sends every operation as single-slot calls (see :mod:`caller_memory.service.storage.redis.keys` for the hash tags).
:class:`ClusterLink` sends one call, a few commands that all touch one slot, on one connection of the
slot's primary, in one write, and reads the raw replies, exactly like the standalone hot path does on its
kept connections. redis-py's cluster client is used for what it is good at (the slot map, its nodes and
their connection pools, discovery), not for sending: its pipelines refuse EVALSHA, would send a ``WAIT``
to a node of their choosing rather than after the write on the same connection, and on a connection
error close every connection of every node.

Acknowledged means replicated. Redis replicates asynchronously: a primary that dies right after a write
can take it with it, and its replica, promoted, never had it. So after a write the same connection sends
``WAIT <replicas> <timeout>``, in the same round trip, and the write is acknowledged only if enough
replicas confirmed it; otherwise the call fails (the store is unavailable: the client retries; the
service's writes are idempotent or conditional). Redis 7.0 has no ``WAITAOF`` (7.2+): the write is applied
on the replica (a replica confirms what it applied, not what it fsynced) and on disk on the primary
(``appendfsync always``).

Errors: a redirection (``MOVED``, ``ASK``, ``TRYAGAIN``) means the command did not run: the slot map is
patched and the call is sent again. A lost connection refreshes the slot map in the background (a
failover makes the dead primary's replica the owner of its slots) and is retried once at once, like the
standalone pool does for a stale connection; a second failure is the caller's error (``LOADING``, a node
restarting, counts as a lost connection). ``CLUSTERDOWN`` (the cluster is failing over) and ``READONLY``
(a node that came back as a replica) refresh the map too, and are the caller's errors.

Only ``PING`` (readiness) and ``INFO`` (the version check) go through redis-py's own command path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MaxConnectionsError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...domain.errors import StoreUnavailable
from . import keys
from .transport import (
    SCRIPTS,
    Call,
    Command,
    ConnectionLimits,
    NotReplicated,
    RedisTransport,
    ScriptCall,
    check_version,
    load_script,
    pack,
)

log = logging.getLogger(__name__)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
#: Replicas that must confirm a write before it is acknowledged, unless the URL says otherwise.
DEFAULT_REPLICAS = 1
#: How often a call is sent again after redirections (a resharding in progress, a stale slot map).
REDIRECTIONS = 3

#: The commands of the backend that write nothing: a call made only of these waits for no replica.
READS = frozenset(
    {"GET", "MGET", "HGET", "HMGET", "HGETALL", "ZRANGE", "LRANGE", "SMEMBERS", "XREVRANGE", "PEXPIRETIME"}
)


def writes(commands: Sequence[Command]) -> bool:
    """Whether any of ``commands`` may write (scripts do)."""
    return any(str(command[0]).upper() not in READS for command in commands)


@dataclass(frozen=True, slots=True)
class ClusterAddress:
    """What a ``redis+cluster://`` URL says."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    ssl: bool
    replicas: int


def is_cluster_url(url: str) -> bool:
    return url.split(":", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterAddress:
    """``redis+cluster://[user:password@]host:port[,host:port...]/[0][?replicas=N]`` (``rediss+cluster``
    for TLS). Any reachable node is enough; the others are discovered. A cluster has one database, 0.
    ``replicas`` (default 1) is how many replicas must confirm a write before it is acknowledged; 0 turns
    the wait off (an acknowledged write can then be lost when its primary fails over)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL (expected {' or '.join(CLUSTER_SCHEMES)}://): {scheme}://")
    rest, _, fragment = rest.partition("#")
    if fragment:
        # Not echoed, nor what precedes it: a '#' is usually in a password, cut in two here.
        raise ValueError("Redis Cluster URL: it holds a '#' (write '#' in a password as %23)")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(
                f"Redis Cluster URL: '{item}' is not host:port (write redis+cluster://host:port,...)"
            )
        nodes.append((host.strip("[]"), int(port)))
    database = path.strip("/")
    if database not in ("", "0"):
        raise ValueError(
            f"Redis Cluster URL: a cluster has one database, 0, not '{database}' (remove it from the URL)"
        )
    options = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(options) - {"replicas"})
    if unknown:
        raise ValueError(f"Redis Cluster URL: unknown option {', '.join(unknown)}")
    replicas = DEFAULT_REPLICAS
    if "replicas" in options:
        text = options["replicas"][-1]
        if not text.isdigit():
            raise ValueError(f"Redis Cluster URL: replicas must be a whole number, not '{text}'")
        replicas = int(text)
    return ClusterAddress(tuple(nodes), username, password, scheme.lower() == "rediss+cluster", replicas)


def _keyed(command: Command) -> bool:
    name = str(command[0]).upper()
    return name not in ("WAIT", "MULTI", "EXEC") and (name not in ("EVAL", "EVALSHA") or int(command[2]) > 0)


def _keys(command: Command) -> Sequence[str | bytes | int]:
    """Every key of a command the backend sends (for the single-slot check)."""
    name = str(command[0]).upper()
    if name in ("EVAL", "EVALSHA"):
        return command[3 : 3 + int(command[2])]
    if name in ("MULTI", "EXEC", "WAIT"):
        return ()
    if name in ("MGET", "DEL", "EXISTS", "UNLINK"):
        return command[1:]
    return command[1:2]


def slot_of(commands: Sequence[Command]) -> int:
    """The one slot every key of ``commands`` is in. Raises ValueError if they span several: on a cluster
    that is a bug of the backend, caught here before anything is sent."""
    slots = {
        key_slot(key if isinstance(key, bytes) else str(key).encode())
        for command in commands
        for key in _keys(command)
    }
    if len(slots) != 1:
        raise ValueError(f"commands {[c[0] for c in commands]} span {len(slots)} slots: they must touch one")
    return slots.pop()


def _redirection(replies: Sequence[Any], batch: Sequence[Command]) -> AskError | TryAgainError | None:
    """The redirection the keyed commands of ``batch`` got, if they all got one (then none of them ran)."""
    redirected = [
        isinstance(r, (AskError, TryAgainError)) for r, c in zip(replies, batch, strict=True) if _keyed(c)
    ]
    if not any(redirected):
        return None
    first = next(r for r in replies if isinstance(r, (AskError, TryAgainError)))
    if not all(redirected):
        raise first  # some ran, some did not (a slot migrating mid-call): the caller retries
    return first


class ClusterLink:
    """A Redis Cluster, reached through redis-py's cluster client for the slot map and its connections."""

    def __init__(
        self,
        address: ClusterAddress,
        *,
        connect_timeout: float,
        wait_timeout_ms: int,
        max_connections: int,
        health_check_interval: int,
    ) -> None:
        self.address = address
        self.wait_timeout_ms = wait_timeout_ms
        self.client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
            username=address.username,
            password=address.password,
            ssl=address.ssl,
            # As on a standalone server: no per-socket timeout (each store call is bounded as a whole), a
            # bounded connect, and one retry of ordinary commands after a connection error, with the slot
            # map reloaded in between (redis-py's default is 3 retries with backoff: seconds of stall).
            socket_timeout=None,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 1),
            health_check_interval=health_check_interval,
            socket_keepalive=True,
            decode_responses=False,
            max_connections=max_connections,  # per node
        )
        self._refresh: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Load the slot map (raises if no node answers or the nodes are not a cluster)."""
        await self.client.initialize()

    async def aclose(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
            self._refresh = None
        await self.client.aclose()

    def primary(self, slot: int) -> ClusterNode:
        node: ClusterNode = self.client.nodes_manager.get_node_from_slot(slot)
        return node

    async def run(self, commands: Sequence[Command], *, replicate: bool | None = None) -> list[Any]:
        """Send ``commands`` (all of one slot) in one write on one connection of the slot's primary and
        return their raw replies in order. An error reply raises (the first one) once every reply was read.

        With ``replicate`` (by default: if any command may write), a ``WAIT`` follows on the same connection
        and :class:`NotReplicated` is raised unless enough replicas confirmed."""
        slot = slot_of(commands)
        wait = (writes(commands) if replicate is None else replicate) and self.address.replicas > 0
        batch = [*commands, *self._confirmation(commands)] if wait else list(commands)
        replies = await self._send(slot, batch)
        failure = next((r for r in replies if isinstance(r, Exception)), None)
        if failure is not None:
            if isinstance(failure, ClusterDownError | ReadOnlyError):
                self._refresh_slot_map()  # failing over, or a node that came back as a replica
            raise failure
        if wait:
            self._check_replicas(replies.pop())
            del replies[-2:]  # the marker's SET and DEL
        return replies

    async def run_each(self, commands: Sequence[Command], *, replicate: bool) -> list[Any]:
        """Independent commands, each of one slot, in any order: one write per primary (with one ``WAIT``
        at its end if ``replicate``), the primaries concurrently. Returns the replies in order, error replies
        as exception values (the caller decides); a lost connection or too few replicas raises."""
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, command in enumerate(commands):
            node = self.primary(slot_of([command]))
            groups.setdefault(node.name, (node, []))[1].append(i)
        replies: list[Any] = [None] * len(commands)

        async def send(node: ClusterNode, indexes: list[int]) -> None:
            batch = [commands[i] for i in indexes]
            try:
                answers = await self._exchange(
                    node, [*batch, *self._confirmation(batch)] if replicate else batch, asking=False
                )
            except MaxConnectionsError:
                raise  # the node is busy, not gone
            except (RedisConnectionError, RedisTimeoutError, OSError):
                await self._connection_lost(node)
                raise
            if replicate:
                self._check_replicas(answers.pop())
                del answers[-2:]  # the marker's SET and DEL
            for i, answer in zip(indexes, answers, strict=True):
                if isinstance(answer, (AskError, TryAgainError)):  # did not run: alone, wherever it is now
                    try:
                        answer = (await self.run([commands[i]], replicate=replicate))[0]
                    except ResponseError as exc:
                        answer = exc
                replies[i] = answer

        # Every node's part runs to its end before a failure is raised: none is left running unbounded.
        outcomes = await asyncio.gather(
            *(send(node, indexes) for node, indexes in groups.values()), return_exceptions=True
        )
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            raise failure
        return replies

    def _confirmation(self, commands: Sequence[Command]) -> list[Command]:
        """What follows writes on their connection so that they are acknowledged only once replicated: a
        marker written in their slot (set and deleted again: both replicate, nothing is left), then ``WAIT``. ``WAIT`` counts from the connection's own last
        replicated write; without the marker, writes that change nothing (deleting a missing key, a retry
        of a write that did land) would leave that at an earlier point, or at none on a fresh connection,
        and ``WAIT`` would confirm at once what the replica may not have."""
        key = next(k for command in commands for k in _keys(command))
        marker = keys.sync_key(key.decode() if isinstance(key, bytes) else str(key))
        return [
            ("SET", marker, b"", "PX", 1000),
            ("DEL", marker),
            ("WAIT", self.address.replicas, self.wait_timeout_ms),
        ]

    def _check_replicas(self, reply: Any) -> None:
        if isinstance(reply, Exception):
            raise reply
        if int(reply) < self.address.replicas:
            raise NotReplicated(int(reply), self.address.replicas, self.wait_timeout_ms)

    async def _send(self, slot: int, batch: Sequence[Command]) -> list[Any]:
        """The replies of ``batch``, following redirections and retrying once after a lost connection."""
        node, asking, retried = self.primary(slot), False, False
        for _ in range(REDIRECTIONS):
            try:
                replies = await self._exchange(node, batch, asking=asking)
            except MaxConnectionsError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError):  # LOADING (a restarted node) too
                await self._connection_lost(node)
                if retried:
                    raise
                retried = True
                node, asking = self.primary(slot), False
                continue
            redirect = _redirection(replies, batch)
            if redirect is None:
                return replies
            if isinstance(redirect, MovedError):
                await self.client.nodes_manager.move_slot(redirect)
                node, asking = self.primary(slot), False
            elif isinstance(redirect, AskError):
                node, asking = self._node_at(redirect.host, redirect.port), True
            else:
                await asyncio.sleep(0.05)  # TRYAGAIN: a multi-key call during a slot migration
        raise ResponseError(f"slot {slot} was redirected {REDIRECTIONS} times in a row")

    def _node_at(self, host: str, port: int) -> ClusterNode:
        node: ClusterNode | None = self.client.nodes_manager.get_node(host=host, port=port)
        if node is None:
            node = ClusterNode(host, port, **self.client.nodes_manager.connection_kwargs)
            self.client.nodes_manager.set_nodes(self.client.nodes_manager.nodes_cache, {node.name: node})
        return node

    @staticmethod
    async def _exchange(node: ClusterNode, batch: Sequence[Command], *, asking: bool) -> list[Any]:
        """One write, every reply read (errors as values): the connection stays in step. A cancellation or a
        connection error closes the connection (redis-py does), so no late reply is taken for another's."""
        connection = node.acquire_connection()
        try:
            sent = [("ASKING",), *batch] if asking else batch
            await connection.send_packed_command(pack(sent), check_health=False)
            replies: list[Any] = []
            for _ in sent:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as exc:
                    replies.append(exc)
            return replies[1:] if asking else replies
        finally:
            node.release(connection)

    async def _connection_lost(self, node: ClusterNode) -> None:
        node.update_active_connections_for_reconnect()  # the connections in use reconnect when released
        await node.disconnect_free_connections()
        self.client.nodes_manager.move_node_to_end_of_cached_nodes(node.name)
        self._refresh_slot_map()

    def _refresh_slot_map(self) -> None:
        """Reload the slot map in the background, once at a time (the request that saw the failure answers
        at once; the next ones use the new map)."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._reload())

    async def _reload(self) -> None:
        try:
            await self.client.nodes_manager.initialize()
        except Exception as exc:  # a failover in progress: the next failure tries again
            log.debug("Redis Cluster slot map not reloaded: %s", exc)


class ClusterTransport(RedisTransport):
    """A Redis Cluster (``redis+cluster://`` URL, see :func:`parse_cluster_url`), reached by a
    :class:`ClusterLink` made at each :meth:`open`; every write waits for a replica before it is
    acknowledged."""

    cluster = True

    def __init__(self, url: str, limits: ConnectionLimits) -> None:
        super().__init__(limits)
        self.address = parse_cluster_url(url)  # a bad URL fails here, early
        self._link: ClusterLink | None = None

    @property
    def link(self) -> ClusterLink:
        if self._link is None:
            raise StoreUnavailable("the Redis store is not open")
        return self._link

    async def open(self) -> None:
        if self._link is not None:
            return
        link = ClusterLink(
            self.address,
            connect_timeout=self.limits.connect_timeout,
            # Half the call's budget: a replica that does not confirm by then fails the call cleanly (503)
            # instead of letting the timeout cut it.
            wait_timeout_ms=max(1, int(self.limits.timeout * 500)),
            max_connections=self.limits.max_connections,
            health_check_interval=self.limits.health_check_interval,
        )
        # Discovery may try the listed nodes one after the other (one that is down costs a connect timeout)
        # before it loads the slot map and the command table.
        budget = self.limits.timeout + self.limits.connect_timeout * len(self.address.nodes)
        try:
            async with Call("open", budget):
                await link.open()
                info = await link.client.info("server")  # one node; all run the same version
            check_version(info)
        except BaseException:
            await link.aclose()
            raise
        self.scripts = {name: link.client.register_script(load_script(f"{name}.lua")) for name in SCRIPTS}
        self._link = link

    async def aclose(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            await link.aclose()

    async def ping(self) -> None:
        await self.link.client.ping()

    async def run(self, *commands: Command, replicate: bool | None = None) -> list[Any]:
        return await self.link.run(commands, replicate=replicate)

    async def in_order(self, *commands: Command) -> list[Any]:
        return [(await self.run(command))[0] for command in commands]

    async def each(self, commands: Sequence[Command], *, replicate: bool | None = None) -> list[Any]:
        if not commands:
            return []
        replies = await self.link.run_each(
            commands, replicate=any(writes([c]) for c in commands) if replicate is None else replicate
        )
        failure = next((r for r in replies if isinstance(r, Exception)), None)
        if failure is not None:
            raise failure
        return replies

    async def run_scripts(self, name: str, calls: Sequence[ScriptCall]) -> list[Any]:
        commands = [self.script_command(name, script_keys, args) for script_keys, args in calls]
        replies = await self.link.run_each(commands, replicate=False)
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):  # a node that never ran it (promoted, restarted)
                replies[i] = await self.script(name, *calls[i])
            elif isinstance(reply, Exception):
                raise reply
        return replies
