"""Fixtures of the SDK tests: misbehaving servers on real loopback sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serve = Callable[[Handler], Awaitable[str]]


def valid_end(request: web.Request) -> dict[str, Any]:
    """The documented answer to the end of the conversation a request to a fake service names."""
    return {
        "conversation_id": request.match_info["tail"].split("/")[-2],
        "persisted": ["booking_day"],
        "ignored": [],
        "blacklisted": False,
        "erased": False,
        "repeat_caller": {},
    }


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Serve one handler for every path on a real socket; yields a function returning the base URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)  # no wait for hung handlers
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()
