"""Prometheus metrics: one registry per application (no process globals), served at ``/metrics``.

Labels are route templates, methods, statuses and kinds of things: never an identifier, a project's
caller or a token.

Several processes (``serve --workers N``, N > 1): each worker is a separate process behind one port, so a
scrape reaches one of them at random. The supervisor then sets ``PROMETHEUS_MULTIPROC_DIR`` to a fresh
directory for its workers; prometheus_client sees it when it is imported and keeps every value in a file
there, and ``/metrics`` serves the sum over all workers (dead ones included, so counters never go back),
from whichever worker answers. One gauge is added in that mode, ``caller_memory_worker_requests``, per
live worker (``pid`` label): it shows how connections are spread over the workers. Without the variable
nothing changes: values live in memory and the per-request path is the same code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector


def multiprocess_dir() -> str | None:
    """The directory of prometheus_client's multi-process mode, if this process runs in it (the variables
    prometheus_client itself reads when it is imported)."""
    # prometheus_client still honours the lower-case spelling (deprecated), so this must too.
    names = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
    return next((value for value in map(os.environ.get, names) if value), None)


#: The kinds of ``caller_memory_platform_events_total``, as the platform ingestion reports them.
PLATFORM_EVENT_KINDS = ("clamped_time", "failed_open", "transcript_refused")
#: Latency buckets for a service whose reads should take a few milliseconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "caller_memory_http_requests",
            "HTTP requests handled, by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "caller_memory_http_request_duration_seconds",
            "Time to handle an HTTP request, by route template and method.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.store_errors = Counter(
            "caller_memory_store_errors",
            "Requests that failed because the store was unavailable or unreadable, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.sweeps = Counter(
            "caller_memory_sweeps",
            "Expiry sweeps, by outcome (completed, skipped: another replica held the lease, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.inactivity_ends = Counter(
            "caller_memory_inactivity_ends",
            "Conversations the service ended after end_after_inactivity (ended), and runs of the inactivity "
            "ends that another replica's lease skipped (skipped) or that failed (failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.webhook_attempts = Counter(
            "caller_memory_webhook_attempts",
            "Webhook delivery attempts, by event and outcome (delivered; retry: failed, another attempt is "
            "queued; failed: the last attempt failed, the delivery is listed as failed; dropped: deleted or "
            "erased before it was sent; store_error: the store failed, the lease runs out and it is retried; "
            "cancelled: the process stopped during the attempt, which is made again).",
            ["event", "outcome"],
            registry=self.registry,
        )
        self.webhook_attempt_seconds = Histogram(
            "caller_memory_webhook_attempt_duration_seconds",
            "Time one webhook attempt took (signing, sending, settling).",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.webhook_queue = Gauge(
            "caller_memory_webhook_deliveries",
            "Webhook deliveries in the store's queue now, by status (queued, failed); every process reports "
            "the same store-wide figure.",
            ["status"],
            multiprocess_mode="max",
            registry=self.registry,
        )
        self.webhook_queue_age = Gauge(
            "caller_memory_webhook_queue_age_seconds",
            "Age of the oldest queued webhook delivery (0 when none is queued).",
            multiprocess_mode="max",
            registry=self.registry,
        )
        self.swept = Counter(
            "caller_memory_swept_items",
            "Items removed by expiry sweeps, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.sweep_duration = Histogram(
            "caller_memory_sweep_duration_seconds",
            "Time a completed sweep took.",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self.read_cache = Counter(
            "caller_memory_read_cache_reads",
            "Memory reads with the read cache on (CALLER_MEMORY_READ_CACHE_SECONDS), by outcome: hit (answered "
            "from the cache, no store round trip) or miss (read from Redis). Brought up to date at each scrape "
            "and every few seconds.",
            ["outcome"],
            registry=self.registry,
        )
        self._read_cache_source: Callable[[], tuple[int, int] | None] | None = None
        self._read_cache_seen = (0, 0)
        self.erasures = Counter(
            "caller_memory_erasures", "Callers erased on request.", registry=self.registry
        )
        self.platform_events = Counter(
            "caller_memory_platform_events",
            "What the platform ingestion rules met, by kind: clamped_time (an end time outside the call, "
            "clamped), failed_open (a call start answered without memory: the store slow or down), "
            "transcript_refused (an end event's transcript the conversation refused; its state still applied).",
            ["kind"],
            registry=self.registry,
        )
        for kind in PLATFORM_EVENT_KINDS:
            self.platform_events.labels(kind=kind)  # shown at 0 before the first
        self.connections_closed = Counter(
            "caller_memory_connections_closed",
            "Connections the server closed to protect itself, by reason (header_timeout: no complete request "
            "head within CALLER_MEMORY_HEADER_TIMEOUT; over_limit: the oldest waiting one, to stay within "
            "CALLER_MEMORY_MAX_CONNECTIONS).",
            ["reason"],
            registry=self.registry,
        )
        self.open_connections = Gauge(
            "caller_memory_open_connections",
            "HTTP connections open now (summed over the workers with --workers > 1).",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.spans_dropped = Counter(
            "caller_memory_spans_dropped",
            "OpenTelemetry spans dropped because the export queue was full (the collector down or slow; "
            "OTEL_BSP_MAX_QUEUE_SIZE bounds the queue). Brought up to date at each scrape.",
            registry=self.registry,
        )
        self._dropped_source: Callable[[], int] | None = None
        self._dropped_seen = 0
        self._exposed = self.registry
        shared = multiprocess_dir()
        if shared is not None:
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=shared)  # type: ignore[no-untyped-call]
            # "liveall": one series per live worker, labelled with its pid by the collector, removed when
            # the supervisor marks the worker dead.
            self._worker_requests = Gauge(
                "caller_memory_worker_requests",
                "Requests handled by each live worker process since it started (with --workers > 1).",
                multiprocess_mode="liveall",
                registry=self.registry,
            )
            # Chosen once here, so the single-process path does not test for this mode on every request.
            self.observe = self._observe_in_worker  # type: ignore[method-assign]

    def observe(self, request: web.Request, status: int, started: float) -> None:
        """Count and time one request, by route template (never the path), method and status."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "<unmatched>"
        # Label children are looked up once per (route, method, status) and kept: labels() costs a lock and
        # a tuple per call, on every request.
        key = (route, request.method, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(route, request.method, str(status)),
                self.latency.labels(route, request.method),
            )
        children[0].inc()
        children[1].observe(time.perf_counter() - started)

    def _observe_in_worker(self, request: web.Request, status: int, started: float) -> None:
        Metrics.observe(self, request, status, started)
        self._worker_requests.inc()

    def count_read_cache(self, source: Callable[[], tuple[int, int] | None]) -> None:
        """Publish the read cache's counts (hits, misses: running totals) that ``source`` returns."""
        self._read_cache_source = source
        self.publish_read_cache()

    def publish_read_cache(self) -> None:
        """Add what the read cache counted since the last call to ``caller_memory_read_cache_reads``."""
        counts = self._read_cache_source() if self._read_cache_source is not None else None
        if counts is None:
            return
        (hits, misses), (seen_hits, seen_misses) = counts, self._read_cache_seen
        if hits > seen_hits:
            self.read_cache.labels("hit").inc(hits - seen_hits)
        if misses > seen_misses:
            self.read_cache.labels("miss").inc(misses - seen_misses)
        self._read_cache_seen = (max(hits, seen_hits), max(misses, seen_misses))

    def count_dropped_spans(self, source: Callable[[], int]) -> None:
        """Publish the spans the tracer provider dropped (``source``: a running total) at each scrape."""
        self._dropped_source = source

    def publish_dropped_spans(self) -> None:
        total = self._dropped_source() if self._dropped_source is not None else 0
        if total > self._dropped_seen:
            self.spans_dropped.inc(total - self._dropped_seen)
            self._dropped_seen = total

    def response(self) -> web.Response:
        self.publish_read_cache()
        self.publish_dropped_spans()
        response = web.Response(body=generate_latest(self._exposed))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
