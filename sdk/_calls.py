"""The conversation-memory requests of a client, one attempt each, and what makes an answer a success.

Each call sends one request (through the client's bounded request: no redirect followed, the body read and
decoded within a size bound and inside the time given) and returns the answer only if it is the documented
one: the documented status, every member of the documented type (strict: ``"true"`` is no boolean), and the
conversation asked about. Anything else raises: the service's own refusal (a 4xx problem document) as a
:class:`~caller_memory.sdk.errors.ServiceError` subclass, everything else (timeouts, 5xx, 507, 429,
redirects, answers of another shape or another conversation) as
:class:`~caller_memory.sdk.errors.ServiceUnavailableError`. Nothing a server sends escapes as anything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import orjson

from ._wire import (
    AppendedAnswer,
    ContextAnswer,
    HistoryAnswer,
    OpenAIHistoryAnswer,
    StartedAnswer,
    StatusAnswer,
    _Answer,
    parse,
)
from .errors import ServiceUnavailableError, error_for

#: The largest history or context answer accepted (a page of 1000 messages of up to 16 KiB each, as JSON).
MAX_TRANSCRIPT_ANSWER_BYTES = 24 * 1024 * 1024

A = TypeVar("A", bound=_Answer)


class Call(Protocol):
    """The client's one bounded request (``MemoryClient._call``): (status, headers, JSON body or None)."""

    async def __call__(
        self,
        method: str,
        parts: tuple[str, ...],
        *,
        seconds: float,
        params: Mapping[str, str] | None = None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        limit: int | None = None,
    ) -> tuple[int, Mapping[str, str], Any]: ...


def _not_the_service(status: int) -> ServiceUnavailableError:
    return ServiceUnavailableError("the answer was not the service's (is the URL right?)", status)


def _answer(model: type[A], reply: tuple[int, Mapping[str, str], Any], conversation_id: str | None) -> A:
    status, headers, body = reply
    if status != 200:
        raise error_for(status, body, headers.get("Retry-After"))
    parsed: A | None = parse(model, body)
    if parsed is None:
        raise _not_the_service(status)
    if conversation_id is not None and getattr(parsed, "conversation_id", conversation_id) != conversation_id:
        raise _not_the_service(status)  # another conversation's answer: a cache or a proxy got it wrong
    return parsed


class TranscriptCalls:
    def __init__(self, call: Call) -> None:
        self._call = call

    async def start(self, conversation_id: str, document: dict[str, Any], seconds: float) -> StartedAnswer:
        reply = await self._call(
            "POST", ("conversations", conversation_id, "start"), seconds=seconds, body=orjson.dumps(document)
        )
        started = _answer(StartedAnswer, reply, None)
        if started.conversation is not None and started.conversation.conversation_id != conversation_id:
            raise _not_the_service(reply[0])
        if started.stored and started.conversation is None:
            raise _not_the_service(reply[0])
        return started

    async def append(self, conversation_id: str, body: bytes, seconds: float) -> AppendedAnswer:
        reply = await self._call(
            "POST", ("conversations", conversation_id, "messages"), seconds=seconds, body=body
        )
        return _answer(AppendedAnswer, reply, conversation_id)

    async def status(self, conversation_id: str, seconds: float) -> StatusAnswer:
        reply = await self._call("GET", ("conversations", conversation_id), seconds=seconds)
        return _answer(StatusAnswer, reply, conversation_id)

    async def history(
        self, conversation_id: str, params: dict[str, str], seconds: float, etag: str | None
    ) -> tuple[HistoryAnswer | OpenAIHistoryAnswer | None, str | None]:
        """The page, and its ETag; (None, etag) for a 304 to ``etag``."""
        reply = await self._call(
            "GET",
            ("conversations", conversation_id, "history"),
            seconds=seconds,
            params=params,
            headers={"If-None-Match": etag} if etag else None,
            limit=MAX_TRANSCRIPT_ANSWER_BYTES,
        )
        status, headers, _ = reply
        if status == 304:
            if etag is None:
                raise _not_the_service(status)
            return None, headers.get("ETag") or etag
        answer: HistoryAnswer | OpenAIHistoryAnswer
        if params.get("format") == "openai":
            answer = _answer(OpenAIHistoryAnswer, reply, None)
        else:
            answer = _answer(HistoryAnswer, reply, conversation_id)
        return answer, headers.get("ETag")

    async def context(
        self,
        conversation_id: str,
        max_tokens: int,
        seconds: float,
        trust: Mapping[str, str] | None = None,
    ) -> ContextAnswer:
        reply = await self._call(
            "GET",
            ("conversations", conversation_id, "context"),
            seconds=seconds,
            params={"max_tokens": str(max_tokens), **(trust or {})},
            limit=MAX_TRANSCRIPT_ANSWER_BYTES,
        )
        answer = _answer(ContextAnswer, reply, conversation_id)
        if answer.max_tokens != max_tokens or answer.tokens > max_tokens:
            raise _not_the_service(reply[0])
        return answer

    async def put_summary(self, conversation_id: str, body: bytes, seconds: float) -> StatusAnswer:
        reply = await self._call(
            "PUT", ("conversations", conversation_id, "summary"), seconds=seconds, body=body
        )
        return _answer(StatusAnswer, reply, conversation_id)
