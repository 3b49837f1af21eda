"""Application factory: everything is built here from Settings; nothing at import time."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from .config import Settings
from .domain.analytics import AnalyticsService
from .domain.clock import Clock, SystemClock
from .domain.conversations import ConversationService
from .domain.identifiers import Pseudonymizer
from .domain.limits import MAX_BODY_BYTES
from .domain.memory import MemoryService
from .domain.registry import ProjectRegistry
from .domain.tokens import TokenService
from .http.analytics_routes import routes as analytics_routes
from .http.keys import SERVICES, Services
from .http.middleware import problem_middleware
from .http.routes import routes
from .storage import open_store
from .storage.base import Store


def build_services(settings: Settings, *, clock: Clock | None = None, store: Store | None = None) -> Services:
    clock = clock or SystemClock()
    store = store or open_store(settings.store_url, timeout=settings.store_timeout)
    pseudonymizer = Pseudonymizer(settings.pseudonym_key)
    memory = MemoryService(store, pseudonymizer, clock)
    analytics = AnalyticsService(store)
    return Services(
        settings=settings,
        clock=clock,
        store=store,
        projects=ProjectRegistry(store, pseudonymizer, clock, settings.config_cache_seconds),
        tokens=TokenService(store, clock, settings.operator_token, settings.token_cache_seconds),
        memory=memory,
        analytics=analytics,
        conversations=ConversationService(store, memory, analytics, clock),
    )


def create_app(
    settings: Settings, *, clock: Clock | None = None, store: Store | None = None
) -> web.Application:
    """Build the service. ``clock`` and ``store`` may be injected (tests); the store is opened on startup."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[problem_middleware])
    services = build_services(settings, clock=clock, store=store)
    app[SERVICES] = services

    async def store_lifecycle(app: web.Application) -> AsyncIterator[None]:
        await services.store.open()
        yield
        await services.store.close()

    app.cleanup_ctx.append(store_lifecycle)
    app.add_routes(routes)
    app.add_routes(analytics_routes)
    return app
