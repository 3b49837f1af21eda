"""OpenTelemetry in the SDK (SPEC section 18): a client span around each request to the service, on the
application's global tracer provider, with the W3C ``traceparent`` header sent so that the service's spans
join the agent's trace (a Pipecat or LiveKit turn's, when the memory read runs inside one).

The SDK never configures a provider. Tracing is on when ``OTEL_SDK_DISABLED`` is not true and either the
application set a global provider or ``OTEL_TRACES_EXPORTER`` names an exporter (with the ``otel`` extra,
``opentelemetry-api``, installed); otherwise no OpenTelemetry module is imported. ``baggage`` is neither sent
nor read: it may carry anything the application put there. A span carries the method, the route template
(``/v1/projects/{project}/callers/{identifier}/memory``: never the path, which holds the caller's number),
the status, the project as ``gen_ai.memory.store.id`` and, for a read and an end,
``gen_ai.operation.name``; no exception is recorded, only its type.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

#: The instrumentation scope of the SDK's spans.
SCOPE = "caller_memory.sdk"
#: What stands in a path for the segment after each of these (the service's own route templates).
_PLACEHOLDERS = {"callers": "{identifier}", "conversations": "{conversation_id}"}
#: ``gen_ai.operation.name`` of the memory operations (method, route template after the project).
_OPERATIONS = {
    ("GET", "callers/{identifier}/memory"): "search_memory",
    ("POST", "conversations/{conversation_id}/end"): "update_memory",
}


def _exporter_wanted() -> bool:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    return names not in ("", "none")


class Tracing:
    """One client's view of the application's tracing, looked at on every request (the application may set
    its provider after making the client); the tracer is made again only when the provider changes."""

    __slots__ = ("_provider", "_tracer")

    def __init__(self) -> None:
        self._provider: object = None
        self._tracer: Tracer | None = None

    def tracer(self) -> Tracer | None:
        """The tracer to use now, or None: tracing is off (nothing of OpenTelemetry imported for it)."""
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        trace: Any = sys.modules.get("opentelemetry.trace")
        if trace is None:
            if not _exporter_wanted():
                return None  # an application that set a provider has imported opentelemetry.trace
            try:
                from opentelemetry import trace
            except ImportError:
                return None
        provider = trace.get_tracer_provider()
        if provider is not self._provider:
            unset = isinstance(provider, trace.ProxyTracerProvider) and not _exporter_wanted()
            self._tracer = None if unset else provider.get_tracer(SCOPE, __version__)
            self._provider = provider
        return self._tracer


def route_of(parts: tuple[str, ...]) -> str:
    """The route template of a request to ``parts`` (a path under the project, as the client builds it)."""
    segments = list(parts)
    if len(segments) > 1 and segments[0] in _PLACEHOLDERS:
        segments[1] = _PLACEHOLDERS[segments[0]]
    return "/".join(segments)


@contextlib.contextmanager
def request_span(
    tracer: Tracer, method: str, parts: tuple[str, ...], project: str, headers: MutableMapping[str, str]
) -> Iterator[Span]:
    """A client span around one request, its ``traceparent`` added to ``headers``."""
    from opentelemetry.trace import SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    route = route_of(parts)
    attributes: dict[str, str] = {"http.request.method": method, "gen_ai.memory.store.id": project}
    operation = _OPERATIONS.get((method, route))
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    with tracer.start_as_current_span(
        f"{method} /v1/projects/{{project}}/{route}",
        kind=SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        # traceparent (and tracestate) only: the W3C propagator alone, never the global one (which sends
        # baggage by default).
        TraceContextTextMapPropagator().inject(headers)
        try:
            yield span
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__qualname__)
            span.set_status(StatusCode.ERROR)
            raise


@contextlib.contextmanager
def within(context: object | None) -> Iterator[None]:
    """The block run in ``context`` (an OpenTelemetry ``Context``: a framework's turn, which the framework does
    not make current itself), so that the spans of the requests it starts are its children; ``None``
    (tracing off, or no turn yet): as it is."""
    if context is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(context)  # type: ignore[arg-type]  # a Context, from the framework
    try:
        yield
    finally:
        otel_context.detach(token)


def answered(span: Span, status: int) -> None:
    """The service's answer, on the request's span (a 4xx or 5xx marks it failed, as HTTP clients do)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 400:
        from opentelemetry.trace import StatusCode

        span.set_attribute("error.type", str(status))
        span.set_status(StatusCode.ERROR)
