"""A small ASGI bridge: an aiohttp request served by an ASGI application (the ``mcp`` SDK's Streamable HTTP
session manager), on the same event loop, streaming both ways.

- ``receive`` hands the body over in the chunks it arrives in, then reports ``http.disconnect`` only when
  the client has gone (checked every :data:`DISCONNECT_POLL_S` while the application waits for it), never
  as soon as the body ends: an application that waits for a disconnect while it streams is not cut short.
- ``send`` starts the aiohttp response at ``http.response.start`` and writes each body chunk as it comes
  (an SSE stream flows as it is written), waiting for the transport's buffer to drain.

The path the application sees holds no caller data (``/v1/projects/{p}/mcp``); the scope carries whatever
the route adds (``extra``: the connection the route bound the request to).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from aiohttp import web

from ..domain.errors import PayloadTooLarge

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
AsgiApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]

#: Seconds between two checks of whether the client has gone, while the application waits for it.
DISCONNECT_POLL_S = 0.1
#: Headers that belong to one hop (aiohttp writes its own framing).
_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"})


def _scope(request: web.Request, extra: Mapping[str, Any]) -> Scope:
    host, port = (
        (request.transport.get_extra_info("sockname") or ("", 0))[:2] if request.transport else ("", 0)
    )
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.encode("latin-1"),
        "query_string": request.query_string.encode("latin-1"),
        "root_path": "",
        "headers": [(name.lower(), value) for name, value in request.raw_headers],
        "client": tuple(peer[:2]) if isinstance(peer, tuple) else None,
        "server": (host, port),
        "state": {},
        **extra,
    }


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _Exchange:
    """One request's ``receive`` and ``send``."""

    def __init__(self, request: web.Request, max_body: int) -> None:
        self.request = request
        self.max_body = max_body
        self.response: web.StreamResponse | None = None
        self.body_done = False
        self.received = 0

    async def receive(self) -> Message:
        request = self.request
        if not self.body_done:
            chunk = await request.content.readany()
            self.received += len(chunk)
            if self.received > self.max_body:  # a body sent in chunks, without its length
                raise PayloadTooLarge(f"the body is over {self.max_body:,} bytes")
            self.body_done = request.content.at_eof()
            return {"type": "http.request", "body": chunk, "more_body": not self.body_done}
        # aiohttp tells a handler nothing when its client goes (handler_cancellation is off): look.
        while not _gone(request):  # noqa: ASYNC110
            await asyncio.sleep(DISCONNECT_POLL_S)
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            response = self.response = web.StreamResponse(status=int(message["status"]))
            for name, value in message.get("headers", ()):
                if bytes(name).lower() not in _HOP:
                    response.headers.add(bytes(name).decode("latin-1"), bytes(value).decode("latin-1"))
            await response.prepare(self.request)
        elif kind == "http.response.body":
            if self.response is None:
                raise RuntimeError("the ASGI application sent a body before starting its response")
            chunk = bytes(message.get("body", b""))
            if chunk:
                await self.response.write(chunk)
            if not message.get("more_body", False):
                await self.response.write_eof()


async def serve_asgi(
    request: web.Request, app: AsgiApp, extra: Mapping[str, Any], *, max_body: int
) -> web.StreamResponse:
    """Serve ``request`` with ``app``; the response it wrote (an empty 500 if it wrote none). A body over
    ``max_body`` bytes is refused (413, the service's problem document) before the application reads past it."""
    if request.content_length is not None and request.content_length > max_body:
        raise PayloadTooLarge(f"the body is over {max_body:,} bytes")
    exchange = _Exchange(request, max_body)
    await app(_scope(request, extra), exchange.receive, exchange.send)
    if exchange.response is None:  # the application answered nothing: never in the SDK
        return web.Response(status=500)
    return exchange.response
