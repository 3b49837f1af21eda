"""Application factory: everything is built here from Settings; nothing at import time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Middleware
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from .config import Settings
from .domain.analytics import AnalyticsService
from .domain.archive import Archive
from .domain.audit import AuditLog
from .domain.clock import Clock, SystemClock
from .domain.conversations.ending import ConversationService
from .domain.conversations.lifecycle import Lifecycle, ServiceEnds
from .domain.conversations.pending import PendingAnswers
from .domain.conversations.remembered import RememberedState
from .domain.conversations.service import TranscriptService
from .domain.errors import CallerMemoryError
from .domain.identifiers import Pseudonymizer
from .domain.limits import MAX_BODY_BYTES
from .domain.links import LinkService
from .domain.memory import MemoryService
from .domain.platforms.ingestion import PlatformIngestion
from .domain.platforms.service import PlatformConnections
from .domain.registry import ProjectRegistry
from .domain.retention import Sweeper
from .domain.sealing import Sealer
from .domain.store import Store
from .domain.tokens import TokenService
from .domain.webhooks.delivery import Deliverer, Slots
from .domain.webhooks.policy import WebhookPolicy
from .domain.webhooks.secrets import SecretBox
from .domain.webhooks.service import WebhookService
from .http.admin_routes import record_sweep_metrics
from .http.app_keys import METRICS, SERVICES, TELEMETRY, WEBHOOKS, Services, Webhooks
from .http.mcp_routes import MCP, mcp_lifecycle
from .http.metrics import Metrics
from .http.middleware import service_middleware
from .http.openapi import ROUTE_TABLES
from .http.platform_routes import INGESTION, PLATFORMS
from .http.proxy_routes import PROXY, build_proxy
from .http.tracing import tracing_middleware
from .http.webhook_sender import HttpSender
from .logs import install_log_masking
from .mcp.agent_tools import McpDomain
from .mcp.servers import build_servers
from .storage import open_store
from .storage.archive_objects import ArchiveObjects
from .telemetry import Telemetry

log = logging.getLogger("caller_memory")

#: Seconds between two publications of the read cache's counters to ``/metrics``.
READ_CACHE_METRICS_S = 5.0


def store_of(settings: Settings) -> Store:
    """The store ``settings`` name (opened on the app's startup)."""
    return open_store(
        settings.store_url,
        timeout=settings.store_timeout,
        cache_seconds=settings.read_cache_seconds,
        cache_entries=settings.read_cache_entries,
        decimal_times=settings.redis_decimal_times,
    )


def build_services(
    settings: Settings,
    *,
    clock: Clock | None = None,
    store: Store | None = None,
    webhooks: WebhookService | None = None,
    audit: AuditLog | None = None,
) -> Services:
    """The use cases, each given its listeners at construction: so the listeners come first (the archive,
    and ``webhooks`` where the app has them: :func:`build_webhook_service`), then the use cases that tell
    them (memory's erasure, the ends, the transcripts' deletions). ``audit``: the log ``webhooks`` records
    in, when it is given."""
    clock = clock or SystemClock()
    store = store or store_of(settings)
    audit = audit or AuditLog(store, clock)
    pseudonymizer = Pseudonymizer(settings.pseudonym_key)
    archive = Archive(
        store, ArchiveObjects(settings.archive_url, timeout=max(5.0, settings.store_timeout)), clock
    )
    # The memory proxy's last answer of each call, recorded at the call's end (and dropped by an erasure).
    pending = PendingAnswers(store, clock)
    # The state keys remembered through MCP, persisted by the call's end (dropped by an erasure, a deletion).
    remembered = RememberedState(store, clock)
    # An erased caller's archived conversations go, then their webhook deliveries, then their calls' last
    # answers kept for the proxy.
    memory = MemoryService(
        store,
        pseudonymizer,
        clock,
        audit=audit,
        erasure_listeners=(archive, pending, remembered)
        if webhooks is None
        else (archive, webhooks, pending, remembered),
        erased_event=webhooks,
    )
    analytics = AnalyticsService(store)
    # Promote, then archive (the end's memory writes are done by then), then queue the webhooks.
    conversations = ConversationService(
        store,
        memory,
        analytics,
        clock,
        listeners=(archive,),
        deliveries=webhooks,
        pending=pending,
        remembered=remembered,
    )
    # The service's ends first: the transcripts tell them of each conversation an append started.
    ends = ServiceEnds(store, conversations, analytics, clock, pending=pending)
    transcripts = TranscriptService(
        store,
        memory,
        conversations,
        analytics,
        clock,
        audit=audit,
        deletion_listeners=(archive, remembered),
        started=ends,
    )
    return Services(
        settings=settings,
        clock=clock,
        store=store,
        projects=ProjectRegistry(store, pseudonymizer, clock, settings.config_cache_seconds, audit),
        tokens=TokenService(store, clock, settings.operator_token, settings.token_cache_seconds, audit),
        memory=memory,
        analytics=analytics,
        conversations=conversations,
        transcripts=transcripts,
        lifecycle=Lifecycle(store, transcripts, ends, clock),
        audit=audit,
        sweeper=Sweeper(store, clock, batch=settings.sweep_batch, archive=archive),
        archive=archive,
        links=LinkService(store, memory, audit, clock),
        pending=pending,
    )


def build_platforms(settings: Settings, services: Services) -> PlatformConnections:
    """Platform connections, their secrets sealed with the operator's key (the previous ones still open)."""
    sealer = Sealer(settings.secret_key, settings.previous_secret_keys)
    return PlatformConnections(services.store, sealer, services.clock, audit=services.audit)


def build_ingestion(settings: Settings, services: Services, metrics: Metrics) -> PlatformIngestion:
    """The ingestion rules of platform webhooks; a held end's caller sealed with the operator's key; what
    they meet counted in the metrics."""
    sealer = Sealer(settings.secret_key, settings.previous_secret_keys)
    return PlatformIngestion(
        services.store,
        services.memory,
        services.transcripts,
        services.lifecycle,
        services.conversations,
        services.clock,
        sealer,
        observe=lambda kind: metrics.platform_events.labels(kind=kind).inc(),
    )


def create_app(
    settings: Settings,
    *,
    clock: Clock | None = None,
    store: Store | None = None,
    telemetry: Telemetry | None = None,
) -> web.Application:
    """Build the service. ``clock`` and ``store`` may be injected (tests); the store is opened on startup.
    ``telemetry``: tracing as the ``OTEL_*`` variables ask unless given (:mod:`.telemetry`)."""
    install_log_masking()
    metrics = Metrics()
    telemetry = telemetry or Telemetry.from_environment()
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=middlewares_of(settings, metrics, telemetry)
    )
    clock = clock or SystemClock()
    store = telemetry.traced_store(store or store_of(settings), store_system(store, settings))
    # The worker's slots first: the use cases that queue wake it through them, and so do its attempts.
    slots = Slots(settings.webhook_concurrency)
    audit = AuditLog(store, clock)
    webhook_service = build_webhook_service(
        settings, store, clock, slots=slots, audit=audit, telemetry=telemetry
    )
    services = build_services(settings, clock=clock, store=store, webhooks=webhook_service, audit=audit)
    app[SERVICES] = services
    app[METRICS] = metrics
    app[WEBHOOKS] = webhooks = build_webhooks(
        settings, services, metrics, service=webhook_service, slots=slots, telemetry=telemetry
    )
    app[PLATFORMS] = build_platforms(settings, services)
    app[INGESTION] = build_ingestion(settings, services, metrics)
    # The memory proxy's upstreams follow the webhooks' destination rules (and their allow list).
    app[PROXY] = proxy = build_proxy(settings, services, metrics, webhook_service.policy, telemetry)
    app[TELEMETRY] = telemetry
    # Caller Memory as MCP tools (the official SDK's servers, run by a cleanup context).
    domain = McpDomain(
        services.store, clock, services.memory, services.transcripts, services.audit, telemetry.tool_span
    )
    app[MCP] = mcp_servers = build_servers(domain, settings.pseudonym_key)

    async def store_lifecycle(app: web.Application) -> AsyncIterator[None]:
        await services.store.open()
        publisher = None
        if services.store.read_cache_counts() is not None:
            metrics.count_read_cache(services.store.read_cache_counts)
            publisher = asyncio.create_task(publish_read_cache(metrics))
        yield
        if publisher is not None:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher
        await services.store.close()

    async def sweep_schedule(app: web.Application) -> AsyncIterator[None]:
        # Sweeps run inside the service; the store's lease keeps replicas from sweeping at once.
        scheduler = AsyncIOScheduler()
        if settings.sweep_interval > 0:
            scheduler.add_job(
                scheduled_sweep,
                IntervalTrigger(
                    seconds=settings.sweep_interval, jitter=min(30.0, settings.sweep_interval / 10)
                ),
                args=[app],
                max_instances=1,
                coalesce=True,
                id="sweep",
            )
        if settings.inactivity_interval > 0:
            # Conversations nobody ended: due ones are found by the store's due index, under a lease.
            scheduler.add_job(
                scheduled_inactivity_ends,
                IntervalTrigger(seconds=settings.inactivity_interval),
                args=[app],
                max_instances=1,
                coalesce=True,
                id="inactivity",
            )
        if scheduler.get_jobs():
            scheduler.start()
        yield
        if scheduler.running:
            scheduler.shutdown(wait=False)

    async def delivery_worker(app: web.Application) -> AsyncIterator[None]:
        task = None
        if settings.webhook_interval > 0:
            task = asyncio.create_task(run_deliveries(app, settings.webhook_interval))
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await webhooks.deliverer.stop()
        await webhooks.sender.close()

    app.cleanup_ctx.append(store_lifecycle)
    app.cleanup_ctx.append(proxy.lifecycle)  # closed before the store: its transcript writes finish first
    app.cleanup_ctx.append(mcp_lifecycle(mcp_servers))
    app.cleanup_ctx.append(sweep_schedule)
    app.cleanup_ctx.append(delivery_worker)
    # After every cleanup context (the store closed): the spans of the shutdown are exported too.
    app.on_cleanup.append(lambda app: telemetry.shutdown())
    for table in ROUTE_TABLES:  # the same tables /openapi.json is assembled from
        app.add_routes(table)
    return app


