"""Typed application state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from ..config import Settings
from ..domain.analytics import AnalyticsService
from ..domain.clock import Clock
from ..domain.conversations import ConversationService
from ..domain.errors import StoreUnavailable
from ..domain.lifecycle import Lifecycle
from ..domain.memory import MemoryService
from ..domain.registry import ProjectRegistry
from ..domain.retention import AuditLog, Sweeper
from ..domain.store import Store
from ..domain.tokens import TokenService
from ..domain.transcript_service import TranscriptService
from .metrics import Metrics


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

    async def ping(self) -> None:
        try:
            await asyncio.wait_for(self.store.ping(), self.settings.store_timeout)
        except TimeoutError as exc:
            raise StoreUnavailable(
                f"the store did not answer within {self.settings.store_timeout} s"
            ) from exc


SERVICES = web.AppKey("services", Services)
METRICS = web.AppKey("metrics", Metrics)
