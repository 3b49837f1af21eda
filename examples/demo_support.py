"""What the examples' ``--demo`` modes share, so that they run offline with nothing but this repository:
Caller Memory embedded in the example's own process, and a small scripted model behind an OpenAI-compatible
``/v1/chat/completions`` (streamed). Neither is part of the SDK: a real agent talks to a running service and
a real model.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

#: A field of the caller memory message (``render_memory``) as the model reads it.
CALLER_NAME = re.compile(r'"caller_name":"([^"]*)"')
SAYS_NAME = re.compile(r"my name is (\w+)", re.IGNORECASE)
#: What the scripted model answers: a text, or the arguments of a ``save_name`` tool call.
Reply = tuple[str, dict[str, Any] | None]


@contextlib.asynccontextmanager
async def embedded_service(
    workdir: Path, project: str, config: dict[str, Any], **settings: Any
) -> AsyncIterator[tuple[str, str]]:
    """Caller Memory in this process on a SQLite file in ``workdir``, ``project`` set up through the HTTP
    API as an operator would (``config`` is its document); yields (url, agent token). ``settings`` are
    more of the service's settings (``Settings`` fields)."""
    from caller_memory.service.app import create_app
    from caller_memory.service.config import Settings
    from caller_memory.service.http.access_log import RouteAccessLogger

    operator = secrets.token_urlsafe(24)
    service = Settings(
        pseudonym_key=secrets.token_urlsafe(32).encode(),
        store_url=f"sqlite:///{workdir}/demo.db",
        operator_token=operator,
        **settings,
    )
    # The service's access log names routes, never paths (paths hold phone numbers).
    runner = web.AppRunner(create_app(service), access_log_class=RouteAccessLogger)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {operator}"}) as session:
            async with session.put(f"{url}/v1/projects/{project}", json=config) as resp:
                resp.raise_for_status()
            async with session.post(f"{url}/v1/projects/{project}/tokens", json={"role": "agent"}) as resp:
                resp.raise_for_status()
                token = (await resp.json())["token"]
        yield url, token
    finally:
        await runner.cleanup()


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def scripted_reply(messages: list[dict[str, Any]], greeting: str = "Hello! What's your name?") -> Reply:
    """A cheese shop's agent that knows only what its context says: it greets a caller the memory message
    names by name, saves the name a caller says (a ``save_name`` call), and notes anything else."""
    last = messages[-1]
    if last.get("role") == "tool":
        try:
            said = json.loads(text_of(last))
        except ValueError:
            said = {}
        return f"Nice to meet you, {said.get('name', '') if isinstance(said, dict) else ''}.", None
    if last.get("role") == "user" and (name := SAYS_NAME.search(text_of(last))):
        return "", {"name": name.group(1)}
    context = "\n".join(text_of(m) for m in messages if m.get("role") in ("system", "developer"))
    spoke = any(m.get("role") == "assistant" for m in messages)
    if not spoke and (known := CALLER_NAME.search(context)):
        return f"Welcome back, {known.group(1)}!", None
    return ("Noted." if spoke else greeting), None


@contextlib.asynccontextmanager
async def fake_model(
    reply: Callable[[list[dict[str, Any]]], Reply] = scripted_reply,
) -> AsyncIterator[str]:
    """The scripted model on loopback; yields its base URL (``http://127.0.0.1:<port>/v1``)."""

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        text, tool = reply(body["messages"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(delta: dict[str, Any], finish: str | None = None) -> None:
            chunk = {
                "id": "chatcmpl-demo",
                "object": "chat.completion.chunk",
                "model": body.get("model", "demo"),
                "created": 0,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": text})
        if tool is not None:
            call = {"index": 0, "id": "call_demo", "type": "function"}
            call["function"] = {"name": "save_name", "arguments": json.dumps(tool)}
            await send({"tool_calls": [call]})
        await send({}, "tool_calls" if tool is not None else "stop")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()