def middlewares_of(settings: Settings, metrics: Metrics, telemetry: Telemetry) -> list[Middleware]:
    """The service's middleware, and with tracing on the span's before it (outside: it sees the answer the
    service's middleware made of an error). Off, a request goes through one middleware fewer."""
    middlewares = [
        service_middleware(
            metrics,
            settings.max_in_flight,
            project_limit=settings.project_in_flight,
            body_timeout=settings.body_timeout,
        )
    ]
    if telemetry.on:
        middlewares.insert(0, tracing_middleware(telemetry))
        metrics.count_dropped_spans(telemetry.dropped)
    return middlewares


def store_system(store: Store | None, settings: Settings) -> str:
    """The store's kind, as spans name it (``db.system.name``): ``sqlite`` or ``redis``."""
    if store is not None:
        return "sqlite" if "sqlite" in type(store).__module__ else "redis"
    return "sqlite" if settings.store_url.lower().startswith("sqlite") else "redis"


def build_webhook_service(
    settings: Settings,
    store: Store,
    clock: Clock,
    *,
    slots: Slots,
    audit: AuditLog,
    telemetry: Telemetry | None = None,
) -> WebhookService:
    """The webhooks' use cases, which the use cases that make events (ends, erasures) are given; what they
    queue wakes the delivery worker through ``slots`` (and, with tracing on, is linked to the span that
    queued it)."""
    return WebhookService(
        store,
        SecretBox(settings.secret_key, settings.previous_secret_keys),
        WebhookPolicy.allowing(settings.webhook_allow_hosts),
        clock,
        audit=audit,
        history_allowed=settings.webhook_history,
        listener=telemetry.remembering(slots) if telemetry is not None else slots,
        cache_seconds=settings.config_cache_seconds,
    )


