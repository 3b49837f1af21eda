"""How the Redis backend (:mod:`caller_memory.service.storage.redis.store`) reaches Redis: one small interface, one implementation per topology.

:class:`RedisTransport` is what :class:`~caller_memory.service.storage.redis.store.RedisStore` sends its commands through; it knows nothing of
keys or operations. :class:`StandaloneTransport` (here) talks to one server; :class:`~caller_memory.service.storage.redis.cluster.ClusterTransport`
to a Redis Cluster. Both send a call's commands themselves, packed by hiredis (:func:`pack`), in one write on
one connection, and read the raw replies (RESP3, as hiredis parses them: an HGETALL is a dict).

The standalone hot path shares one connection among the calls in flight (a lane,
:class:`~caller_memory.service.storage.redis.lane.Lane`, with its read cache in
:mod:`caller_memory.service.storage.redis.read_cache`): the commands of the
calls made in one turn of the event loop go out in one write, and one reader task hands out the replies.
redis-py's client adds, per command, a retry wrapper, response callbacks and observability hooks, and its
pool an asyncio lock and a socket probe per checkout: measured on this machine with 32 concurrent HGETALLs,
38 us of CPU per command through the client, 24 us with a free list of connections (this module before the
lane), and 4-7 us with the lane at 32 calls in flight, 10-15 us at 8, about the same as the free list one
call at a time (``bench/transport.py`` measures the lane against redis-py's client).

:class:`Call` bounds each store call and is the one place where driver exceptions become domain errors.
"""

from __future__ import annotations

import asyncio
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from ...domain.errors import StoreCorrupt, StoreUnavailable
from .lane import Lane, LaneNotSent
from .read_cache import ReadCache

SCHEMES = ("redis", "rediss", "unix")
MIN_SERVER_VERSION = (7, 0)
#: The Lua scripts in ``lua/``.
SCRIPTS = (
    "patch",
    "erase",
    "record",
    "unlist",
    "sweep_bucket",
    "lease",
    "archive_index",
    "webhook_index",
    "webhook_queue",
    "webhook_enqueue",
)

#: A command and its arguments, as the Redis backend builds them.
Command = Sequence[str | bytes | int]
#: A script's keys and arguments.
ScriptCall = tuple[Sequence[str], Sequence[str | bytes | int]]


#: The read cache's commands: tracking on the lane's connection, for the keys of the reads that ask for it.
TRACKING_ON: Command = ("CLIENT", "TRACKING", "ON", "OPTIN")
CACHING_YES: Command = ("CLIENT", "CACHING", "YES")


def pack(commands: Sequence[Command]) -> bytes:
    """``commands`` in the Redis protocol, packed by hiredis in C (redis-py's asyncio connections pack in
    Python: a seventh of an end of a conversation, whose scripts take some 60 arguments)."""
    # hiredis's stub declares a one-element tuple; any tuple of str, bytes and int is packed.
    return b"".join([hiredis.pack_command(cast(Any, tuple(command))) for command in commands])


def hash_reply(reply: Any) -> dict[bytes, bytes]:
    """A raw HGETALL reply: a dict in RESP3 (redis-py 8's default), a flat list in RESP2."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


class NotReplicated(RedisError):
    """A write ran on the primary but not enough replicas confirmed it in time: it is not acknowledged."""

    def __init__(self, confirmed: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"the write reached {confirmed} of the {wanted} replica(s) required within {timeout_ms} ms, so it"
            " is not acknowledged (it may still have been applied: retry it)"
        )


#: A line of a script that is replaced by another file of ``lua/`` (code that several scripts share).
_INCLUDE = re.compile(r"^-- #include ([a-z_]+\.lua)$", re.MULTILINE)


def load_script(name: str) -> str:
    """A script of ``lua/``, with each ``-- #include <file>.lua`` line replaced by that file."""
    lua = resources.files(__package__).joinpath("lua")
    text = lua.joinpath(name).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda m: lua.joinpath(m.group(1)).read_text(encoding="utf-8").rstrip("\n"), text)


def check_version(info: Mapping[str, Any]) -> None:
    version = str(info.get("redis_version", "0"))
    numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if numbers < MIN_SERVER_VERSION:
        raise StoreUnavailable(
            f"Redis {version} is too old: version {'.'.join(map(str, MIN_SERVER_VERSION))} or newer is required"
        )


