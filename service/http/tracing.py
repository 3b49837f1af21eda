"""The HTTP side of tracing (SPEC section 18): a server span per request, from our own middleware, added by
``create_app`` only when tracing is on (off, requests go through one middleware fewer, not a disabled one).

Not aiohttp's server instrumentation: it records the raw path (``url.path``, ``http.target``), and the path
holds the caller's number. Here the span is named ``METHOD route-template``, ``http.route`` is the template,
and no ``url.*``, ``http.target`` or ``http.url`` attribute is ever set. The caller's ``traceparent`` (W3C
trace context) is read so that the span joins the agent's trace; ``baggage`` is not read (it may carry
anything the agent put there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Middleware

from ..telemetry import Telemetry
from .middleware import Handler

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from opentelemetry.util.types import AttributeValue

#: Methods named as they are; any other is ``_OTHER`` (HTTP semantic conventions: a client may send any token).
METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"))
#: ``gen_ai.operation.name`` of the memory operations (method, route template), from the ``gen_ai`` memory
#: conventions: a read is a search of the caller's memory, an end or a patch updates it.
MEMORY_OPERATIONS = {
    ("GET", "/v1/projects/{project}/callers/{identifier}/memory"): "search_memory",
    ("PATCH", "/v1/projects/{project}/callers/{identifier}/memory"): "update_memory",
    ("DELETE", "/v1/projects/{project}/callers/{identifier}/memory/{field}"): "delete_memory",
    ("DELETE", "/v1/projects/{project}/callers/{identifier}"): "delete_memory",
    ("POST", "/v1/projects/{project}/conversations/{conversation_id}/end"): "update_memory",
}


def tracing_middleware(telemetry: Telemetry) -> Middleware:
    """The server span of every request; outside the service's own middleware, so that it sees the status
    of the answer that middleware made of an error.

    A request the sampler leaves out (a 1% sampler: 99 of 100) costs little: with the service's own provider,
    one that starts a trace is decided before any span is made (:class:`~..telemetry.setup.Roots`); else it
    costs one unsampled span, not made current, so that nothing under it makes a span (the store's and the
    proxy's follow the request's), and none of its attributes is built (bench/otel.py measures what is left)."""
    from opentelemetry import context as otel_context
    from opentelemetry.propagators.textmap import DefaultGetter
    from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer, roots = telemetry.tracer, telemetry.roots
    assert tracer is not None, "tracing_middleware is added only when tracing is on"
    propagator = TraceContextTextMapPropagator()  # traceparent (and tracestate) only: never baggage
    getter = DefaultGetter()

    @web.middleware
    async def trace(request: web.Request, handler: Handler) -> web.StreamResponse:
        method = request.method if request.method in METHODS else "_OTHER"
        if roots is not None and "traceparent" not in request.headers and not roots.sampled():
            return await handler(request)  # a trace of its own, left out by the sampler: no span at all
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else None
        span = tracer.start_span(
            f"{method} {route}" if route is not None else method,
            context=propagator.extract(request.headers, getter=getter),
            kind=SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        )
        if not span.is_recording():
            return await handler(request)
        attributes: dict[str, AttributeValue] = {"http.request.method": method}
        if route is not None:
            attributes["http.route"] = route
            operation = MEMORY_OPERATIONS.get((method, route))
            if operation is not None:
                attributes["gen_ai.operation.name"] = operation
        span.set_attributes(attributes)
        token = otel_context.attach(set_span_in_context(span))
        try:
            response = await handler(request)
            answered(span, request, response.status)
            return response
        except BaseException as exc:  # a redirect raised, or the request cancelled (the client went)
            status = exc.status if isinstance(exc, web.HTTPException) else None
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if status is None or status >= 500:
                span.set_attribute("error.type", type(exc).__qualname__)
                span.set_status(StatusCode.ERROR)
            raise
        finally:
            otel_context.detach(token)
            span.end()

    return trace


def answered(span: Span, request: web.Request, status: int) -> None:
    """The answer's status on the request's span."""
    span.set_attribute("http.response.status_code", status)
    if status < 400 and "project" in request.match_info:
        # Only once the request was answered: the project then exists and the token is one of its own (a
        # refused path's project is whatever the client wrote there).
        span.set_attribute("gen_ai.memory.store.id", request.match_info["project"])
    if status >= 500:
        from opentelemetry.trace import StatusCode

        # A server span fails on a 5xx only: a 4xx is the client's (HTTP semantic conventions).
        span.set_attribute("error.type", str(status))
        span.set_status(StatusCode.ERROR)
