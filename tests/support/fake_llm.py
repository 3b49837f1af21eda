"""A fake OpenAI-compatible model on loopback: ``POST /v1/chat/completions``, streamed (server-sent events) or
not, with scripted replies. The frameworks' tests point their real OpenAI clients (Pipecat's
``OpenAILLMService``, LiveKit's ``openai.LLM``) at it, so that everything but the model is real.

The default script (:func:`default_reply`) plays a cheese shop's agent that knows only what its context says:

- a context holding the caller memory message (``render_memory``) with a ``caller_name`` greets "Welcome back,
  <name>!" when the agent has not spoken yet;
- "my name is X" calls the tool ``save_name`` with ``{"name": "X"}``; the tool's answer gets "Nice to meet
  you, X.";
- "tell me a story" answers 40 words, ``gap`` seconds apart (something to interrupt);
- anything else: "Hello! What's your name?" as the first answer, "Noted." after.

Every request body is kept (``requests``): tests look at what the model was given (one memory message, the
number nowhere). ``delay`` holds each answer back that long before its first byte.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

#: The render_memory() document's caller fields, as the model sees them.
CALLER_NAME = re.compile(r'"caller_name":"([^"]*)"')
SAYS_NAME = re.compile(r"my name is (\w+)", re.IGNORECASE)


@dataclass
class Reply:
    """What the model answers: text chunks, or a tool call (name and arguments)."""

    chunks: list[str] = field(default_factory=list)
    tool: tuple[str, dict[str, Any]] | None = None
    #: Seconds between chunks.
    gap: float = 0.0


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def default_reply(messages: list[dict[str, Any]]) -> Reply:
    last = messages[-1]
    if last.get("role") == "tool":
        try:
            said = json.loads(text_of(last))
        except ValueError:
            said = {}
        name = said.get("name", "") if isinstance(said, dict) else ""
        return Reply([f"Nice to meet you, {name}."])
    user = text_of(last) if last.get("role") == "user" else ""
    if match := SAYS_NAME.search(user):
        return Reply(tool=("save_name", {"name": match.group(1)}))
    if "story" in user:
        return Reply([f"word{i} " for i in range(40)], gap=0.05)
    spoke = any(m.get("role") == "assistant" for m in messages)
    context = "\n".join(text_of(m) for m in messages if m.get("role") in ("system", "developer"))
    if not spoke and (name := CALLER_NAME.search(context)):
        return Reply(["Welcome back, ", f"{name.group(1)}!"])
    return Reply(["Noted."] if spoke else ["Hello! ", "What's your name?"])


class FakeLLM:
    """The server. ``async with FakeLLM() as llm: ... llm.base_url`` (``http://127.0.0.1:<port>/v1``)."""

    def __init__(self, reply: Callable[[list[dict[str, Any]]], Reply] = default_reply) -> None:
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        self.delay = 0.0
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> FakeLLM:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        reply = self.reply(body["messages"])
        if self.delay:
            await asyncio.sleep(self.delay)
        completion_id, created = f"chatcmpl-{len(self.requests)}", int(time.time())
        tool_calls = []
        if reply.tool is not None:
            name, arguments = reply.tool
            tool_calls = [
                {
                    "index": 0,
                    "id": f"call_{len(self.requests)}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            ]
        finish = "tool_calls" if tool_calls else "stop"
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(reply.chunks) or None}
            if tool_calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
            return web.json_response(
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": body.get("model", "fake"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": usage,
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(delta: dict[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> None:
            chunk = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.get("model", "fake"),
                "choices": []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                **extra,
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        for chunk in reply.chunks:
            if reply.gap:
                await asyncio.sleep(reply.gap)
            await send({"content": chunk})
        if tool_calls:
            await send({"tool_calls": tool_calls})
        await send({}, finish)
        await send(None, usage=usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
