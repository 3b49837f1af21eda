"""The service's own tracer provider, from the standard ``OTEL_*`` variables (imported only when tracing is
on: this module imports OpenTelemetry's SDK at its top).

The SDK reads most variables itself: ``OTEL_TRACES_SAMPLER`` (and its argument), ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*`` (the batch's queue, size and delay), ``OTEL_EXPORTER_OTLP_*``
(endpoint, headers, timeout). What is ours: the exporters ``OTEL_TRACES_EXPORTER`` may name (``otlp``, over
HTTP with protobuf, and ``console``; any other is refused with a warning), ``service.name`` defaulting to
``caller-memory``, and :class:`BoundedProcessor`, which keeps the export queue bounded and counts what it
drops, so that a collector that is down or slow costs a request nothing.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)

log = logging.getLogger("caller_memory.telemetry")

#: The batch processor's own default queue (OTEL_BSP_MAX_QUEUE_SIZE unset).
DEFAULT_QUEUE = 2048


class _Counted(SpanExporter):
    """``exporter``, telling ``done(n)`` of every batch it finished with (exported or not)."""

    def __init__(self, exporter: SpanExporter, done: Callable[[int], None]) -> None:
        self._exporter = exporter
        self._done = done

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            return self._exporter.export(spans)
        finally:
            self._done(len(spans))

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class BoundedProcessor(SpanProcessor):
    """A :class:`BatchSpanProcessor` whose queue is never full: a span that would overflow it is dropped
    here and counted (:attr:`dropped`), before the batch processor sees it. The batch processor would drop
    it too, but with a warning logged for every span, and uncounted; and its queue keeps the newest spans
    where this keeps the oldest, which does not matter for a queue that should never fill.

    Ending a span costs a lock and a deque append on the request's thread; exporting runs in the batch
    processor's thread, so a collector that hangs holds only that thread (for its export timeout,
    ``OTEL_EXPORTER_OTLP_TIMEOUT``), while requests go on and the spans beyond the queue are dropped."""

    def __init__(self, exporter: SpanExporter, queue_size: int, environ: Mapping[str, str]) -> None:
        self._size = queue_size
        #: Spans handed to the batch processor and not yet exported (queued, or in the batch being sent).
        self._pending = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._batch = BatchSpanProcessor(
            _Counted(exporter, self._sent),
            max_queue_size=queue_size,
            # Read from ``environ`` here (the processor itself reads os.environ), and never above the queue.
            max_export_batch_size=min(queue_size, _whole(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
            schedule_delay_millis=_whole(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000),
        )

    def _sent(self, count: int) -> None:
        with self._lock:
            self._pending -= count

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        with self._lock:
            if self._pending >= self._size:
                self.dropped += 1
                return
            self._pending += 1
        self._batch.on_end(span)

    def shutdown(self) -> None:
        self._batch.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


class HandedIds(RandomIdGenerator):
    """The provider's ids: random, as the SDK's own, except the next trace id when :class:`Roots` handed one
    (the id a request was sampled on is the id its span gets)."""

    def __init__(self) -> None:
        self.handed = 0

    def generate_trace_id(self) -> int:
        handed, self.handed = self.handed, 0
        return handed or super().generate_trace_id()


class Roots:
    """The sampler's decision for a request that starts a trace (no ``traceparent``), made before any span
    is: a random trace id and one comparison, the rule of the SDK's ``TraceIdRatioBased`` (a trace id whose
    low 64 bits are below ``ratio`` * 2^64 is sampled). A request left out then costs nothing of the SDK; one
    sampled hands its id to the provider (:class:`HandedIds`), whose sampler, deterministic on the id, decides
    the same. Made only for the samplers of ``OTEL_TRACES_SAMPLER`` whose root decision is such a ratio."""

    __slots__ = ("_bound", "_ids")

    def __init__(self, ratio: float, ids: HandedIds) -> None:
        self._bound = TraceIdRatioBased.get_bound_for_rate(ratio)
        self._ids = ids

    def sampled(self) -> bool:
        trace_id = random.getrandbits(128) or 1
        if trace_id & TraceIdRatioBased.TRACE_ID_LIMIT >= self._bound:
            return False
        self._ids.handed = trace_id
        return True


def sampler_of(environ: Mapping[str, str]) -> tuple[Sampler | None, float | None]:
    """The sampler ``OTEL_TRACES_SAMPLER`` (and ``_ARG``) name, and the ratio of its root decision: (None,
    None) for one the SDK reads itself (an entry point of another package)."""
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    try:
        ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
    except ValueError:
        ratio = 1.0  # as the SDK does with an argument it cannot read
    if not 0.0 <= ratio <= 1.0:
        ratio = 1.0
    known: dict[str, tuple[Sampler, float]] = {
        "always_on": (ALWAYS_ON, 1.0),
        "always_off": (ALWAYS_OFF, 0.0),
        "parentbased_always_on": (ParentBased(ALWAYS_ON), 1.0),
        "parentbased_always_off": (ParentBased(ALWAYS_OFF), 0.0),
        "traceidratio": (TraceIdRatioBased(ratio), ratio),
        "parentbased_traceidratio": (ParentBasedTraceIdRatio(ratio), ratio),
    }
    found = known.get(name)
    return found if found is not None else (None, None)


def exporter_named(name: str, environ: Mapping[str, str]) -> SpanExporter | None:
    """The exporter ``OTEL_TRACES_EXPORTER`` names (None, with a warning, for one this service does not ship)."""
    if name in ("otlp", "otlp_proto_http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # The exporter reads os.environ itself (headers, certificates...); the endpoint and the timeout are
        # taken from ``environ`` when it names them, so that what the app was built with is what it uses.
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if endpoint is None and environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        timeout = environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get(
            "OTEL_EXPORTER_OTLP_TIMEOUT"
        )
        return OTLPSpanExporter(endpoint=endpoint, timeout=_seconds(timeout))
    if name == "console":
        return ConsoleSpanExporter()
    log.warning(
        "OTEL_TRACES_EXPORTER names '%s', which this service does not ship: use otlp (OTLP over HTTP) or console",
        name[:40],
    )
    return None


def configured_provider(
    environ: Mapping[str, str], exporters: Sequence[str]
) -> tuple[TracerProvider, Callable[[], int], list[str], Roots | None]:
    """A provider exporting to ``exporters`` (names of ``OTEL_TRACES_EXPORTER``), how many spans it dropped so
    far (a function), the exporters it uses, and the root decision of its sampler (:class:`Roots`), when it
    has one. Not set as the global provider here; not shut down at the interpreter's exit (the service does
    it, within a bound: the SDK's own hook could wait 30 s)."""
    if environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        resource = Resource.create()
    else:
        resource = Resource.create({"service.name": "caller-memory"})
    sampler, ratio = sampler_of(environ)
    ids = HandedIds()
    provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False, id_generator=ids)
    queue_size = _queue_size(environ)
    processors: list[BoundedProcessor] = []
    used = []
    for name in exporters:
        exporter = exporter_named(name, environ)
        if exporter is not None:
            processor = BoundedProcessor(exporter, queue_size, environ)
            provider.add_span_processor(processor)
            processors.append(processor)
            used.append(name)
    if used:
        log.info("OpenTelemetry tracing on, exporting to %s", ", ".join(used))
    roots = Roots(ratio, ids) if ratio is not None else None
    return provider, lambda: sum(p.dropped for p in processors), used, roots


def _queue_size(environ: Mapping[str, str]) -> int:
    return _whole(environ, "OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_QUEUE)


def _whole(environ: Mapping[str, str], name: str, default: int) -> int:
    """A positive whole number from ``environ`` (``default`` when unset or not one, as the SDK does)."""
    try:
        value = int(environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


def _seconds(value: str | None) -> float | None:
    """``OTEL_EXPORTER_OTLP_TIMEOUT`` is in seconds for the Python exporter (None: its default, 10 s)."""
    try:
        return float(value) if value else None
    except ValueError:
        return None
