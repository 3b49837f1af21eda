"""The service's middleware: the one place where errors become HTTP responses (RFC 9457 problem details),
plus the bounds on requests in flight (in all, and per project), the deadline on request bodies, and the
request metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import StreamReader, web
from aiohttp.typedefs import Middleware

from ..domain.errors import (
    CallerMemoryError,
    InvalidInput,
    Overloaded,
    PreconditionFailed,
    StoreCorrupt,
    StoreUnavailable,
    TooManyRequests,
    TranscriptsFull,
)
from ..domain.limits import MAX_BODY_BYTES
from .app_keys import METRICS
from .metrics import Metrics
from .responses import json_rpc_error, problem_response

log = logging.getLogger("caller_memory.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class InFlight:
    """The service's slots for requests in flight under /v1: ``limit`` in all, ``share`` per project (the
    project named by the path). The middleware takes one for each request; a memory proxy completion is
    not counted as a whole (its streams have their own bound) but takes one for its memory read only, while
    that read runs (:data:`IN_FLIGHT` on the request)."""

    __slots__ = ("count", "limit", "per_project", "share")

    def __init__(self, limit: int, share: int) -> None:
        self.limit = limit
        self.share = share
        self.count = 0
        self.per_project: dict[str, int] = {}

    def full(self) -> bool:
        return self.count >= self.limit

    def take(self, project: str | None) -> bool:
        """Take a slot (False, nothing taken: the service or the project holds all it may)."""
        if self.count >= self.limit:
            return False
        if project is not None:
            held = self.per_project.get(project, 0)
            if held >= self.share:
                return False
            self.per_project[project] = held + 1
        self.count += 1
        return True

    def give_back(self, project: str | None) -> None:
        self.count -= 1
        if project is not None:
            # Emptied entries go: project names come from paths, which anyone may make up.
            held = self.per_project[project] - 1
            if held:
                self.per_project[project] = held
            else:
                del self.per_project[project]

    @contextlib.asynccontextmanager
    async def slot(self, project: str) -> AsyncIterator[bool]:
        """A slot of ``project`` while the block runs (yields False, nothing held, when none is free)."""
        taken = self.take(project)
        try:
            yield taken
        finally:
            if taken:
                self.give_back(project)


#: The in-flight slots, on a memory proxy completion's request (its memory read takes one while it runs).
IN_FLIGHT = web.RequestKey("in_flight", InFlight)
#: On a platform's webhook that came while its project held its share of the slots (the service not full):
#: the request goes on uncounted, and its route answers without the store where it can (a call start: without
#: memory, never refused) or refuses it as before (an end event, which the platform retries). See
#: :func:`admitted`.
OVER_SHARE = web.RequestKey("over_share", str)
#: A platform's webhook: ``/v1/projects/{p}/platforms/{platform}/{hook}``.
_PLATFORM_HOOK = re.compile(r"/v1/projects/[^/]+/platforms/[^/]+/[^/]+")
#: The MCP endpoint, whose clients read an error as a JSON-RPC error object (http/mcp_routes.py).
_MCP = re.compile(r"/v1/projects/[^/]+/mcp")


def admitted(request: web.Request) -> bool:
    """Whether the request holds an in-flight slot (or needs none): False for a platform's webhook that came
    past its project's share."""
    return OVER_SHARE not in request


def refuse_unless_admitted(request: web.Request) -> None:
    """The 429 the request would have got from the middleware, for a platform's webhook that cannot go on
    without the store (an end event: the platform retries it)."""
    reason = request.get(OVER_SHARE)
    if reason is not None:
        raise TooManyRequests(reason, 1)


_HTTP_DETAILS = {
    404: "no such endpoint; see /openapi.json for the API",
    405: "this method is not allowed here; see /openapi.json for the API",
    413: f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes",
    415: "send the body as JSON, with 'Content-Type: application/json'",
}


