"""Fixtures of the SDK tests: misbehaving servers on real loopback sockets, and a switchable proxy in front of
the real service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import Api

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


class Forwarder:
    """A proxy in front of the real service that can be switched: ``open`` forwards, ``down`` answers 503 at
    once (the service never sees the request), ``hang`` holds requests until switched back. ``seen`` lists
    the (method, path) of every request that reached it, forwarded or not."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.mode = "open"
        self.seen: list[tuple[str, str]] = []
        self._opened = asyncio.Event()

    def switch(self, mode: str) -> None:
        self.mode = mode
        if mode == "open":
            self._opened.set()
        else:
            self._opened.clear()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path))
        if self.mode == "hang":
            await self._opened.wait()
        if self.mode == "down":
            return web.Response(status=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.session.request(
            request.method,
            self.target + request.raw_path,
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as resp:
            body = await resp.read()
            kept = ("Content-Type", "ETag", "Idempotent-Replayed", "Retry-After")
            return web.Response(
                status=resp.status, body=body, headers={k: resp.headers[k] for k in kept if k in resp.headers}
            )


@pytest.fixture
async def forwarder(api: Api, serve: Serve) -> AsyncIterator[tuple[Forwarder, str]]:
    """A :class:`Forwarder` in front of the ``api`` service, and its URL."""
    async with aiohttp.ClientSession() as session:
        proxy = Forwarder(api.base_url, session)
        yield proxy, await serve(proxy.handle)
        proxy.switch("open")