def build_webhooks(
    settings: Settings,
    services: Services,
    metrics: Metrics,
    *,
    service: WebhookService,
    slots: Slots,
    telemetry: Telemetry | None = None,
) -> Webhooks:
    """The webhook side of the process: ``service`` (:func:`build_webhook_service`), its delivery worker
    (on the ``slots`` that ``service`` wakes it through) and its HTTP client."""
    sender = HttpSender(service.policy)

    def observe(event: str, outcome: str, seconds: float) -> None:
        metrics.webhook_attempts.labels(event, outcome).inc()
        metrics.webhook_attempt_seconds.observe(seconds)
        slots.wake()  # a slot is free again

    deliverer = Deliverer(
        service,
        sender,
        services.clock,
        owner=services.sweeper.holder,
        slots=slots,
        timeout=settings.webhook_timeout,
        observe=observe,
        trace=telemetry if telemetry is not None and telemetry.on else None,
    )
    return Webhooks(service, deliverer, sender)


#: Seconds between refreshes of the queue's gauges.
QUEUE_STATS_S = 10.0


async def publish_read_cache(metrics: Metrics) -> None:
    """The read cache's counters, every few seconds (a scrape brings them up to date as well, in the process
    that answers it; with ``--workers N`` the others' are at most this old)."""
    while True:
        await asyncio.sleep(READ_CACHE_METRICS_S)
        metrics.publish_read_cache()


