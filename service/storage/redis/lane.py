"""The standalone Redis transport's shared connection (:class:`Lane`): the calls in flight write their commands
in one write per turn of the event loop, and one reader task hands out the replies (and fills the read cache,
:class:`~caller_memory.service.storage.redis.read_cache.ReadCache`, in stream order).
:class:`~caller_memory.service.storage.redis.transport.StandaloneTransport` opens, retires and replaces lanes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError, RedisError, ResponseError

from .read_cache import ReadCache, Waiting


class LaneNotSent(RedisConnectionError):
    """The lane failed before this call's commands were written: nothing of them ran, so it may be sent
    again on another lane (the one failure :meth:`StandaloneTransport.run` retries)."""


class LaneLost(RedisConnectionError):
    """The lane failed after this call's commands were written: they may have run (or be running), so the
    call fails; it is never sent again (a write retried after it landed would apply twice)."""


#: What a lane's reader gets when the replies read so far are incomplete (a RESP3 reply may be ``False``).
_INCOMPLETE = object()
#: Bytes written to a lane and not yet taken by the server beyond which it takes no new call (a hung server
#: must not make the process buffer every request's commands).
MAX_UNSENT_BYTES = 16 << 20


def _reply_error(message: str) -> ResponseError:
    """An error reply as the exception redis-py raises for it (the scripts' NOSCRIPT is told apart)."""
    if message.startswith("NOSCRIPT "):
        return NoScriptError(message[len("NOSCRIPT ") :])
    return ResponseError(message)


class Lane:
    """One connection that the calls in flight share (auto-pipelining, as Redis clients in other languages do).

    A call's commands are packed into the lane's next write; every call queued before the event loop runs
    again goes out in that one write, and Redis reads them in one go. One reader task takes the replies as
    they come, many per read, and hands each call its own: calls are answered in the order they were written,
    so a reply is matched by its place (out-of-band RESP3 pushes are not replies: they are skipped), and a
    call that gave up (its store call timed out) leaves its replies to be dropped. Per call this saves a
    connection checkout, a send and a receive system call and a wakeup of the reading coroutine: under load
    most of a call's own cost in the transport.

    A lane on which a call was cancelled (its store call timed out) is *retired*: the next calls open a new
    one, and it is closed once no call waits on it any more (each waits at most its own store call's time),
    so a hung server cannot grow an unbounded queue on one connection. If the connection fails, the calls
    whose commands were not written yet fail with :class:`LaneNotSent` (safe to send again), the others with
    :class:`LaneLost` (never sent again). The connection itself is made by redis-py (address, TLS, AUTH,
    HELLO 3, SELECT, all as the URL says); the lane then reads and writes its stream.
    """

    __slots__ = ("cache", "connection", "failure", "loop", "out", "reader", "retired", "waiting", "writer")

    def __init__(
        self, connection: Any, loop: asyncio.AbstractEventLoop, cache: ReadCache | None = None
    ) -> None:
        self.connection = connection
        self.cache = cache
        self.loop = loop
        # redis-py's connected stream (the private attributes of its asyncio Connection since 4.2).
        self.writer: asyncio.StreamWriter = connection._writer
        self.waiting: deque[Waiting] = deque()
        self.out: list[bytes] = []
        self.failure: BaseException | None = None
        self.retired = False
        self.reader = loop.create_task(self._read(connection._reader))

    def send(
        self, packed: bytes, count: int, track: tuple[str, ...] | None = None
    ) -> asyncio.Future[list[Any]]:
        if self.failure is not None:
            raise LaneNotSent(f"the connection to Redis was lost: {self.failure}")
        if self.writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            self.retired = True  # the server takes nothing: the next calls try a new connection
            raise LaneNotSent(f"Redis has not taken the last {MAX_UNSENT_BYTES >> 20} MiB written to it")
        future: asyncio.Future[list[Any]] = self.loop.create_future()
        # The send time matters to the read cache only: no clock read per call without one.
        sent = self.loop.time() if self.cache is not None else 0.0
        self.waiting.append(Waiting(future, count, sent, track))
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out.append(packed)
        return future

    def _flush(self) -> None:
        out, self.out = self.out, []
        if self.failure is None and out:
            self.writer.write(out[0] if len(out) == 1 else b"".join(out))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            await self._take_replies(reader)
        except asyncio.CancelledError:
            self._fail(RedisConnectionError("the Redis store was closed"))
            raise
        except (OSError, RedisError) as exc:
            self._fail(exc if isinstance(exc, RedisError) else RedisConnectionError(str(exc)))
        except Exception as exc:  # a reply hiredis cannot parse
            self._fail(RedisConnectionError(f"unreadable reply from Redis: {exc!r}"))
        else:
            self._fail(RedisConnectionError("the connection to Redis was retired"))
        finally:
            await self.disconnect()

    async def _take_replies(self, reader: asyncio.StreamReader) -> None:
        """Read replies and hand them out until the lane is retired and idle (or the connection fails)."""
        parser = hiredis.Reader(
            protocolError=InvalidResponse, replyError=_reply_error, notEnoughData=_INCOMPLETE
        )
        waiting = self.waiting
        push = hiredis.PushNotification
        cache = self.cache
        while True:
            data = await reader.read(65536)
            if not data:
                raise RedisConnectionError("Redis closed the connection")
            parser.feed(data)
            while (reply := parser.gets()) is not _INCOMPLETE:
                if type(reply) is push:
                    # Out of band (maintenance notices, invalidations): no call's reply.
                    if cache is not None:
                        cache.invalidate(reply)
                    continue
                if not waiting:
                    raise InvalidResponse("Redis sent a reply that no command asked for")
                call = waiting[0]
                call.replies.append(reply)
                if len(call.replies) == call.count:
                    waiting.popleft()
                    if cache is not None:  # here, in stream order: a later invalidation must find it
                        cache.ended(call, self.loop)
                    if not call.future.done():
                        call.future.set_result(call.replies)
            if self.retired and self.idle():
                return

    async def disconnect(self) -> None:
        """Let redis-py close its connection (and forget its stream)."""
        await self.connection.disconnect(nowait=True)

    def idle(self) -> bool:
        """No call waits for a reply on this lane."""
        return all(call.future.done() for call in self.waiting)

    def _fail(self, failure: BaseException) -> None:
        if self.failure is None:
            self.failure = failure
        unsent = len(self.out)  # the last calls queued, whose commands were not written yet
        self.out = []
        written = len(self.waiting) - unsent
        for index, call in enumerate(self.waiting):
            if not call.future.done():
                kind = LaneLost if index < written else LaneNotSent
                call.future.set_exception(kind(f"the connection to Redis was lost: {failure}"))
        self.waiting.clear()
        self.writer.transport.abort()  # nothing queued to send goes out after this

    def retire(self) -> None:
        """No new calls; closed as soon as no call waits any more (see :meth:`release`)."""
        self.retired = True
        self.release()

    def release(self) -> None:
        """After a call on a retired lane ended (answered, failed or cancelled): close it if it was the last."""
        if self.retired and self.failure is None and self.idle():
            self.close()

    def close(self) -> None:
        self._fail(RedisConnectionError("the connection to Redis was closed"))
        self.reader.cancel()
