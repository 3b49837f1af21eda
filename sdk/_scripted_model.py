"""The scripted OpenAI-compatible model of :mod:`caller_memory.sdk.testing` (documented there).

It answers ``POST /v1/chat/completions`` the way OpenAI's API does, streamed (server-sent events, each
``data:`` line one ``chat.completion.chunk``, then ``data: [DONE]``) or as one ``chat.completion``, and
``GET /v1/models`` (LiveKit's OpenAI plugin asks for it to warm its connection up).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeAlias

import orjson
from aiohttp import web


@dataclass(frozen=True)
class ToolCall:
    """A call of the tool ``name`` with ``arguments`` (sent to the agent as their JSON text)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """One answer of the model: ``text``, tool calls, or both (the text first, as OpenAI sends them).

    Streamed, the text goes word by word, ``pause`` seconds apart (a pause gives a test something to
    interrupt), and each tool call's arguments in two pieces, as OpenAI streams them.
    """

    text: str = ""
    tool_calls: Sequence[ToolCall] = ()
    pause: float = 0.0


#: One entry of a script: a text, a tool call, or a whole :class:`Reply`.
Answer: TypeAlias = str | ToolCall | Reply
#: A script: the answers in order, or a function of each request that returns the answer (or an awaitable).
Script: TypeAlias = Iterable[Answer] | Callable[["ModelRequest"], Answer | Awaitable[Answer]]


