"""Typed application state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from ..config import Settings
from ..domain.analytics import AnalyticsService
from ..domain.archive import Archive
from ..domain.audit import AuditLog
from ..domain.clock import Clock
from ..domain.conversations.ending import ConversationService
from ..domain.conversations.lifecycle import Lifecycle
from ..domain.conversations.pending import PendingAnswers
from ..domain.conversations.service import TranscriptService
from ..domain.errors import StoreUnavailable
from ..domain.links import LinkService
from ..domain.memory import MemoryService
from ..domain.registry import ProjectRegistry
from ..domain.retention import Sweeper
from ..domain.store import Store
from ..domain.tokens import TokenService
from ..domain.webhooks.delivery import Deliverer
from ..domain.webhooks.service import WebhookService
from ..telemetry import Telemetry
from .metrics import Metrics
from .webhook_sender import HttpSender


@dataclass(frozen=True, slots=True)
class Services:
    settings: Settings
    clock: Clock
    store: Store
    projects: ProjectRegistry
    tokens: TokenService
    memory: MemoryService
    analytics: AnalyticsService
    audit: AuditLog
    sweeper: Sweeper
    conversations: ConversationService
    transcripts: TranscriptService
    lifecycle: Lifecycle
    archive: Archive
    links: LinkService
    #: The memory proxy's last answer of each call, recorded at its end.
    pending: PendingAnswers

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(self.settings.store_timeout):
                await self.store.ping()
        except TimeoutError as exc:
            raise StoreUnavailable(
                f"the store did not answer within {self.settings.store_timeout} s"
            ) from exc


@dataclass(frozen=True, slots=True)
class Webhooks:
    """The webhook side of one process: the use cases, the delivery worker and its HTTP client. The event
    that wakes the worker is its :class:`~caller_memory.service.domain.webhooks.delivery.Slots`' (set when
    something queued here could start now, or an attempt ended)."""

    service: WebhookService
    deliverer: Deliverer
    sender: HttpSender

    @property
    def event(self) -> asyncio.Event:
        return self.deliverer.slots.event

    def wake(self) -> None:
        self.event.set()

    def changed(self) -> None:
        """An endpoint was created, rotated or deleted by this process: the worker reads them again."""
        self.deliverer.forget_endpoints()
        self.wake()


SERVICES = web.AppKey("services", Services)
WEBHOOKS = web.AppKey("webhooks", Webhooks)
METRICS = web.AppKey("metrics", Metrics)
#: The app's tracing (off unless the OTEL_* variables or the application turned it on).
TELEMETRY = web.AppKey("telemetry", Telemetry)
