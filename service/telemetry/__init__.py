"""OpenTelemetry tracing of the service (SPEC section 18): on only when asked for, and then spans from our own
code only, which name what happened and never whom it happened to.

On = ``OTEL_SDK_DISABLED`` is not true, and either a global tracer provider is already set (an application
that embeds the service, or the tests) or ``OTEL_TRACES_EXPORTER`` names an exporter and the ``otel`` extra
is installed (then :mod:`.setup` configures a provider from the standard ``OTEL_*`` variables). Off, this
package imports no OpenTelemetry module at all: every import of one is inside a function that runs only when
tracing is on (a test checks ``sys.modules`` in a fresh process).

Spans are made by the HTTP middleware (``http/tracing.py``: one server span per request, named by its route
template), by the Store port (:mod:`.store`: one client span per port call), around the memory proxy's
upstream call, the webhook deliveries (each linked to the span that queued it, when that was in this
process) and the MCP tools (:meth:`Telemetry.tool_span`). What a span may carry is a short, fixed list:
route templates, methods, status codes, the store's kind and operation, the project id as
``gen_ai.memory.store.id`` and a ``gen_ai.operation.name``. Never a path, a key, an identifier, a pseudonym,
a value or a message: no exception is recorded on a span (its message may quote input), only its type.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for type checking: nothing of OpenTelemetry is imported while tracing is off
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext, Tracer

    from ..domain.store import Store
    from ..domain.store.webhooks import Delivery
    from ..domain.webhooks.service import QueueListener
    from .setup import Roots

log = logging.getLogger("caller_memory.telemetry")

#: The instrumentation scope of every span the service makes.
SCOPE = "caller_memory.service"
#: Span contexts kept for links from webhook deliveries to what queued them (the oldest go first).
MAX_KEPT_LINKS = 10_000
#: Seconds the service's shutdown waits for its own provider to export what it holds.
SHUTDOWN_WAIT_S = 2.0


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def global_provider_set() -> bool:
    """Whether the application set a global tracer provider, without importing OpenTelemetry: an application
    that set one has imported ``opentelemetry.trace`` already."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return False
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


