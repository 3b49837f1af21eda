"""An OpenAI-compatible upstream on loopback for the proxy's tests, where a test needs what the scripted model
does not do: exact bytes, pauses, errors, gzip, and knowing when the proxy closed its connection."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]

EVENTS = [
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":"Hello \xc3\xa9t\xc3\xa9"},"finish_reason":null}]}\n\n',
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]
COMPLETION = {
    "id": "c2",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Cheddar."}, "finish_reason": "stop"}
    ],
}


@dataclass
class Got:
    headers: dict[str, str]
    body: bytes

    @property
    def document(self) -> dict[str, Any]:
        found: dict[str, Any] = orjson.loads(self.body)
        return found


@dataclass
class Upstream:
    """Answers each request with the next of ``answers`` (then :func:`events`); keeps what it got, when each
    answer's first event was sent, and when a handler was cancelled (the proxy closed the connection)."""

    answers: list[Answer] = field(default_factory=list)
    got: list[Got] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    cancelled_at: list[float] = field(default_factory=list)
    url: str = ""
    #: Bytes a :func:`flood` answer has written.
    written: int = 0
    #: Set when a handler was cancelled.
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.got.append(Got(dict(request.headers), await request.read()))
        answer = self.answers.pop(0) if self.answers else events()
        try:
            return await answer(request)
        except asyncio.CancelledError:
            self.cancelled_at.append(time.monotonic())
            self.closed.set()
            raise


def events(pause: float = 0.0, hold: asyncio.Event | None = None, up: Upstream | None = None) -> Answer:
    """The stream :data:`EVENTS`: after the first event, ``pause`` seconds (or until ``hold`` is set)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index, event in enumerate(EVENTS):
            await response.write(event)
            if index == 0:
                if up is not None:
                    up.sent_at.append(time.monotonic())
                if hold is not None:
                    await hold.wait()
                if pause:
                    await asyncio.sleep(pause)
        await response.write_eof()
        return response

    return answer


def silent(hold: asyncio.Event) -> Answer:
    """Nothing at all (not even the answer's head) until ``hold`` is set."""

    async def answer(request: web.Request) -> web.StreamResponse:
        await hold.wait()
        return await events()(request)

    return answer


def flood(total: int, up: Upstream) -> Answer:
    """A stream of ``total`` bytes in 64 KiB events, written as fast as the reader takes them; the bytes
    written so far are counted in ``up.written``."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
        while up.written < total:
            await response.write(chunk)
            up.written += len(chunk)
        await response.write_eof()
        return response

    return answer


def status(code: int, headers: dict[str, str] | None = None) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        body = {"error": {"message": f"upstream says {code}", "type": "x", "code": None}}
        return web.json_response(body, status=code, headers=headers)

    return answer


def gzipped() -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        body = gzip.compress(orjson.dumps(COMPLETION))
        return web.Response(
            body=body, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}
        )

    return answer


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", up.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    try:
        yield up
    finally:
        await runner.cleanup()