async def run_deliveries(app: web.Application, interval: float) -> None:
    """The delivery worker: claims what is due, at once when this process queued something (or an attempt
    ended), else every ``interval`` seconds; the queue's gauges every ten seconds."""
    webhooks, metrics = app[WEBHOOKS], app[METRICS]
    stats_at = float("-inf")
    while True:
        webhooks.event.clear()
        started = 0
        try:
            started = await webhooks.deliverer.run_once()
            if time.monotonic() - stats_at >= QUEUE_STATS_S:
                stats = await webhooks.service.store.queue_stats(app[SERVICES].clock.now_ms())
                metrics.webhook_queue.labels("queued").set(stats.queued)
                metrics.webhook_queue.labels("failed").set(stats.failed)
                now_ms = app[SERVICES].clock.now_ms()
                age = (now_ms - stats.oldest_queued_at) / 1000 if stats.oldest_queued_at else 0.0
                metrics.webhook_queue_age.set(max(0.0, age))
                stats_at = time.monotonic()
        except CallerMemoryError as exc:
            log.warning("webhook deliveries: %s", exc.detail)
        except Exception:  # a bug must not stop every later delivery of this process
            log.exception("webhook deliveries: unexpected error; retrying in %g s", interval)
        if started:
            await asyncio.sleep(0)  # more may be due: look again, after letting requests run
            continue
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that comes in the turn
        # the wait ends (shutdown cancels this task just as an attempt ends), and the worker would run on.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval):
                await webhooks.event.wait()


async def scheduled_sweep(app: web.Application) -> None:
    metrics = app[METRICS]
    try:
        with app[TELEMETRY].span("sweep"):
            report = await app[SERVICES].sweeper.run()
    except CallerMemoryError as exc:
        metrics.sweeps.labels("failed").inc()
        log.warning("scheduled sweep failed: %s", exc.detail)
        return
    if report is None:
        metrics.sweeps.labels("skipped").inc()
    else:
        record_sweep_metrics(app, report.removed, report.duration_ms)


async def scheduled_inactivity_ends(app: web.Application) -> None:
    # One span per run: the webhook deliveries of the ends it makes link to it.
    with app[TELEMETRY].span("inactivity ends"):
        await _inactivity_ends(app)


async def _inactivity_ends(app: web.Application) -> None:
    services = app[SERVICES]
    # Platform calls whose analysis did not come within analysis_grace end first (held in the store: any
    # replica runs them, after a restart too; each is taken by one).
    try:
        held = await app[INGESTION].run_held_ends(services.projects)
    except CallerMemoryError as exc:
        log.warning("held platform ends failed: %s", exc.detail)
    else:
        if held:
            log.info("ended %d platform call(s) whose analysis did not come", held)
    try:
        ended = await services.lifecycle.run_due(services.projects, services.sweeper.holder)
    except CallerMemoryError as exc:
        app[METRICS].inactivity_ends.labels("failed").inc()
        log.warning("inactivity ends failed: %s", exc.detail)
        return
    if ended is None:
        app[METRICS].inactivity_ends.labels("skipped").inc()
    elif ended:
        app[METRICS].inactivity_ends.labels("ended").inc(ended)
        log.info("ended %d conversation(s) after their end_after_inactivity", ended)
