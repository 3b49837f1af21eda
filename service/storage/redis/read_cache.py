"""The read cache of the standalone Redis transport: replies of reads kept by one lane
(:class:`~caller_memory.service.storage.redis.lane.Lane`) and dropped when Redis says their key changed
(client-side caching with server-assisted invalidation, RESP3). Its consistency argument is in
:class:`ReadCache`; :class:`~caller_memory.service.storage.redis.transport.StandaloneTransport` turns it on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

#: What :meth:`ReadCache.get` gives for a key it does not hold (a cached GET may be None).
_MISSING = object()


class Waiting:
    """A call's place in a :class:`Lane`: the replies it expects, its future, when it was sent, and the keys
    of a cached read (its replies go into the read cache as they are read)."""

    __slots__ = ("count", "future", "replies", "sent", "track")

    def __init__(
        self, future: asyncio.Future[list[Any]], count: int, sent: float, track: tuple[str, ...] | None
    ) -> None:
        self.future = future
        self.count = count
        self.replies: list[Any] = []
        self.sent = sent
        self.track = track


class ReadCache:
    """Replies of reads kept by one :class:`Lane`, dropped when Redis says their key changed: client-side
    caching with server-assisted invalidation (RESP3 ``CLIENT TRACKING ON OPTIN``; each cached read is sent
    after ``CLIENT CACHING YES``, so Redis tracks only those keys for this connection).

    Redis writes a key's invalidation into this connection's stream when the key changes (whoever changed
    it: another replica, a sweep, an expiry), so every reply read after it is of a command that ran after
    the change. Two rules follow, and they are the whole consistency argument:

    - a write acknowledged by this process may still have its invalidation on its way (behind the write's
      own reply on this lane, or in flight from another connection), so once any call that is not a cached
      read ended (``dirty``, when it did), nothing is served until the reply of a command sent after that
      was read: a caller always reads this process's writes;
    - a write through *another* connection is seen once its invalidation is read; the cache serves only while
      the lane has read the reply of a command sent less than ``bound`` seconds ago (``synced``), so a hit
      is never staler than ``bound``: a quiet lane's next read goes to Redis, and refreshes it.

    Values are the raw replies, and beside them (``derived``) what a reader made of one, such as a memory
    hash decoded into its fields, dropped with it: a hit does not decode the same reply again. A memory read
    still drops the fields whose own expiry has passed, at every read (an expired field is never served). The
    cache dies with its lane (a new connection starts empty).
    """

    __slots__ = ("bound", "derived", "dirty", "entries", "hits", "limit", "misses", "synced")

    def __init__(self, bound: float, limit: int) -> None:
        self.bound = bound
        self.limit = limit
        self.entries: dict[str, Any] = {}
        #: key -> (its entry, what :meth:`derive` made of it); never outlives the entry.
        self.derived: dict[str, tuple[Any, Any]] = {}
        self.synced = float("-inf")  # when the command of the last reply read was sent (loop time)
        self.dirty = float("-inf")  # when the last call that may have written ended (loop time)
        self.hits = 0
        self.misses = 0

    def get(self, keys: Sequence[str], now: float) -> list[Any] | None:
        if self.synced <= self.dirty or now - self.synced > self.bound:
            return None
        entries = self.entries
        values = [entries.get(key, _MISSING) for key in keys]
        if _MISSING in values:
            return None
        self.hits += 1
        return values

    def derive(self, key: str, value: Any, make: Callable[[Any], Any]) -> Any:
        """``make(value)``, made once while ``value`` (what :meth:`get` just gave for ``key``) is the entry:
        kept beside it until the entry goes. One ``make`` per key (the memory hash's decoding)."""
        found = self.derived.get(key)
        if found is not None and found[0] is value:
            return found[1]
        made = make(value)
        if self.entries.get(key, _MISSING) is value:
            self.derived[key] = (value, made)
        return made

    def ended(self, call: Waiting, loop: asyncio.AbstractEventLoop) -> None:
        """``call``'s last reply was just read (by the lane's reader, before what follows it in the stream)."""
        self.synced = call.sent
        if call.track is None:
            self.dirty = loop.time()
        else:
            self.fill(call.track, call.replies[1::2])

    def fill(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        entries, derived = self.entries, self.derived
        for key, value in zip(keys, values, strict=True):
            if isinstance(value, ResponseError):
                continue
            if key not in entries and len(entries) >= self.limit:
                oldest = next(iter(entries))  # the oldest filled
                del entries[oldest]
                derived.pop(oldest, None)
            entries[key] = value
            derived.pop(key, None)

    def invalidate(self, message: Any) -> None:
        """An ``invalidate`` push: its keys changed (None: the database was flushed)."""
        if len(message) < 2 or message[0] != b"invalidate":
            return
        if message[1] is None:
            self.entries.clear()
            self.derived.clear()
            return
        for key in message[1]:
            name = key.decode()
            self.entries.pop(name, None)
            self.derived.pop(name, None)
