"""Delivering the outbox: what :meth:`MemoryClient.flush_outbox` and a conversation's sender do with the
entries kept there (ends of conversations and message batches), in order, one attempt each.

A mixin of :class:`~caller_memory.sdk.MemoryClient` (it needs the client's requests and outbox), kept apart
so that the client module stays about sending, not about the outbox's bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ._calls import TranscriptCalls
from ._sender import TranscriptBuffer, refuses_state_only, without_state
from .conversation import EndResult
from .errors import OutboxUnavailableError, ServiceError, ServiceUnavailableError
from .outbox import MESSAGES, FlushReport, Outbox, OutboxEntry
from .policies import RetryPolicy

log = logging.getLogger("caller_memory.sdk")


class Delivery:
    """The outbox delivery of a client (see the module's docstring)."""

    if TYPE_CHECKING:  # the client's (declared for type checking only: not part of its public annotations)
        outbox: Outbox
        retry: RetryPolicy
        _flush_lock: asyncio.Lock
        _calls: TranscriptCalls
        _buffers: weakref.WeakValueDictionary[str, TranscriptBuffer]

    async def _post_end(self, conversation_id: str, body: bytes) -> EndResult:
        raise NotImplementedError  # the client's

    def _release_later(self, *entry_ids: int) -> None:
        raise NotImplementedError  # the client's

    @staticmethod
    async def _quietly(step: Coroutine[Any, Any, None]) -> None:
        """An outbox step after the fact (the service already answered): a failure of the file is logged,
        not raised. The entry then stays, and a later delivery gets a harmless replay."""
        try:
            await step
        except OutboxUnavailableError as exc:
            log.error("%s", exc)

    async def flush_outbox(self) -> FlushReport:
        """Deliver every queued write (ends of conversations, message batches), oldest first, keeping each
        conversation's order; stops at the first transient failure.

        One delivery runs at a time per client; entries another process is sending are left alone (unless
        that process is dead). Raises OutboxUnavailableError if the outbox file cannot be used.
        """
        counts = {"delivered": 0, "rejected": 0, "dropped": 0}
        async with self._flush_lock:
            stopped = False
            while not stopped:
                batch = await self.outbox.claim(limit=50, lease=self.retry.attempt_timeout * 50 + 5)
                if not batch:
                    break
                stopped = await self._flush_entries(batch, counts)
            remaining = len(await self.outbox.pending())
        return FlushReport(remaining=remaining, **counts)

    async def _flush_entries(self, batch: list[OutboxEntry], counts: dict[str, int] | None = None) -> bool:
        """Deliver claimed entries in order; True when a transient failure stopped it."""
        unsettled = {entry.id for entry in batch}
        try:
            for entry in batch:
                outcome = await self._flush_one(entry)
                unsettled.discard(entry.id)
                if outcome == "stopped":
                    return True
                if counts is not None:
                    counts[outcome] += 1
        finally:  # whatever happens (a cancellation too), nothing of the batch stays claimed
            if unsettled:
                self._release_later(*unsettled)
        return False

    async def _flush_one(self, entry: OutboxEntry) -> str:
        if entry.kind == MESSAGES:
            return await self._flush_batch(entry)
        try:
            await self._post_end(entry.conversation_id, entry.body)
        except ServiceUnavailableError:
            await self.outbox.release(entry.id)
            return "stopped"
        except ServiceError as exc:
            await self.outbox.reject(entry.id, str(exc))
            log.error("queued end of conversation %s refused: %s", entry.conversation_id, exc)
            return "rejected"
        await self.outbox.delivered(entry.id)
        return "delivered"

    async def _flush_batch(self, entry: OutboxEntry) -> str:
        conversation_id = entry.conversation_id
        buffer = self._buffers.get(conversation_id)
        try:
            try:
                await self._calls.append(conversation_id, entry.body, self.retry.attempt_timeout)
            except ServiceError as exc:
                if not refuses_state_only(exc):
                    raise
                log.warning("queued state checkpoint of conversation %s dropped: %s", conversation_id, exc)
                await self._calls.append(
                    conversation_id, without_state(entry.body), self.retry.attempt_timeout
                )
        except ServiceUnavailableError:
            await self.outbox.release(entry.id)
            return "stopped"
        except ServiceError as exc:
            if exc.status in (401, 403):  # the token: set aside like an end, for retry_rejected()
                await self.outbox.reject(entry.id, str(exc))
                log.error("queued messages of conversation %s refused: %s", conversation_id, exc)
                outcome, error = "rejected", None
            else:  # the caller's error, or a conversation that is over: retrying cannot help
                await self.outbox.delivered(entry.id)
                log.warning("queued messages of conversation %s dropped: %s", conversation_id, exc)
                outcome, error = "dropped", exc
        else:
            await self.outbox.delivered(entry.id)
            outcome, error = "delivered", None
        if buffer is not None:
            buffer.outbox_settled(entry.id, error)
        return outcome

    async def _deliver_queued(self, conversation_id: str) -> bool:
        """Deliver this conversation's kept message batches, oldest first, one attempt each; True once none
        is left (False: the service failed, another delivery holds some, or the outbox cannot be used)."""
        try:
            while True:
                batch = await self.outbox.claim(
                    limit=20,
                    lease=self.retry.attempt_timeout * 20 + 5,
                    conversation_id=conversation_id,
                    kind=MESSAGES,
                )
                if not batch:
                    break
                if await self._flush_entries(batch):
                    return False
            return not await self.outbox.pending(conversation_id, MESSAGES)
        except OutboxUnavailableError as exc:
            log.error("conversation %s: %s", conversation_id, exc)
            return False

    async def _flush_quietly(self) -> None:
        try:
            report = await self.flush_outbox()
        except Exception as exc:  # a background delivery must never take the agent down
            log.error("delivering the outbox failed (%s); entries stay queued", exc)
            return
        if report.delivered or report.rejected or report.dropped:
            log.info(
                "outbox: %d delivered, %d rejected, %d dropped, %d remaining",
                report.delivered,
                report.rejected,
                report.dropped,
                report.remaining,
            )
