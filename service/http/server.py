"""The HTTP server around the application: what aiohttp leaves to the deployment, done in the process.

aiohttp (3.9-3.14) bounds neither the time a client may take to send a request's head nor the number of
connections, and its only clock on a connection that never completes a head is the keep-alive timeout
(75 s under ``run_app``). Thousands of connections that each send half a request line then hold a file
descriptor each until the process runs out, and asyncio logs a traceback for every failed ``accept()``.
So the service runs its own ``AppRunner`` (:func:`serve`, in place of ``web.run_app``), whose protocol
factory makes :class:`_GuardedHandler` connections, tracked by one :class:`ConnectionGuard` per process:

- a connection must complete its request head within ``header_timeout`` of opening (or of the first byte
  of its next request, on a kept-alive connection); then it gets a 408 and is closed;
- at most ``max_connections`` are open: one more closes the oldest connection whose request head is
  incomplete (then the oldest idle kept-alive one); a connection whose request is being handled is never
  closed for it;
- the deadline on request bodies lives in the middleware (it needs the request);
- the soft limit of open files is raised toward the hard limit to fit ``max_connections``
  (:func:`fit_open_files`), and the bound is lowered to what fits if the hard limit is too low, so that
  ``accept()`` does not fail;
- repeated log records are collapsed (:class:`RepeatedRecords`), and a failed ``accept()`` is logged as
  one line, not a traceback.

The guard costs two dictionary operations per connection and a membership test per read: no timer per
connection (the heads are kept in deadline order, so one timer serves all of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ..config import LISTEN_BACKLOG
from .metrics import Metrics
from .responses import problem_response

log = logging.getLogger("caller_memory.http")

#: Files the process keeps open besides its connections (store connections, the SQLite file and its
#: journal, the event loop's own, logs): the open-file limit must leave this much above the bound.
FD_HEADROOM = 256
#: The keep-alive timeout ``web.run_app`` uses (aiohttp's RequestHandler alone would keep 3630 s).
KEEPALIVE_TIMEOUT_S = 75.0
#: Seconds over which repeats of one log record are collapsed into one line with a count.
REPEAT_INTERVAL_S = 10.0
#: The collector's thresholds once the service is up (Python's default is 700, 10, 10): allocations net
#: of deallocations before a young collection, then young collections per middle one, middle ones per full
#: one. See :func:`settle_heap`.
GC_THRESHOLDS = (20_000, 20, 10)

_HEAD_TIMEOUT_BODY = orjson.dumps(
    {
        "type": "https://caller-memory.dev/problems/request-timeout",
        "title": "Request timeout",
        "status": 408,
        "detail": "the request head (request line and headers) did not arrive in time",
    }
)
_HEAD_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/problem+json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_HEAD_TIMEOUT_BODY), _HEAD_TIMEOUT_BODY)
)


_SHED_REASONS = {
    "header_timeout": "connections whose request head did not arrive within CALLER_MEMORY_HEADER_TIMEOUT",
    "over_limit": "connections waiting for a request head, the oldest, to stay within "
    "CALLER_MEMORY_MAX_CONNECTIONS",
}


class CannotListen(RuntimeError):
    """The server could not bind its address (the port is taken, no permission...)."""


class ConnectionGuard:
    """Every connection of one process, in one of three states: reading its request head (with a deadline),
    busy with a request, or idle between requests (kept alive). See the module's docstring."""

    def __init__(self, *, header_timeout: float, max_connections: int, metrics: Metrics) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self._metrics = metrics
        self._open: set[_GuardedHandler] = set()
        #: Connections reading a request head, by deadline (insertion order: all deadlines are equally long).
        self._heads: OrderedDict[_GuardedHandler, float] = OrderedDict()
        #: Kept-alive connections waiting for their next request, oldest first.
        self._idle: OrderedDict[_GuardedHandler, None] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Connections closed since the last log line about them, by reason; the next such line.
        self._unreported: dict[str, int] = {}
        self._report: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return len(self._open)

    def opened(self, conn: _GuardedHandler) -> None:
        self._open.add(conn)
        self._metrics.open_connections.inc()
        self.reading_head(conn)
        while len(self._open) > self.max_connections:
            # Never empty here: the new connection itself is reading its head.
            oldest = next(iter(self._heads or self._idle))
            self._shed(oldest, "over_limit", b"")

    def reading_head(self, conn: _GuardedHandler) -> None:
        self._idle.pop(conn, None)
        loop = self._loop or asyncio.get_running_loop()
        self._loop = loop
        self._heads[conn] = loop.time() + self.header_timeout
        if self._timer is None:
            self._timer = loop.call_at(self._heads[conn], self._expire_heads)

    def head_complete(self, conn: _GuardedHandler) -> None:
        self._heads.pop(conn, None)

    def idle(self, conn: _GuardedHandler) -> None:
        if conn in self._open:
            self._heads.pop(conn, None)
            self._idle[conn] = None

    def waiting_idle(self, conn: _GuardedHandler) -> bool:
        return conn in self._idle

    def reading(self, conn: _GuardedHandler) -> bool:
        return conn in self._heads

    def closed(self, conn: _GuardedHandler) -> None:
        if conn in self._open:
            self._forget(conn)

    def _forget(self, conn: _GuardedHandler) -> None:
        self._open.discard(conn)
        self._heads.pop(conn, None)
        self._idle.pop(conn, None)
        self._metrics.open_connections.dec()

    def _shed(self, conn: _GuardedHandler, reason: str, farewell: bytes) -> None:
        # Forgotten at once: the transport reports the close on a later turn of the loop.
        self._forget(conn)
        self._metrics.connections_closed.labels(reason).inc()
        self._unreported[reason] = self._unreported.get(reason, 0) + 1
        if self._report is None:  # the first in a while is logged at once, then one line per interval
            self._report_shed()
        conn.shed(farewell)

    def _report_shed(self) -> None:
        """Log what was shed since the last report, as one line (no line per connection: a flood of
        connections must not become a flood of log lines)."""
        self._report = None
        if not self._unreported:
            return
        log.warning(
            "closed %s to protect the service (see caller_memory_connections_closed)",
            ", ".join(f"{n} {_SHED_REASONS[reason]}" for reason, n in sorted(self._unreported.items())),
        )
        self._unreported = {}
        assert self._loop is not None
        self._report = self._loop.call_later(REPEAT_INTERVAL_S, self._report_shed)

    def _expire_heads(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        while self._heads:
            conn, deadline = next(iter(self._heads.items()))
            if deadline > now:
                self._timer = self._loop.call_at(deadline, self._expire_heads)
                return
            self._shed(conn, "header_timeout", _HEAD_TIMEOUT_RESPONSE)

    def close(self) -> None:
        for timer in (self._timer, self._report):
            if timer is not None:
                timer.cancel()
        self._timer = self._report = None
        self._report_shed()
        if self._report is not None:
            self._report.cancel()
            self._report = None


class _GuardedHandler(RequestHandler):
    """aiohttp's connection, reporting to the guard when a request head starts and ends, and when a
    response has been sent. ``_messages`` is aiohttp's queue of requests parsed from the connection
    (present in every 3.x release): a request in it has its head complete."""

    __slots__ = ("_guard",)

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._guard.opened(self)

    def data_received(self, data: bytes) -> None:
        guard = self._guard
        if data and guard.waiting_idle(self):
            guard.reading_head(self)  # the first byte of the next request: its head has a deadline now
        super().data_received(data)
        if self._messages and guard.reading(self):
            guard.head_complete(self)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        result = await super().finish_response(request, resp, start_time)
        if not self._messages:
            self._guard.idle(self)
        return result

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.closed(self)
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (bad request line, header, length...) is the client's error:
        answered with a problem document that quotes nothing of the request (aiohttp's own answer quotes the
        request line back, number and all), marked ``nosniff`` like every answer, and logged as one line
        (repeats collapsed), not as a traceback at ERROR. Server errors keep aiohttp's handling."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        reason = (getattr(exc, "message", None) or str(exc or "") or "malformed request").splitlines()[0]
        reason = reason.strip().rstrip(":")[:80] or "malformed request"
        log.warning("refused a request that is not valid HTTP (%d): %s", status, reason)
        if request.writer.output_size > 0:  # part of an answer went out already: the connection is broken
            raise ConnectionError("the answer was already started; the connection is closed")
        response = problem_response(
            status,
            "Bad request" if status == 400 else "Request refused",
            f"the request is not valid HTTP: {reason}",
            slug="malformed-http",
            headers={"X-Content-Type-Options": "nosniff"},
        )
        response.force_close()
        return response

    def shed(self, farewell: bytes) -> None:
        if farewell and self.transport is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self.transport.write(farewell)
        self.force_close()


class _GuardedServer(web.Server):
    """aiohttp's protocol factory, making guarded connections."""

    def __init__(self, handler: Any, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._guard = guard

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, self._guard, loop=self._loop, **self._kwargs)


class ServiceRunner(web.AppRunner):
    """``web.AppRunner`` whose server makes guarded connections."""

    __slots__ = ("guard",)

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _GuardedServer(
            made.request_handler,
            guard=self.guard,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **made._kwargs,
        )

    async def cleanup(self) -> None:
        self.guard.close()
        await super().cleanup()


def fit_open_files(max_connections: int) -> int:
    """Raise this process's soft limit of open files toward its hard limit, to fit ``max_connections``
    and :data:`FD_HEADROOM`; return how many connections fit (``max_connections`` unless the hard limit is
    too low, which is logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    fits = max(1, soft - min(FD_HEADROOM, soft // 4))
    log.warning(
        "the open-file limit is %d (hard limit %s): serving at most %d connections, not "
        "CALLER_MEMORY_MAX_CONNECTIONS=%d; raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, "
        "a container's nofile ulimit) to at least %d",
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        fits,
        max_connections,
        need,
    )
    return fits


class RepeatedRecords(logging.Filter):
    """Collapses repeats of one log record (same logger, level and message) at WARNING and above: the first
    in each ``interval`` passes; the others are counted, and the next one to pass after the interval says
    how many were left out, without a traceback. A flood of one error is then one line per interval."""

    MAX_KEYS = 1000

    def __init__(
        self, interval: float = REPEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        #: (logger, level, message) -> (start of its interval, records left out in it)
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage())
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval:
            self._seen[key] = (seen[0], seen[1] + 1)
            return False
        if len(self._seen) >= self.MAX_KEYS:
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
            if len(self._seen) >= self.MAX_KEYS:
                self._seen.clear()
        self._seen[key] = (now, 0)
        if seen is not None and seen[1]:
            record.msg = f"{key[2]} (and {seen[1]} more like it in the {self.interval:g} s before)"
            record.args = None
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def _loop_exceptions(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's exception handler, but a failed ``accept()`` is one line (it retries by itself)."""
    exc = context.get("exception")
    if context.get("message") == "socket.accept() out of system resource" and isinstance(exc, OSError):
        log.error("cannot accept connections: %s; asyncio retries in a second", exc.strerror or exc)
        return
    loop.default_exception_handler(context)


def quiet_repeats() -> None:
    """Put a :class:`RepeatedRecords` filter on the root logger's handlers (what the service writes to)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatedRecords) for f in handler.filters):
            handler.addFilter(RepeatedRecords())


def settle_heap() -> None:
    """Once the service is up: collect, move what survives (modules, classes, routes, the application and
    its services: some 60,000 objects) out of the collector's reach with ``gc.freeze()``, and raise the
    thresholds to :data:`GC_THRESHOLDS`.

    Why: with Python's defaults a full collection walked every object the imports made, 13 ms at rest and
    35-50 ms under load on the benchmark machine, every few seconds at peak, each one a stall of every
    request in flight. A young collection ran every 700
    allocations, when most of what it walks are the objects of requests still in flight, which it then
    promotes to be walked again. Reference cycles are still collected; objects that die young (nearly all
    of a request's) are freed by their reference counts and never walked."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def serve(
    app: web.Application,
    *,
    header_timeout: float,
    max_connections: int,
    metrics: Metrics,
    host: str | None = None,
    port: int | None = None,
    sockets: Sequence[socket.socket] = (),
    on_listening: Callable[[], Awaitable[None]],
    **runner_kwargs: Any,
) -> None:
    """Run ``app`` on ``host:port`` (or on the listening ``sockets``) until SIGINT or SIGTERM, as
    ``web.run_app`` would, with the guard of this module; ``on_listening`` runs once the address is bound.
    Raises :class:`CannotListen` if it cannot be."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.set_exception_handler(_loop_exceptions)
    guard = ConnectionGuard(header_timeout=header_timeout, max_connections=max_connections, metrics=metrics)
    main = loop.create_task(
        _run(
            app,
            guard,
            host=host,
            port=port,
            sockets=sockets,
            on_listening=on_listening,
            runner_kwargs=runner_kwargs,
        )
    )
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()


async def _run(
    app: web.Application,
    guard: ConnectionGuard,
    *,
    host: str | None,
    port: int | None,
    sockets: Sequence[socket.socket],
    on_listening: Callable[[], Awaitable[None]],
    runner_kwargs: dict[str, Any],
) -> None:
    runner = ServiceRunner(
        app, guard, handle_signals=True, keepalive_timeout=KEEPALIVE_TIMEOUT_S, **runner_kwargs
    )
    await runner.setup()
    try:
        sites: list[web.BaseSite] = [web.SockSite(runner, sock) for sock in sockets]
        if not sites:
            sites.append(web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG))
        for site in sites:
            try:
                await site.start()
            except OSError as exc:
                # asyncio rewords the error ("error while attempting to bind on address ..."), keeping errno.
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                raise CannotListen(f"cannot listen on {host}:{port}: {reason}") from exc
        settle_heap()
        await on_listening()
        await asyncio.Event().wait()  # until a signal raises GracefulExit out of the loop
    finally:
        await runner.cleanup()
