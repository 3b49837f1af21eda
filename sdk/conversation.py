"""One phone call: ``conv.memory`` (read once per turn), ``conv.state`` (written at the end)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .memory import Memory

if TYPE_CHECKING:
    from .client import MemoryClient


@dataclass(frozen=True, slots=True)
class EndResult:
    """What ``conv.end()`` achieved.

    ``queued`` is True when the service could not be reached: the write is kept in the durable outbox and
    will be delivered later (``persisted`` and ``ignored`` are then unknown and empty).
    """

    conversation_id: str
    persisted: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    blacklisted: bool = False
    repeat_caller: dict[str, Any] = field(default_factory=dict, hash=False)
    replayed: bool = False
    queued: bool = False
    #: The caller was erased after this conversation ended: nothing was stored.
    erased: bool = False


class Conversation:
    """Created by :meth:`MemoryClient.conversation`; one per call."""

    def __init__(self, client: MemoryClient, conversation_id: str, caller: str) -> None:
        self._client = client
        self.conversation_id = conversation_id
        self.caller = caller
        #: What to remember about the caller; written at the end of the conversation, keys in state_keys only.
        self.state: dict[str, Any] = {}
        self._memory: Memory | None = None
        self._result: EndResult | None = None
        self._ending = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<Conversation {self.conversation_id} {'ended' if self.ended else 'open'}>"

    @property
    def memory(self) -> Memory:
        """The caller's memory as fetched by the last :meth:`begin_turn`. Read-only."""
        if self._memory is None:
            raise RuntimeError(
                "call `await conv.begin_turn()` at the start of each turn before reading conv.memory"
            )
        return self._memory

    async def begin_turn(self) -> Memory:
        """Fetch the caller's memory once for this turn (within the client's read budget).

        Never raises because of the service: on a timeout, an error or an open circuit, ``conv.memory`` is
        empty with ``available`` False. An unchanged memory costs a ``304 Not Modified``.
        """
        self._memory = await self._client.read_memory(self.caller, previous=self._memory)
        return self._memory

    async def end(
        self,
        *,
        qa: str | None = None,
        handoff_reason: str | None = None,
        handoff_to: str | None = None,
        channel: str | None = "voice",
    ) -> EndResult:
        """Send ``conv.state`` and the outcome. Retries transient failures, then queues in the outbox.

        The request is kept in the durable outbox from the start, so a crash or a cancellation of this call
        does not lose it. Raises :class:`~caller_memory.sdk.errors.ServiceError` subclasses for requests the
        service refuses for good (invalid state values, a revoked token): retrying would not help. Raises
        :class:`~caller_memory.sdk.errors.OutboxUnavailableError` if the service is unreachable *and* the
        outbox cannot be written. Once it returned a result (delivered or queued), calling it again returns
        that result without sending anything, whatever the arguments.
        """
        async with self._ending:  # two concurrent end() calls send one request
            if self._result is None:
                body = {
                    "caller": self.caller,
                    "state": dict(self.state),
                    "outcome": {"qa": qa, "handoff_reason": handoff_reason, "handoff_to": handoff_to},
                    "channel": channel,
                    # When the call ended, sent with every attempt (and kept in the outbox): an erasure of the
                    # caller after this moment wins over this write, however late it is delivered.
                    "ended_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                }
                self._result = await self._client.end_conversation(self.conversation_id, body)
            return self._result

    @property
    def ended(self) -> bool:
        return self._result is not None