class BodyTimeout(TimeoutError):
    """A request's body did not arrive within the body deadline. Set on the request's payload by the
    middleware's timer, so that whatever reads the body raises it; a TimeoutError, so that aiohttp's
    lingering read of an unread body after the response stops at it quietly."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request body did not arrive within {seconds:g} s; send it at once")
        self.seconds = seconds


def _expire_body(payload: StreamReader, seconds: float) -> None:
    if not payload.is_eof():
        payload.set_exception(BodyTimeout(seconds))


def _from_domain(exc: CallerMemoryError) -> web.Response:
    extra: dict[str, object] = {}
    headers: dict[str, str] = {}
    if isinstance(exc, InvalidInput) and exc.errors:
        extra["errors"] = exc.errors
    if isinstance(exc, PreconditionFailed):
        headers["ETag"] = exc.current_etag
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="caller-memory"'
    if isinstance(exc, TooManyRequests):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = "1"
    return problem_response(exc.status, exc.title, exc.detail, slug=exc.type_slug, headers=headers, **extra)


def problem_for(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The response for an exception a handler raised (re-raises redirects and other non-errors)."""
    if isinstance(exc, BodyTimeout):
        response = problem_response(408, "Request timeout", str(exc), slug="request-timeout")
        response.force_close()  # the rest of the body may still come: do not read it as the next request
        return response
    if isinstance(exc, CallerMemoryError):
        if isinstance(exc, TranscriptsFull):
            # The project is at the bound its configuration sets: the client's condition, not the service's.
            log.warning("%s %s refused: %s", request.method, _route(request), exc.detail)
        elif exc.status >= 500:
            log.error("%s %s failed: %s", request.method, _route(request), exc.detail)
        if isinstance(exc, StoreUnavailable | StoreCorrupt):
            request.app[METRICS].store_errors.labels(exc.type_slug).inc()
        return _from_domain(exc)
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        detail = _HTTP_DETAILS.get(exc.status, exc.reason)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return problem_response(exc.status, exc.reason, detail, slug=f"http-{exc.status}", headers=headers)
    if isinstance(exc, ConnectionError):
        # The client went away mid-request (it timed out, or hung up): nothing to answer, nothing to alarm.
        log.info("%s %s: the client closed the connection", request.method, _route(request))
        return problem_response(
            400, "Client closed", "the client closed the connection", slug="client-closed"
        )
    log.error("unhandled error in %s %s", request.method, _route(request), exc_info=exc)
    return problem_response(
        500, "Internal error", "an unexpected error occurred; it has been logged", slug="internal"
    )


def service_middleware(
    metrics: Metrics, limit: int, *, project_limit: int | None = None, body_timeout: float | None = None
) -> Middleware:
    """The service's one middleware (one layer is cheaper than three on every request):

    - refuses at once (503, ``Retry-After: 1``) what would exceed ``limit`` requests in flight under /v1, so
      that a slow store cannot pile up unbounded work: the excess fails fast instead of queueing;
    - refuses at once (429, ``Retry-After: 1``) what would exceed ``project_limit`` requests in flight whose
      path names the same project, so that one tenant cannot take every slot (requests are counted by the
      path's project before they are authenticated: a token of another project, or none, is refused in
      microseconds, before any body is read, so it cannot hold a project's slots);
    - gives a request ``body_timeout`` seconds from the end of its head for its body to arrive (408);
    - turns every error into a problem document (the one place where that happens);
    - marks every answer ``X-Content-Type-Options: nosniff``;
    - counts and times the request for /metrics.
    """
    share = min(limit, project_limit or limit)
    slots = InFlight(limit, share)
    busy = (
        f"requests of this project hold {share} of the service's {limit} slots for requests in flight, "
        "the most one project may hold; retry shortly"
    )

    @web.middleware
    async def serve(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        counted = request.path.startswith("/v1/")
        if counted and "/llm/chat/completions" in request.path:
            # Memory proxy streams have their own per-project bound (http/proxy_routes.py): a completion
            # takes a slot for its memory read only, while it runs.
            counted = False
            request[IN_FLIGHT] = slots
        project = None
        deadline = None
        try:
            if counted:
                project = request.match_info.get("project")
                if not slots.take(project):
                    counted = False
                    if slots.full():
                        raise Overloaded(
                            f"the service has {limit} requests in flight, its limit; retry shortly"
                        )
                    if request.method != "POST" or not _PLATFORM_HOOK.fullmatch(request.path):
                        raise TooManyRequests(busy, 1)
                    # A platform's call start past its project's share is still answered in time, without
                    # memory: its route decides (admitted, refuse_unless_admitted).
                    request[OVER_SHARE] = busy
            if body_timeout is not None and not request.content.is_eof():
                # Only a body still on its way costs a timer (a GET's, or a small body that came with its
                # head, is complete already).
                deadline = asyncio.get_running_loop().call_later(
                    body_timeout, _expire_body, request.content, body_timeout
                )
            response = await handler(request)
        except Exception as exc:
            response = problem_for(request, exc)
            if _MCP.fullmatch(request.path) and isinstance(response, web.Response):
                response = json_rpc_error(response)
        finally:
            if deadline is not None:
                deadline.cancel()
            if counted:
                slots.give_back(project)
        metrics.observe(request, response.status, started)
        # Every answer's media type is the one it declares: no browser may guess another (a JSON error
        # quoting client text must never be read as HTML).
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    return serve


def _route(request: web.Request) -> str:
    """The route template, never the concrete path (which may hold a phone number)."""
    info = request.match_info.route.resource
    return info.canonical if info is not None else "<unmatched>"
