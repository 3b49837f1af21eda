"""The end of a conversation (``conv.end()``, :meth:`MemoryClient.end_conversation`): kept in the outbox
from its first moment, the conversation's unsent messages sent (or kept) first, every attempt within the
retry policy, and what could not be sent left to the outbox, or set aside there when the service refuses it.

A base of :class:`~caller_memory.sdk.MemoryClient` on top of the outbox's delivery (:mod:`._delivery`), kept
apart so that the client module stays about its requests and its life.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import orjson

from ._delivery import Delivery
from ._sender import TranscriptBuffer
from ._wire import EndAnswer, parse
from .conversation import EndResult
from .errors import (
    ClientClosedError,
    OutboxUnavailableError,
    ServiceError,
    ServiceUnavailableError,
    error_for,
)
from .outbox import MESSAGES
from .policies import CircuitBreaker

if TYPE_CHECKING:
    from ._calls import Call

log = logging.getLogger("caller_memory.sdk")


class Ending(Delivery):
    """The end of a conversation, for a client (see the module's docstring)."""

    if TYPE_CHECKING:  # the client's (declared for type checking only: not part of its public annotations)
        circuit: CircuitBreaker
        _call: Call
        _closed: bool
        _ends: int
        _no_ends: asyncio.Event
        _cleanup: set[asyncio.Task[Any]]

    def _track(self, coro: Coroutine[Any, Any, Any], *, tasks: set[asyncio.Task[Any]] | None = None) -> None:
        raise NotImplementedError  # the client's

    def _spawn_flush(self) -> None:
        raise NotImplementedError  # the client's

    async def _post_end(self, conversation_id: str, body: bytes) -> EndResult:
        """One attempt. Raises ServiceUnavailableError unless the answer is a 200 of the documented shape
        for this conversation, or ServiceError for the service's refusal."""
        status, headers, answer = await self._call(
            "POST", ("conversations", conversation_id, "end"), seconds=self.retry.attempt_timeout, body=body
        )
        if status != 200:
            raise error_for(status, answer, headers.get("Retry-After"))
        ended = parse(EndAnswer, answer)
        if ended is None or ended.conversation_id != conversation_id:
            raise ServiceUnavailableError("the answer was not the service's (is the URL right?)", status)
        return EndResult(
            conversation_id=conversation_id,
            persisted=tuple(ended.persisted),
            ignored=tuple(ended.ignored),
            blacklisted=ended.blacklisted,
            repeat_caller=dict(ended.repeat_caller),
            replayed=headers.get("Idempotent-Replayed") == "true",
            erased=ended.erased,
            late=ended.late,
            withheld=tuple(ended.withheld),
        )

    async def end_conversation(self, conversation_id: str, body: dict[str, Any]) -> EndResult:
        """POST the end of a conversation, kept in the outbox from the start until it is acknowledged.

        If the conversation is still in the outbox (an earlier call was cancelled, or its process died),
        that entry is taken over and its ``ended_at`` is sent."""
        return await self._end_conversation(conversation_id, body)

    async def _end_conversation(
        self, conversation_id: str, body: dict[str, Any], transcript: TranscriptBuffer | None = None
    ) -> EndResult:
        """:meth:`end_conversation`; with ``transcript`` (the conversation's unsent messages), those go
        first; if some of them are kept in the outbox, the end is kept behind them and the result is
        ``queued`` unless they could all be delivered at once."""
        if self._closed:
            raise ClientClosedError(
                f"conversation {conversation_id}: the client is closed; end the conversation before aclose()"
            )
        self._ends += 1
        self._no_ends.clear()
        try:
            return await self._end_unclosed(conversation_id, body, transcript)
        finally:
            self._ends -= 1
            if not self._ends:
                self._no_ends.set()

    async def _end_unclosed(
        self, conversation_id: str, body: dict[str, Any], transcript: TranscriptBuffer | None
    ) -> EndResult:
        entry_id: int | None = None
        lease = self.retry.worst_case * (2 if transcript is not None else 1) + 1
        try:
            entry_id, encoded = await self.outbox.keep(conversation_id, body, lease=lease)
        except asyncio.CancelledError:  # the entry may have been written all the same: hand it back
            self._track(self._quietly(self.outbox.release_conversation(conversation_id)), tasks=self._cleanup)
            raise
        except OutboxUnavailableError as exc:
            encoded = orjson.dumps(body)
            log.error("conversation %s: %s; sending anyway", conversation_id, exc)
        if transcript is not None:
            try:
                behind = await self._messages_first(conversation_id, transcript, entry_id)
            except asyncio.CancelledError:
                if entry_id is not None:  # released once the messages are sent or kept: they go first
                    self._track(self._release_after(transcript, entry_id), tasks=self._cleanup)
                raise
            if behind:
                assert entry_id is not None
                await self._quietly(self.outbox.release(entry_id))
                log.warning(
                    "conversation %s: its end is kept in the outbox behind its messages", conversation_id
                )
                return EndResult(conversation_id=conversation_id, queued=True)
        try:
            result = await self._deliver(conversation_id, encoded, entry_id)
        except asyncio.CancelledError:
            if entry_id is not None:  # hand the entry to the next delivery rather than wait for its lease
                self._release_later(entry_id)
            raise
        if result is not None:
            return result
        if entry_id is None:
            raise OutboxUnavailableError(
                f"conversation {conversation_id}: the service could not be reached and the outbox "
                f"{self.outbox.path} cannot be written: this write is lost"
            )
        await self._quietly(self.outbox.release(entry_id))
        return EndResult(conversation_id=conversation_id, queued=True)

    async def _messages_first(
        self, conversation_id: str, transcript: TranscriptBuffer, entry_id: int | None
    ) -> bool:
        """Send (or keep) the conversation's unsent messages before its end; True when some of them stay in
        the outbox, so that the end must wait there behind them."""
        clean = await transcript.close(self.retry.worst_case)
        if entry_id is None:  # the outbox cannot be used: nothing of this conversation can be in it
            return False
        try:
            kept = bool(await self.outbox.pending(conversation_id, MESSAGES))
        except OutboxUnavailableError:
            kept = not clean
        return kept and not await self._deliver_queued(conversation_id)

    async def _release_after(self, transcript: TranscriptBuffer, entry_id: int) -> None:
        await transcript.idle()
        await self._quietly(self.outbox.release(entry_id))

    async def _deliver(self, conversation_id: str, encoded: bytes, entry_id: int | None) -> EndResult | None:
        """Every attempt of one end; None when they all failed transiently (the entry stays queued)."""
        last: ServiceUnavailableError | None = None
        for attempt in range(self.retry.attempts):
            if last is not None:
                await asyncio.sleep(self.retry.delay(attempt - 1, last.retry_after))
            try:
                result = await self._post_end(conversation_id, encoded)
            except ServiceUnavailableError as exc:
                last = exc
                continue
            except ServiceError as exc:
                if (
                    entry_id is not None
                ):  # refused: set aside, kept for retry_rejected(); the exception says why
                    await self._quietly(self.outbox.reject(entry_id, str(exc)))
                log.error("conversation %s: refused (%s); set aside in the outbox", conversation_id, exc)
                raise
            if entry_id is not None:
                await self._quietly(self.outbox.delivered(entry_id))
            self.circuit.success()
            self._spawn_flush()  # the service is back: deliver what was queued earlier, if anything
            return result
        log.warning(
            "conversation %s: not delivered after %d attempts (%s); kept in the outbox %s",
            conversation_id,
            self.retry.attempts,
            last,
            self.outbox.path,
        )
        return None
