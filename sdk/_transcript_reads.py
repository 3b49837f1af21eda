"""What the service makes of a conversation's transcript: ``conv.history()``, ``conv.context()`` (the
context of one inference, within a token budget) and ``conv.set_summary()`` (the summary ``context()`` then
gives instead of the turns it covers). Each waits for the conversation's unsent messages first, then makes
one request within what is left of its budget.

A base of :class:`~caller_memory.sdk.Conversation`, kept apart so that the conversation module stays about
the call: its memory, its turns, its messages and its end.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

import orjson

from ._trust import query
from ._wire import ContextAnswer, HistoryAnswer, OpenAIHistoryAnswer, StatusAnswer
from .errors import ServiceUnavailableError
from .transcript import (
    MAX_INT,
    MAX_PAGE,
    MAX_SUMMARY_CHARS,
    MAX_TOKENS,
    Context,
    History,
    TranscriptInfo,
    check_integer,
    context_of,
    history_of,
)

if TYPE_CHECKING:
    from ._sender import TranscriptBuffer

#: The share of a read's timeout that waiting for this conversation's unsent messages may take.
FLUSH_SHARE = 0.5

HistoryFormat = Literal["platform", "openai"]

_HistoryKey = tuple[str, int | None, int | None]


class _ReadsTransport(Protocol):
    """What these calls need of the conversation's client (the conversation's own protocol extends it)."""

    context_budget: float
    call_timeout: float

    async def _history(
        self, conversation_id: str, params: dict[str, str], seconds: float, etag: str | None
    ) -> tuple[HistoryAnswer | OpenAIHistoryAnswer | None, str | None]: ...

    async def _context(
        self,
        conversation_id: str,
        max_tokens: int,
        seconds: float,
        trust: Mapping[str, str] | None = None,
    ) -> ContextAnswer: ...

    async def _put_summary(self, conversation_id: str, body: bytes, seconds: float) -> StatusAnswer: ...


class TranscriptReads:
    """``history()``, ``context()`` and ``set_summary()`` of a conversation (see the module's docstring)."""

    if TYPE_CHECKING:  # the conversation's (declared for type checking only)
        _client: _ReadsTransport
        _buffer: TranscriptBuffer | None
        _attestation: str | None
        _step_up: bool
        _history_cache: dict[_HistoryKey, tuple[str, History | list[dict[str, str]]]]
        conversation_id: str
        caller: str

    async def _flushed(self, seconds: float) -> int:
        return await self._buffer.flushed(seconds) if self._buffer is not None else 0

    @overload
    async def history(
        self,
        *,
        format: Literal["platform"] = "platform",
        after_turn: int | None = None,
        limit: int | None = None,
        budget: float | None = None,
    ) -> History: ...

    @overload
    async def history(
        self,
        *,
        format: Literal["openai"],
        after_turn: int | None = None,
        limit: int | None = None,
        budget: float | None = None,
    ) -> list[dict[str, str]]: ...

    async def history(
        self,
        *,
        format: HistoryFormat = "platform",
        after_turn: int | None = None,
        limit: int | None = None,
        budget: float | None = None,
    ) -> History | list[dict[str, str]]:
        """The transcript, in order: a :class:`~caller_memory.sdk.History` page (``format="platform"``), or
        the user and assistant messages as ``[{"role", "content"}]`` (``format="openai"``, what an LLM
        client takes). ``after_turn``: only later turns; ``limit``: messages per page (1-1000, the service's
        default 200; a page ends on a whole turn, see ``History.next_after_turn``).

        Waits for this conversation's unsent messages first (up to half of ``budget``), then reads within
        what is left of it (``budget`` defaults to the client's ``call_timeout``). An unchanged page costs a
        ``304``. Raises ServiceUnavailableError (timeout, outage, an answer not of the documented shape),
        NotFoundError (no such transcript, or conversation memory is off), GoneError (expired or erased),
        and the other ServiceError subclasses for refusals.
        """
        if format not in ("platform", "openai"):
            raise ValueError("format must be 'platform' or 'openai'")
        params: dict[str, str] = {}
        if format == "openai":
            params["format"] = "openai"
        if after_turn is not None:
            params["after_turn"] = str(check_integer(after_turn, "after_turn", 0, MAX_INT))
        if limit is not None:
            params["limit"] = str(check_integer(limit, "limit", 1, MAX_PAGE))
        params.update(query(self._attestation, self._step_up))
        seconds = _seconds(budget, self._client.call_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        unsent = await self._flushed(seconds * FLUSH_SHARE)
        key: _HistoryKey = (format, after_turn, limit)
        cached = self._history_cache.get(key)
        answer, etag = await self._client._history(
            self.conversation_id, params, _left(deadline, loop), cached[0] if cached else None
        )
        result: History | list[dict[str, str]]
        if answer is None:  # 304: the page did not change
            if cached is None:
                raise ServiceUnavailableError("the answer was not the service's (304 to a first read)", 304)
            result = cached[1]
            if isinstance(result, History):
                result = _replace_unsent(result, unsent)
            else:
                result = [dict(m) for m in result]
        elif isinstance(answer, OpenAIHistoryAnswer):
            result = [{"role": m.role, "content": m.content} for m in answer.messages]
        else:
            result = history_of(answer, unsent)
        if etag:
            self._history_cache = {
                key: (etag, result if isinstance(result, History) else [dict(m) for m in result])
            }
        return result

    async def context(self, max_tokens: int = 2000, *, budget: float | None = None) -> Context:
        """The context of one inference, assembled by the service in one round trip within ``max_tokens``
        (1 to 1,000,000): the caller's memory (capped), the stored summary, and the most recent whole turns
        that fit, each section with its token count, and ``needs_summary`` (see
        :class:`~caller_memory.sdk.Context`).

        Waits for this conversation's unsent messages first (up to half of ``budget``), then reads within
        what is left (``budget`` defaults to the client's ``context_budget``, 0.3 s): ``Context.unsent``
        counts messages the service did not have yet. Raises like :meth:`history`.
        """
        tokens = check_integer(max_tokens, "max_tokens", 1, MAX_TOKENS)
        seconds = _seconds(budget, self._client.context_budget)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        unsent = await self._flushed(seconds * FLUSH_SHARE)
        answer = await self._client._context(
            self.conversation_id, tokens, _left(deadline, loop), query(self._attestation, self._step_up)
        )
        return context_of(answer, unsent)

    async def set_summary(
        self, text: str, through_turn: int, tokens: int | None = None, *, budget: float | None = None
    ) -> TranscriptInfo:
        """Store the agent's own summary of the turns up to ``through_turn`` (it replaces an earlier one):
        ``context()`` then gives it instead of those turns. ``tokens``: its token count, if known.

        Waits for this conversation's unsent messages first (up to half of ``budget``: the turn summarised
        must have reached the service), then writes within what is left (``budget`` defaults to the
        client's ``call_timeout``). One attempt: a failure raises like :meth:`history` (a ``through_turn``
        beyond the service's latest turn is an InvalidRequestError) and you may call it again.
        """
        if not isinstance(text, str) or len(text) > MAX_SUMMARY_CHARS:
            raise ValueError(f"text must be a string of at most {MAX_SUMMARY_CHARS:,} characters")
        body: dict[str, Any] = {
            "text": text,
            "through_turn": check_integer(through_turn, "through_turn", 0, MAX_INT),
            # So that the service also finds the caller's own number written in their national format.
            "caller": self.caller,
        }
        if tokens is not None:
            body["tokens"] = check_integer(tokens, "tokens", 0, MAX_TOKENS)
        try:
            encoded = orjson.dumps(body)
        except TypeError:
            raise ValueError("text holds a lone surrogate, which JSON cannot carry") from None
        seconds = _seconds(budget, self._client.call_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        await self._flushed(seconds * FLUSH_SHARE)
        answer = await self._client._put_summary(self.conversation_id, encoded, _left(deadline, loop))
        return TranscriptInfo._of(answer)


def _seconds(budget: float | None, default: float) -> float:
    if budget is None:
        return default
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0:
        raise ValueError("budget must be a positive number of seconds")
    return float(budget)


def _left(deadline: float, loop: asyncio.AbstractEventLoop) -> float:
    return max(0.001, deadline - loop.time())


def _replace_unsent(history: History, unsent: int) -> History:
    return dataclasses.replace(history, unsent=unsent)