class Telemetry:
    """The service's tracing, built once by ``create_app``: :meth:`from_environment`, or :meth:`off`, or
    (tests) :meth:`with_provider`. Off, every method is a no-op and ``tracer`` is None."""

    __slots__ = ("_links", "_lock", "_provider", "dropped", "exporters", "roots", "tracer")

    def __init__(
        self,
        tracer: Tracer | None = None,
        *,
        provider: Any = None,
        dropped: Callable[[], int] | None = None,
        exporters: Sequence[str] = (),
        roots: Roots | None = None,
    ) -> None:
        self.tracer = tracer
        #: The root decision of the service's own sampler, made before any span (None: the application's
        #: provider, or a sampler of another package: every request goes through the SDK's sampler).
        self.roots = roots
        #: The provider the service configured itself (None: the application's, which it never shuts down).
        self._provider = provider
        #: Spans dropped because the export queue was full (a collector down or slow): a running total.
        self.dropped: Callable[[], int] = dropped or (lambda: 0)
        self.exporters = tuple(exporters)
        self._links: collections.OrderedDict[tuple[str, str], SpanContext] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.tracer is not None

    @classmethod
    def off(cls) -> Telemetry:
        return cls()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Telemetry:
        """Tracing as the standard variables ask (read when the app is built, never at import)."""
        env = os.environ if environ is None else environ
        if _true(env.get("OTEL_SDK_DISABLED")):
            return cls.off()
        if global_provider_set():
            from opentelemetry import trace

            return cls(trace.get_tracer(SCOPE))
        wanted = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
        wanted = [name for name in wanted if name and name != "none"]
        if not wanted:
            return cls.off()
        try:
            from .setup import configured_provider
        except ImportError:
            log.warning(
                "OTEL_TRACES_EXPORTER is set but OpenTelemetry's SDK is not installed (the 'otel' extra: pip "
                "install 'caller-memory[otel]'); tracing stays off"
            )
            return cls.off()
        provider, dropped, used, roots = configured_provider(env, wanted)
        if not used:  # only exporters this service does not ship (each named in a warning)
            return cls.off()
        return cls.with_provider(provider, dropped, used, roots, set_global=True)

    @classmethod
    def with_provider(
        cls,
        provider: Any,
        dropped: Callable[[], int],
        exporters: Sequence[str] = (),
        roots: Roots | None = None,
        *,
        set_global: bool = False,
    ) -> Telemetry:
        """Tracing on ``provider``, which the service owns: it shuts it down when it stops. ``set_global``: it
        becomes the process's global provider as well (when none is set), so that libraries' spans (the mcp
        SDK's) go to the same place."""
        if set_global:
            from opentelemetry import trace

            trace.set_tracer_provider(provider)
        return cls(
            provider.get_tracer(SCOPE), provider=provider, dropped=dropped, exporters=exporters, roots=roots
        )

    async def shutdown(self) -> None:
        """Export what the service's own provider holds, waiting :data:`SHUTDOWN_WAIT_S` at most: a collector
        that hangs must not hold the service's stop (the export runs on in a daemon thread, and the process
        may end under it)."""
        if self._provider is None:
            return
        import asyncio

        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def shut() -> None:
            try:
                self._provider.shutdown()
            finally:
                # The loop may be gone by now: the stop did not wait, and the process went on without it.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(done.set)

        threading.Thread(target=shut, name="telemetry shutdown", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SHUTDOWN_WAIT_S):
                await done.wait()

    # Spans of our own code ------------------------------------------------------------------------------------

    def traced_store(self, store: Store, system: str) -> Store:
        """``store`` with a span around every call of the port (itself when tracing is off)."""
        if self.tracer is None:
            return store
        from .store import traced

        return traced(store, self.tracer, system)

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, str | int] | None = None) -> Iterator[Span | None]:
        """An internal span around the block (a scheduled job's run); None when tracing is off."""
        if self.tracer is None:
            yield None
            return
        with (
            self.tracer.start_as_current_span(
                name, attributes=attributes, record_exception=False, set_status_on_exception=False
            ) as span,
            _failures_marked(span),
        ):
            yield span

    @contextlib.contextmanager
    def tool_span(self, name: str, project: str) -> Iterator[Span | None]:
        """A span around one MCP tool's work (``execute_tool <name>``, under the mcp SDK's ``tools/call``
        span): service/mcp's tools run in it. The tool's name and the project only: never its arguments or
        its answer."""
        with self.span(
            f"execute_tool {name}",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": name,
                "gen_ai.memory.store.id": project,
            },
        ) as span:
            yield span

    @contextlib.contextmanager
    def client_span(self, name: str, attributes: Mapping[str, str | int]) -> Iterator[Span | None]:
        """A client span around a call this service makes (the memory proxy's upstream), inside the
        request's span when that was sampled (none otherwise)."""
        if self.tracer is None:
            yield None
            return
        from opentelemetry.trace import SpanKind, get_current_span

        if not get_current_span().is_recording():
            yield None
            return

        with (
            self.tracer.start_as_current_span(
                name,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span,
            _failures_marked(span),
        ):
            yield span

    # Webhook deliveries, linked to what queued them ---------------------------------------------------------------

    def remembering(self, listener: QueueListener) -> QueueListener:
        """``listener``, which also keeps the span that queued each delivery (the end's request, or an
        inactivity end's run), so that the delivery's span links to it. Kept in this process only, for the
        :data:`MAX_KEPT_LINKS` latest: a delivery sent by another replica, or after a restart, has no link."""
        if self.tracer is None:
            return listener
        return _Remembering(self, listener)

    def _remember(self, deliveries: Sequence[Delivery]) -> None:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if not context.is_valid:
            return
        with self._lock:
            for delivery in deliveries:
                self._links[(delivery.project, delivery.delivery_id)] = context
            while len(self._links) > MAX_KEPT_LINKS:
                self._links.popitem(last=False)

    @contextlib.contextmanager
    def delivery_span(self, delivery: Delivery) -> Iterator[None]:
        """A span around one attempt of a webhook delivery (``deliver <event>``), linked to the span that
        queued it when this process kept that."""
        if self.tracer is None:
            yield
            return
        from opentelemetry.trace import Link, SpanKind

        with self._lock:
            queued_by = self._links.get((delivery.project, delivery.delivery_id))
        links = [Link(queued_by)] if queued_by is not None else None
        with (
            self.tracer.start_as_current_span(
                f"deliver {delivery.event}",
                context=_root(),
                kind=SpanKind.CLIENT,
                links=links,
                attributes={
                    "caller_memory.webhook.event": delivery.event,
                    "gen_ai.memory.store.id": delivery.project,
                },
                record_exception=False,
                set_status_on_exception=False,
            ) as span,
            _failures_marked(span),
        ):
            yield

    def delivered(self, delivery: Delivery, outcome: str) -> None:
        """The attempt's outcome, on its span; a settled delivery's link is no longer needed."""
        if self.tracer is None:
            return
        from opentelemetry import trace

        trace.get_current_span().set_attribute("caller_memory.webhook.outcome", outcome)
        if outcome in ("delivered", "failed", "dropped"):
            with self._lock:
                self._links.pop((delivery.project, delivery.delivery_id), None)


class _Remembering:
    __slots__ = ("_listener", "_telemetry")

    def __init__(self, telemetry: Telemetry, listener: QueueListener) -> None:
        self._telemetry = telemetry
        self._listener = listener

    def queued(self, deliveries: Sequence[Delivery]) -> None:
        self._telemetry._remember(deliveries)
        self._listener.queued(deliveries)


def _root() -> Context:
    """An empty context: a delivery's span starts a trace of its own (linked to the end, not inside it)."""
    from opentelemetry.context import Context

    return Context()


@contextlib.contextmanager
def _failures_marked(span: Span) -> Iterator[None]:
    """An exception out of the block marks ``span`` failed with its type only (``error.type``): its message
    may quote input, and is never recorded."""
    try:
        yield
    except BaseException as exc:
        from opentelemetry.trace import StatusCode

        span.set_attribute("error.type", type(exc).__qualname__)
        span.set_status(StatusCode.ERROR)
        raise