def message_text(message: dict[str, Any]) -> str:
    """The text of one chat message, whether its ``content`` is a string or a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


@dataclass(frozen=True)
class ModelRequest:
    """One request the model received: ``body`` is its JSON, parsed."""

    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat messages, in order."""
        messages = self.body.get("messages")
        return messages if isinstance(messages, list) else []

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools offered (OpenAI's ``tools`` list; empty without one)."""
        tools = self.body.get("tools")
        return tools if isinstance(tools, list) else []

    @property
    def tool_names(self) -> list[str]:
        """The names of the tools offered."""
        return [str(tool.get("function", {}).get("name")) for tool in self.tools if isinstance(tool, dict)]

    @property
    def stream(self) -> bool:
        """Whether the answer was asked for as a stream."""
        return bool(self.body.get("stream"))

    def texts(self, *roles: str) -> list[str]:
        """The texts of the messages with one of ``roles`` (``"system"``, ``"user"``, ``"tool"``...)."""
        return [message_text(m) for m in self.messages if m.get("role") in roles]

    @property
    def system_prompt(self) -> str:
        """Everything the model was told before the conversation: the texts of the ``system`` and
        ``developer`` messages, joined by blank lines."""
        return "\n\n".join(self.texts("system", "developer"))

    @property
    def last_user_text(self) -> str:
        """The text of the last ``user`` message ("" without one)."""
        said = self.texts("user")
        return said[-1] if said else ""


class ScriptError(AssertionError):
    """The model could not answer from its script: it ran out, or the script function raised. The request
    got an HTTP 500 naming the reason, and leaving ``async with ScriptedModel(...)`` raises this."""


class ScriptedModel:
    """An OpenAI-compatible model on ``127.0.0.1`` that answers from a script.

    ``script`` is a list of answers, one per request, in order (a ``str`` is a text reply, a
    :class:`ToolCall` a reply that calls one tool, a :class:`Reply` anything else), or a function that
    receives each :class:`ModelRequest` and returns its answer. Every request is kept in :attr:`requests`.
    """

    def __init__(self, script: Script, *, model: str = "scripted") -> None:
        self._next: Callable[[ModelRequest], Answer | Awaitable[Answer]]
        self._answers: list[Answer] = []
        if callable(script):
            self._next = script
        else:
            self._answers = list(script)
            self._next = self._from_list
        self.model = model
        #: Every request received, in order (those answered with an error too).
        self.requests: list[ModelRequest] = []
        #: Why requests were answered with HTTP 500 (the script ran out or raised), in order.
        self.errors: list[str] = []
        self._served = 0
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._ids = itertools.count(1)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``: the base URL an OpenAI client takes."""
        if self._runner is None:
            raise RuntimeError("the scripted model is not running: use it inside `async with`")
        return f"http://127.0.0.1:{self._port}/v1"

    @property
    def last_request(self) -> ModelRequest:
        """The latest request (an ``AssertionError`` if none came)."""
        if not self.requests:
            raise AssertionError("the scripted model received no request")
        return self.requests[-1]

    async def start(self) -> None:
        """Start serving (``async with`` does this)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self._port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop serving (``async with`` does this)."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> ScriptedModel:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.stop()
        if kind is None and self.errors:
            raise ScriptError("; ".join(dict.fromkeys(self.errors)))

    def _from_list(self, request: ModelRequest) -> Answer:
        if self._served >= len(self._answers):
            raise ScriptError(
                f"the script has {len(self._answers)} answers and request {len(self.requests)} asked for "
                "one more"
            )
        self._served += 1
        return self._answers[self._served - 1]

    async def _models(self, request: web.Request) -> web.Response:
        listed = {"id": self.model, "object": "model", "created": 0, "owned_by": "caller-memory-testing"}
        return web.json_response({"object": "list", "data": [listed]}, dumps=_dumps)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(
                400, "the body must be a JSON object with a `messages` list", "invalid_request_error"
            )
        asked = ModelRequest(body)
        self.requests.append(asked)
        try:
            answer = self._next(asked)
            if inspect.isawaitable(answer):
                answer = await answer
            reply = _as_reply(answer)
        except Exception as exc:
            reason = str(exc) if isinstance(exc, ScriptError) else f"the script raised {exc!r}"
            self.errors.append(reason)
            return _error(500, f"scripted model: {reason}", "server_error")
        completion = _Completion(f"chatcmpl-{next(self._ids)}", str(body.get("model") or self.model), reply)
        if not asked.stream:
            return web.json_response(completion.whole(), dumps=_dumps)
        usage = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            for index, chunk in enumerate(completion.chunks(bool(usage))):
                if reply.pause and index > 1:
                    await asyncio.sleep(reply.pause)
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the agent stopped reading (an interruption cancels the reply): nothing is wrong
        return response


def _as_reply(answer: object) -> Reply:
    if isinstance(answer, Reply):
        return answer
    if isinstance(answer, str):
        return Reply(text=answer)
    if isinstance(answer, ToolCall):
        return Reply(tool_calls=[answer])
    raise ScriptError(f"an answer must be a str, a ToolCall or a Reply, not {type(answer).__name__}")


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def _error(status: int, message: str, kind: str) -> web.Response:
    """An error in OpenAI's shape, which OpenAI's clients raise with ``message`` in the exception."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": None}},
        status=status,
        dumps=_dumps,
    )


@dataclass
class _Completion:
    """One reply in OpenAI's two wire forms."""

    id: str
    model: str
    reply: Reply
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.reply.tool_calls else "stop"

    @property
    def usage(self) -> dict[str, int]:
        completion = len(self.reply.text.split()) + len(self.reply.tool_calls)
        return {"prompt_tokens": 1, "completion_tokens": completion, "total_tokens": 1 + completion}

    def _call_id(self, index: int) -> str:
        return f"call_{self.id.removeprefix('chatcmpl-')}_{index}"

    def whole(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.reply.text or None}
        if self.reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": self._call_id(index),
                    "type": "function",
                    "function": {"name": call.name, "arguments": _dumps(call.arguments)},
                }
                for index, call in enumerate(self.reply.tool_calls)
            ]
        choice = {"index": 0, "message": message, "finish_reason": self.finish_reason, "logprobs": None}
        return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunks(self, usage: bool) -> list[dict[str, Any]]:
        """The stream: the role, the text word by word, each tool call (its name, then its arguments in two
        pieces), the finish reason, and the usage if it was asked for."""
        chunks = [self._chunk({"role": "assistant", "content": ""})]
        chunks += [self._chunk({"content": word}) for word in re.findall(r"\S+\s*|\s+", self.reply.text)]
        for index, call in enumerate(self.reply.tool_calls):
            start = {"index": index, "id": self._call_id(index), "type": "function"}
            chunks.append(
                self._chunk({"tool_calls": [{**start, "function": {"name": call.name, "arguments": ""}}]})
            )
            arguments = _dumps(call.arguments)
            half = len(arguments) // 2
            for piece in (arguments[:half], arguments[half:]):
                chunks.append(
                    self._chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                )
        chunks.append(self._chunk({}, self.finish_reason))
        if usage:
            chunks.append({**self._head("chat.completion.chunk"), "choices": [], "usage": self.usage})
        return chunks