class Call:
    """One store call: bounded by the store timeout, and the one place where driver exceptions become domain
    errors (chained, so the cause is kept). A plain class rather than a generator context manager: it runs
    on every request."""

    __slots__ = ("expired", "operation", "seconds", "task", "timer")

    def __init__(self, operation: str, seconds: float) -> None:
        self.operation = operation
        self.seconds = seconds

    # The timeout is one timer that cancels the task, as asyncio.timeout does, minus its bookkeeping (its
    # state machine costs 1.5 us of the 4 us per call, measured; this runs once or twice per request).
    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - store calls always run in a task
            raise RuntimeError("a store call must run in an asyncio task")
        self.task = task
        self.expired = False
        loop = task.get_loop()
        self.timer = loop.call_at(loop.time() + self.seconds, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.timer.cancel()
        if self.expired and kind is asyncio.CancelledError and self.task.uncancel() == 0:
            # Cancelled by the timer alone (not also from outside). Its late replies are dropped by the
            # lane (matched by their order), and the lane is retired.
            timeout = TimeoutError(f"{self.operation} timed out after {self.seconds:g} s")
            raise StoreUnavailable(
                f"Redis did not answer {self.operation} within {self.seconds:g} s"
            ) from timeout
        if isinstance(exc, ResponseError):
            if str(exc).startswith("CMCORRUPT"):
                raise StoreCorrupt(
                    f"Redis holds data this version cannot read ({self.operation}): {exc}"
                ) from exc
            raise StoreUnavailable(f"Redis refused {self.operation}: {exc}") from exc
        if isinstance(exc, NotReplicated):
            raise StoreUnavailable(f"Redis did not confirm {self.operation}: {exc}") from exc
        # ConnectionError and the rest of the driver's errors (the cluster client's own are not RedisErrors)
        if isinstance(exc, (RedisError, RedisClusterException)):
            raise StoreUnavailable(f"Redis did not answer {self.operation}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How a transport connects and how long it waits, whatever the topology."""

    #: Seconds a store call may take (the service's store timeout).
    timeout: float
    connect_timeout: float
    #: Connections kept per server (per node, on a cluster); on one server, redis-py's client's (the hot path
    #: shares one lane, whatever this says).
    max_connections: int
    #: Seconds a connection may sit idle before it is PINGed again before use (a lane needs no probe: its
    #: reader sees a closed connection at once).
    health_check_interval: int
    #: The read cache's staleness bound in seconds (0: no cache); see :class:`ReadCache`. One server only.
    cache_seconds: float = 0.0
    #: Keys the read cache holds at most (the oldest filled goes first).
    cache_entries: int = 10_000


class RedisTransport(ABC):
    """What the Redis store sends its commands through: one server, or a Redis Cluster.

    Every method but :meth:`open` and :meth:`aclose` runs inside a :class:`Call` (which bounds it and
    translates the driver's errors). Replies are raw; an error reply raises (the first one), after every
    reply of the call was read, so the connection stays in step. On a cluster the commands of one
    :meth:`run` must all touch one slot; :meth:`in_order` and :meth:`each` take commands of any slots.
    """

    #: Whether commands of different slots must be separate calls (not ordered unless sent one after the
    #: other): the few operations whose algorithm differs on a cluster branch on it.
    cluster: bool

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.scripts: dict[str, AsyncScript] = {}

    @abstractmethod
    async def open(self) -> None:
        """Connect, check the server's version, register the scripts. Bounded by its own :class:`Call`."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every connection; the transport can be opened again."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise unless Redis answers."""

    def cached(self, *keys: str) -> list[Any] | None:
        """The values of ``keys`` from the read cache, if every one is there and may be served; else None
        (there is no cache but on one server with ``cache_seconds``). No I/O: no :class:`Call` needed."""
        return None

    def derived(self, key: str, value: Any, make: Callable[[Any], Any]) -> Any:
        """``make(value)`` for a ``value`` :meth:`cached` gave for ``key``: made once while that reply is
        cached (``make`` a pure function of it, the same one for a key every time)."""
        return make(value)

    def cache_counts(self) -> tuple[int, int] | None:
        """Reads the read cache answered and reads that went to Redis, since the transport was made, over
        every lane it had; None without a read cache."""
        return None

    async def read(self, *commands: tuple[str, str]) -> list[Any]:
        """Reads of one key each (``("HGETALL", key)``, ``("GET", key)``), whose replies the read cache
        keeps (where there is one) until Redis says the key changed. Else the same as :meth:`run`."""
        return await self.run(*commands)

    @abstractmethod
    async def run(self, *commands: Command, replicate: bool | None = None) -> list[Any]:
        """Send ``commands`` in one write on one connection and return their replies, in order.

        On a cluster they must all touch one slot, and a call that writes (or with ``replicate``) is
        acknowledged once a replica has it (:meth:`~caller_memory.service.storage.redis.cluster.ClusterLink.run`); one server ignores
        ``replicate``."""

    @abstractmethod
    async def in_order(self, *commands: Command) -> list[Any]:
        """Commands of different slots, run in this order: one transaction on one server (all or nothing,
        one round trip); one call after the other on a cluster, each acknowledged before the next is sent,
        so a failure leaves the earlier ones done and the later ones not."""

    @abstractmethod
    async def each(self, commands: Sequence[Command], *, replicate: bool | None = None) -> list[Any]:
        """Independent commands of any slots, in any order: one write on one server, one write per primary
        on a cluster. An error reply raises."""

    @abstractmethod
    async def run_scripts(self, name: str, calls: Sequence[ScriptCall]) -> list[Any]:
        """Script ``name`` once per ``(keys, args)`` of ``calls`` (each of one slot), in any order, without
        waiting for replicas; a server that does not know the script gets it. Returns the replies in order."""

    def script_command(
        self, name: str, script_keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> Command:
        return ("EVALSHA", self.scripts[name].sha, len(script_keys), *script_keys, *args)

    async def script(self, name: str, script_keys: Sequence[str], args: Sequence[str | bytes | int]) -> Any:
        """Run a Lua script by its SHA; a server that does not know it (restarted, failed over) gets its text."""
        try:
            return (await self.run(self.script_command(name, script_keys, args)))[0]
        except NoScriptError:
            script = cast("str", self.scripts[name].script)
            return (await self.run(("EVAL", script, len(script_keys), *script_keys, *args)))[0]


class StandaloneTransport(RedisTransport):
    """One Redis server (``redis://``, ``rediss://`` or ``unix://`` URL)."""

    cluster = False

    def __init__(self, url: str, limits: ConnectionLimits) -> None:
        super().__init__(limits)
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"not a Redis store URL (expected one of {', '.join(SCHEMES)}): {scheme}://")
        self._url = url
        self._client: Redis | None = None
        self._pool: ConnectionPool | None = None  # makes the lanes' connections; None when closed
        self._lane: Lane | None = None  # the lane new calls take
        self._opening: asyncio.Future[Lane] | None = None  # the lane being connected, shared by its waiters
        self._lanes: set[Lane] = set()  # every lane not closed yet, retired ones included
        self._closing: set[asyncio.Future[None]] = set()  # lanes' connections being closed
        self._gone_counts = (0, 0)  # the read cache's hits and misses on lanes whose reader ended

    def _connect(self) -> Redis:
        pool = ConnectionPool.from_url(
            self._url,
            # No per-socket timeout: redis-py would wrap every send in asyncio.wait_for (a task per command).
            # Each store call is bounded as a whole instead (Call, ``socket_timeout`` seconds: a hung server
            # costs a request half a second, not seconds of stall), and connecting is bounded here.
            socket_timeout=None,
            socket_connect_timeout=self.limits.connect_timeout,
            # One immediate retry, on connection errors only. It hides a pooled connection that went stale
            # (server restart, idle cut by a proxy). Timeouts are not retried: the server may be hung, a retry
            # would double the stall, and the command may already have run (a conditional write retried
            # after it landed would report a false precondition failure). redis-py 8 defaults to 10 retries
            # with exponential backoff, i.e. seconds of stall on an outage.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            # PING a connection that sat idle this long before using it again.
            health_check_interval=self.limits.health_check_interval,
            # TCP only: redis-py's unix-socket connections take no keepalive option (and need none).
            **({} if urlsplit(self._url).scheme == "unix" else {"socket_keepalive": True}),
            decode_responses=False,
            # The read cache's invalidations are RESP3 pushes on the lane's own connection (RESP2 would need a
            # second connection to redirect them to); redis-py 8 speaks RESP3 by default, 7 does not.
            **({"protocol": 3} if self.limits.cache_seconds else {}),
            # More than the service's bound on requests in flight, so a request never waits for a connection;
            # beyond it the pool refuses at once (the store is reported unavailable).
            max_connections=self.limits.max_connections,
        )
        return Redis.from_pool(pool)

    @property
    def client(self) -> Redis:
        """redis-py's client on the server (for what is not on the hot path)."""
        if self._client is None:
            raise StoreUnavailable("the Redis store is not open")
        return self._client

    async def open(self) -> None:
        if self._client is not None:
            return
        client = self._connect()
        try:
            async with Call("open", self.limits.timeout):
                await client.ping()
                info = await client.info("server")
                cluster = await client.info("cluster")
            check_version(info)
            if str(cluster.get("cluster_enabled", "0")) == "1":
                # Every request would get MOVED for the slots this node does not serve: refuse at start.
                raise StoreUnavailable(
                    "this Redis is a node of a Redis Cluster: use a redis+cluster://host:port[,host:port...]/ "
                    'store URL (see docs/storage.md, "Redis Cluster")'
                )
        except BaseException:
            await client.aclose()
            raise
        self.scripts = {name: client.register_script(load_script(f"{name}.lua")) for name in SCRIPTS}
        self._client = client
        self._pool = client.connection_pool

    async def aclose(self) -> None:
        client, self._client, self._pool = self._client, None, None
        self._lane = None
        if self._opening is not None:
            self._opening.cancel()
        lanes, self._lanes = self._lanes, set()
        for lane in lanes:
            lane.close()
        if lanes:
            await asyncio.gather(*(lane.reader for lane in lanes), return_exceptions=True)
            await asyncio.gather(*(lane.disconnect() for lane in lanes), return_exceptions=True)
        if client is not None:
            await client.aclose()

    async def ping(self) -> None:
        await self.client.ping()

    def cache_counts(self) -> tuple[int, int] | None:
        if not self.limits.cache_seconds:
            return None
        hits, misses = self._gone_counts
        for lane in self._lanes:
            if lane.cache is not None:
                hits, misses = hits + lane.cache.hits, misses + lane.cache.misses
        return hits, misses

    def _lane_gone(self, lane: Lane) -> None:
        """The lane's reader ended (once per lane): it is no longer one to close, and its counts are kept."""
        self._lanes.discard(lane)
        if lane.cache is not None:
            hits, misses = self._gone_counts
            self._gone_counts = (hits + lane.cache.hits, misses + lane.cache.misses)

    def cached(self, *keys: str) -> list[Any] | None:
        lane = self._lane
        if lane is None or lane.cache is None or lane.retired or lane.failure is not None:
            return None
        return lane.cache.get(keys, lane.loop.time())

    def derived(self, key: str, value: Any, make: Callable[[Any], Any]) -> Any:
        lane = self._lane
        if lane is None or lane.cache is None:
            return make(value)
        return lane.cache.derive(key, value, make)

    async def read(self, *commands: tuple[str, str]) -> list[Any]:
        if not self.limits.cache_seconds:
            return await self.run(*commands)
        # Each read after CLIENT CACHING YES (OPTIN tracking: only these keys are tracked); the lane's
        # reader puts the replies in the cache as it reads them.
        packed: list[Command] = []
        for command in commands:
            packed += [CACHING_YES, command]
        replies = await self.run(*packed, track=tuple(key for _, key in commands))
        lane = self._lane
        if lane is not None and lane.cache is not None:
            lane.cache.misses += 1
        return replies[1::2]

    async def run(
        self,
        *commands: Command,
        replicate: bool | None = None,
        track: tuple[str, ...] | None = None,
    ) -> list[Any]:
        """(See :meth:`RedisTransport.run`.) The commands go out on the shared :class:`Lane`, in its next
        write. A lane that failed before they were written (:class:`LaneNotSent`) is replaced and they are
        sent once more; once written, a lost connection fails the call (:class:`LaneLost`: they may have
        run). A call cancelled while it waits (the :class:`Call` timeout) retires its lane, so that the next
        calls do not queue behind whatever held it up."""
        if not commands:
            return []
        lane = self._lane
        if lane is None or lane.retired or lane.failure is not None:
            lane = await self._open_lane(lane)
        packed = pack(commands)
        try:
            try:
                replies = await lane.send(packed, len(commands), track)
            except LaneNotSent:  # nothing of it ran: once more, on a new lane
                lane.release()
                lane = await self._open_lane(lane)
                replies = await lane.send(packed, len(commands), track)
        except asyncio.CancelledError:
            if self._lane is lane:
                self._lane = None
            lane.retire()
            raise
        finally:
            lane.release()
        if len(replies) == 1:
            if isinstance(replies[0], ResponseError):
                raise replies[0]
            return replies
        failure = next((reply for reply in replies if isinstance(reply, ResponseError)), None)
        if failure is not None:
            raise failure
        return replies

    async def _open_lane(self, stale: Lane | None) -> Lane:
        """The lane to use instead of ``stale``: the current one if another call replaced it already, else a
        new one, connected once for all the calls that want it (a call that gives up does not stop it)."""
        lane = self._lane
        if lane is not None and lane is not stale and not lane.retired and lane.failure is None:
            return lane
        opening = self._opening
        if opening is None:
            opening = self._opening = asyncio.ensure_future(self._connect_lane())
            opening.add_done_callback(self._opened)
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if opening.cancelled() and task is not None and not task.cancelling():
                # The store was closed while the lane was being connected: not this task's cancellation.
                raise StoreUnavailable("the Redis store was closed") from None
            raise

    def _opened(self, opening: asyncio.Future[Lane]) -> None:
        if self._opening is opening:
            self._opening = None
        if opening.cancelled() or opening.exception() is not None:
            return  # (the exception is retrieved: its waiters, if any, got it too)
        lane = opening.result()
        if self._pool is None:  # closed meanwhile
            lane.close()
            self._lanes.discard(lane)
            closing = asyncio.ensure_future(lane.disconnect())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            return
        self._lane = lane

    async def _connect_lane(self) -> Lane:
        pool = self._pool
        if pool is None:
            raise StoreUnavailable("the Redis store is not open")
        connection = cast(Any, pool).make_connection()  # untyped in redis-py
        try:
            # Connecting is bounded by the connect timeout, the handshake (AUTH, HELLO, SELECT) by the store's.
            async with asyncio.timeout(self.limits.connect_timeout + self.limits.timeout):
                await connection.connect()
        except TimeoutError:
            await connection.disconnect(nowait=True)
            raise RedisConnectionError(
                f"connecting to Redis took more than {self.limits.connect_timeout + self.limits.timeout:g} s"
            ) from None
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        limits = self.limits
        cache = ReadCache(limits.cache_seconds, limits.cache_entries) if limits.cache_seconds else None
        lane = Lane(connection, asyncio.get_running_loop(), cache)
        self._lanes.add(lane)
        lane.reader.add_done_callback(lambda _: self._lane_gone(lane))
        if cache is not None:
            if str(getattr(connection, "protocol", "")) != "3":  # pragma: no cover - asked for above
                lane.close()
                raise StoreUnavailable("the read cache needs a RESP3 connection to Redis")
            try:
                async with asyncio.timeout(limits.timeout):
                    (reply,) = await lane.send(pack([TRACKING_ON]), 1)
            except BaseException:
                lane.close()
                raise
            if isinstance(reply, ResponseError):
                lane.close()
                raise StoreUnavailable(
                    f"Redis refused client-side caching (CALLER_MEMORY_READ_CACHE_SECONDS): {reply}"
                )
        return lane

    async def in_order(self, *commands: Command) -> list[Any]:
        *_, results = await self.run(("MULTI",), *commands, ("EXEC",))
        failure = next((r for r in results if isinstance(r, Exception)), None)
        if failure is not None:
            raise failure
        return cast("list[Any]", results)

    async def each(self, commands: Sequence[Command], *, replicate: bool | None = None) -> list[Any]:
        if not commands:
            return []
        return await self.run(*commands)

    async def run_scripts(self, name: str, calls: Sequence[ScriptCall]) -> list[Any]:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                script = self.scripts[name]
                for script_keys, args in calls:  # redis-py loads the script first if the server lacks it
                    await script(keys=script_keys, args=args, client=pipe)
                replies: list[Any] = await pipe.execute()
        finally:
            # Written through another connection: the lane's cache waits for a reply sent after this.
            lane = self._lane
            if lane is not None and lane.cache is not None:
                lane.cache.dirty = lane.loop.time()
        return replies
