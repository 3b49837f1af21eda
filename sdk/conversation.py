"""One phone call: ``conv.memory`` (read once per turn), ``conv.state`` (written at the end), and, with
``transcript=True``, what was said (``conv.add_message()``, sent in the background) and what the service
makes of it (``conv.history()``, ``conv.context()``, ``conv.set_summary()``, ``conv.resume``)."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from ._sender import TranscriptBuffer
from ._transcript_reads import HistoryFormat as HistoryFormat
from ._transcript_reads import TranscriptReads, _HistoryKey, _ReadsTransport
from ._trust import body_members
from ._wire import StartedAnswer
from .errors import ServiceError, ServiceUnavailableError
from .memory import Memory
from .state import State, checked_state
from .transcript import (
    END_REASONS,
    MAX_INT,
    MESSAGE_ID,
    History,
    Resume,
    TranscriptError,
    build_message,
    check_integer,
)

log = logging.getLogger("caller_memory.sdk")

#: The channel of a conversation when none is named, everywhere the SDK takes one (``client.conversation()``,
#: the Pipecat and LiveKit drop-ins): transcripts, ``resume`` and supersession stay within one channel, so one
#: default lets a call made one way be resumed by a call made another. ``"phone"``: a phone agent's line.
DEFAULT_CHANNEL = "phone"

#: Seconds of the read budget that must be left for the first ``begin_turn()`` to read the memory again
#: after a start that offered a resume (the start may have persisted the superseded call's state).
MIN_REREAD = 0.005


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
    #: The service had already ended the conversation (by inactivity, or a callback superseded it): the
    #: state was applied as a merge patch (a field written later stays); analytics stayed as recorded.
    late: bool = False
    #: State keys of ``conv.state`` this call was not allowed to write or delete (caller-ID trust: it did
    #: not qualify for their class); they were not stored.
    withheld: tuple[str, ...] = ()


class _Transport(_ReadsTransport, Protocol):
    """What a conversation needs of its client (:class:`~caller_memory.sdk.MemoryClient` is one). A protocol,
    so that this module does not import client.py, which imports this one: the two have no import cycle, not
    even one for type checking. What its transcript's reads need comes with :class:`_ReadsTransport`."""

    read_budget: float

    async def read_memory(
        self,
        caller: str,
        *,
        previous: Memory | None = None,
        budget: float | None = None,
        attestation: str | None = None,
        step_up: bool = False,
    ) -> Memory: ...

    async def _end_conversation(
        self, conversation_id: str, body: dict[str, Any], transcript: TranscriptBuffer | None = None
    ) -> EndResult: ...

    def _transcript_buffer(
        self,
        conversation_id: str,
        *,
        caller: str,
        channel: str,
        agent: str | None,
        state: Callable[[], Mapping[str, Any]],
        trust: Callable[[], Mapping[str, Any]] | None = None,
    ) -> TranscriptBuffer: ...

    async def _start_conversation(
        self, conversation_id: str, body: dict[str, Any], seconds: float
    ) -> StartedAnswer: ...


class _Default(enum.Enum):
    """The default of ``end(channel=...)``: the conversation's channel (None sends no channel)."""

    CONVERSATION = "the conversation's channel"


class Conversation(TranscriptReads):
    """Created by :meth:`MemoryClient.conversation`; one per call."""

    _client: _Transport

    def __init__(
        self,
        client: _Transport,
        conversation_id: str,
        caller: str,
        *,
        channel: str = DEFAULT_CHANNEL,
        agent: str | None = None,
        transcript: bool = False,
        attestation: str | None = None,
        step_up: bool = False,
    ) -> None:
        self._client = client
        self.conversation_id = conversation_id
        self.caller = caller
        #: The channel of the call (:data:`DEFAULT_CHANNEL`, ``"phone"``, unless named: ``"chat"``, ...):
        #: the end reports it, and transcripts, history and ``resume`` are kept per channel.
        self.channel = channel
        #: The agent that handles the call (``metadata.agent`` of its assistant and tool messages).
        self.agent = agent
        self._attestation = attestation
        self._step_up = step_up
        #: What to remember about the caller; written at the end of the conversation, keys in state_keys only.
        self.state: dict[str, Any] = State()
        self._memory: Memory | None = None
        self._result: EndResult | None = None
        #: When end() was first called; every later call (after a cancellation) sends the same moment.
        self._ended_at: str | None = None
        self._ending = asyncio.Lock()
        self._turn = 0
        self._last_turn = 0
        self._buffer: TranscriptBuffer | None = None
        if transcript:
            self._buffer = client._transcript_buffer(
                conversation_id,
                caller=caller,
                channel=channel,
                agent=agent,
                state=lambda: checked_state(self.state),
                trust=self._trust_members,
            )
        self._start_pending = transcript
        self._resume: Resume | None = None
        self._start_error: str | None = None
        self._history_cache: dict[_HistoryKey, tuple[str, History | list[dict[str, str]]]] = {}
        self._prefetch: asyncio.Task[Memory] | None = None

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

    # Caller-ID trust ------------------------------------------------------------------------------------

    @property
    def attestation(self) -> str | None:
        """The call's caller-ID attestation as given to ``client.conversation()`` (the service normalises it;
        ``conv.memory.attestation`` is what it made of it), or None."""
        return self._attestation

    @property
    def step_up(self) -> bool:
        """Whether the caller passed a step-up check in this call (:meth:`step_up_passed`)."""
        return self._step_up

    def step_up_passed(self) -> None:
        """The caller passed a step-up check (the agent verified a PIN or a one-time code): from now on every
        read, checkpoint and the end carry ``step_up``, so the fields that need it are read and may be
        written. The next :meth:`begin_turn` reads again with it (a prefetch started before is not taken).
        It cannot be taken back within the call; calling it again does nothing."""
        if self._step_up:
            return
        self._step_up = True
        self._prefetch = None  # read with the old trust: left to finish unseen (its result is not used)
        self._history_cache.clear()

    def _trust_members(self) -> dict[str, Any]:
        return body_members(self._attestation, self._step_up)

    def _read(self, previous: Memory | None, budget: float | None = None) -> Coroutine[Any, Any, Memory]:
        return self._client.read_memory(
            self.caller,
            previous=previous,
            budget=budget,
            attestation=self._attestation,
            step_up=self._step_up,
        )

    @property
    def turn_id(self) -> int:
        """The current turn: 0 before the first :meth:`begin_turn`, one more at each (the default turn of
        :meth:`add_message`). A resumed conversation id continues from the service's latest turn."""
        return self._turn

    def prefetch(self) -> None:
        """Start the next turn's memory read now, in the background: when the caller starts speaking, so
        that the read is hidden behind their speech. The next :meth:`begin_turn` takes its result (waiting
        for it if it still runs, never longer than the read budget from now) instead of reading again.
        Calling it again before that :meth:`begin_turn` does nothing. Needs a running event loop."""
        if self._prefetch is None:
            task = asyncio.get_running_loop().create_task(self._fetch())
            task.add_done_callback(_retrieved)
            self._prefetch = task

    async def begin_turn(self) -> Memory:
        """Fetch the caller's memory once for this turn (within the client's read budget), and start a new
        turn (:attr:`turn_id`). After :meth:`prefetch`, takes that read's memory instead (waiting for it if
        it still runs).

        Never raises because of the service: on a timeout, an error or an open circuit, ``conv.memory`` is
        the memory of the previous turn marked ``stale`` while none of its fields can have expired
        (its ``valid_until``), else empty with ``available`` False. An unchanged memory costs a
        ``304 Not Modified``.

        With ``transcript=True``, the first call starts the conversation first (``POST .../start``, within
        the same budget; :attr:`resume` is then known), and every call sends ``conv.state`` as a checkpoint
        in the background if it changed.
        """
        task, self._prefetch = self._prefetch, None
        if task is None:
            memory = await self._fetch()
        else:
            try:
                memory = await asyncio.shield(task)
            except asyncio.CancelledError:
                if self._prefetch is None and not task.done():  # this turn was cancelled, not the read
                    self._prefetch = task
                raise
        self._memory = memory
        self._turn += 1
        if self._buffer is not None:
            self._buffer.kick()
        return self._memory

    async def _fetch(self) -> Memory:
        if not self._start_pending:
            return await self._read(self._memory)
        # The first turn of a transcript: the start and the read at once, each within the whole budget (one
        # after the other, a service 100 ms away fitted neither in 150 ms: the greeting had no memory).
        self._start_pending = False
        loop = asyncio.get_running_loop()
        budget = self._client.read_budget
        deadline = loop.time() + budget
        read = loop.create_task(self._read(self._memory, budget))
        try:
            await self._start(budget)
        except BaseException:
            read.cancel()
            raise
        memory = await read
        left = deadline - loop.time()
        if self._resume is not None and memory.available and not memory.stale and left > MIN_REREAD:
            # The start may have ended the caller's dropped call (superseded) and persisted its last
            # checkpoint, after the read: read again with what is left (a 304 if nothing changed). If that
            # read fails, the first one stands (the dropped call's state is in resume anyway).
            again = await self._read(memory, left)
            if again.available and not again.stale:
                memory = again
        return memory

    async def _start(self, seconds: float) -> None:
        buffer = self._buffer
        assert buffer is not None
        body: dict[str, Any] = {"caller": self.caller, "channel": self.channel}
        if self.agent is not None:
            body["agent"] = self.agent
        body.update(self._trust_members())
        try:
            started = await self._client._start_conversation(self.conversation_id, body, seconds)
        except (ServiceError, ServiceUnavailableError) as exc:
            self._start_error = str(exc)
            log.warning(
                "conversation %s: the start failed, going on without resume: %s", self.conversation_id, exc
            )
            if isinstance(exc, ServiceError) and exc.status in (404, 409, 410, 422):
                buffer.turn_off(f"the service refused its start: {exc}")
            return
        if not started.stored:
            buffer.turn_off(f"the service does not store it ({started.reason or 'no reason given'})")
        elif started.conversation is not None:
            buffer.started()
            self._turn = max(self._turn, started.conversation.turn_id)
            self._last_turn = max(self._last_turn, started.conversation.turn_id)
            if started.conversation.status in ("ending", "ended"):
                buffer.turn_off("the conversation has already ended")
        self._resume = Resume._of(started.resume) if started.resume is not None else None

    @property
    def resume(self) -> Resume | None:
        """The caller's dropped conversation on this channel that the first :meth:`begin_turn` was offered
        (see :class:`~caller_memory.sdk.Resume`), or None: none was offered, transcripts are off, or the
        start did not answer in time (then :attr:`start_error` says why)."""
        return self._resume

    @property
    def start_error(self) -> str | None:
        """Why the start of the conversation failed (a timeout, an outage, a refusal), or None."""
        return self._start_error

    @property
    def transcript_off(self) -> str | None:
        """Why the service keeps no transcript of this call (conversation memory is off for the project,
        the caller is blacklisted or erased, the conversation ended, expired or was deleted), or None. Messages
        added then are dropped without an error."""
        return self._buffer.off if self._buffer is not None else "transcript=False"

    @property
    def transcript_errors(self) -> tuple[TranscriptError, ...]:
        """The message batches (and state checkpoints) the service refused for good, oldest first (the last
        100): see :class:`~caller_memory.sdk.TranscriptError`."""
        return tuple(self._buffer.errors) if self._buffer is not None else ()

    @property
    def unsent(self) -> int:
        """Messages added that the service is not known to have yet (being sent, or in the outbox)."""
        return self._buffer.unsent if self._buffer is not None else 0

    def add_message(
        self,
        role: str,
        content: str,
        *,
        turn_id: int | None = None,
        source: str | None = None,
        interrupted: bool = False,
        original: str | None = None,
        interrupt_timestamp: int | None = None,
        agent: str | None = None,
        tokens: int | None = None,
        message_id: str | None = None,
        timestamp: int | None = None,
    ) -> str:
        """Add one message to the transcript; returns its ``message_id``. Never waits and never raises
        because of the service: the message is buffered and sent in the background (see the SDK docs).

        - ``role``: ``user``, ``assistant`` or ``tool``; ``content``: what was said (for an interrupted
          assistant message, what was actually spoken; ``original`` is what the model generated).
        - ``turn_id``: defaults to :attr:`turn_id`; a larger one moves the current turn on. Turn ids never
          decrease.
        - ``source``: how it was made (``asr``, ``message``, ``command``; ``llm``, ``greeting``,
          ``llm_failure``, ``silence``; ``tool``), fitting the role; the service's default when None.
        - ``agent``: which agent wrote it (defaults to the conversation's agent for assistant and tool
          messages); ``tokens``: its token count, if you know it (else the service estimates).
        - ``message_id``: generated when None (what makes a retry harmless); ``timestamp``: epoch ms, now
          when None.

        Raises ValueError for arguments the service would refuse (a source that does not fit the role,
        ``original`` on a message that was not interrupted, a turn id lower than the last one, a message over
        16 KiB as JSON...), RuntimeError when the conversation was made without ``transcript=True`` or has
        ended. Nothing is buffered then.
        """
        buffer = self._buffer
        if buffer is None:
            raise RuntimeError(
                "this conversation keeps no transcript: make it with "
                "client.conversation(..., transcript=True) to add messages"
            )
        if buffer.closed or self.ended:
            raise RuntimeError(
                f"conversation {self.conversation_id} has ended (or its client was closed): no message can be added"
            )
        turn = self._turn if turn_id is None else check_integer(turn_id, "turn_id", 0, MAX_INT)
        if turn < self._last_turn:
            raise ValueError(
                f"turn_id {turn} is lower than the last message's ({self._last_turn}); turn ids never decrease"
            )
        if message_id is None:
            message_id = buffer.new_id()
        elif not isinstance(message_id, str) or not MESSAGE_ID.fullmatch(message_id):
            raise ValueError(
                "message_id must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
            )
        if agent is None and role != "user":
            agent = self.agent
        encoded = build_message(
            role,
            content,
            turn_id=turn,
            message_id=message_id,
            timestamp=int(time.time() * 1000) if timestamp is None else timestamp,
            source=source,
            interrupted=interrupted,
            original=original,
            interrupt_timestamp=interrupt_timestamp,
            agent=agent,
            tokens=tokens,
        )
        self._last_turn = turn
        self._turn = max(self._turn, turn)
        buffer.add(message_id, encoded)
        return message_id

    async def end(
        self,
        *,
        qa: str | None = None,
        handoff_reason: str | None = None,
        handoff_to: str | None = None,
        channel: str | _Default | None = _Default.CONVERSATION,
        end_reason: str | None = None,
    ) -> EndResult:
        """Send ``conv.state`` and the outcome. Retries transient failures, then queues in the outbox.

        With ``transcript=True`` the messages still unsent go first (for up to the retry policy's
        ``worst_case``); what cannot be sent is kept in the outbox, and the end is then kept behind it
        (``queued=True``), so that the service gets the messages before the end.

        ``channel`` defaults to the conversation's; ``end_reason`` is ``completed``, ``dropped`` (the caller
        is then offered ``resume`` when they call back) or ``transferred``, or None.

        The request is kept in the durable outbox from the start, so a crash or a cancellation of this call
        does not lose it; calling it again after a cancellation sends the first call's ``ended_at``. Raises
        ValueError, before sending anything, if ``conv.state`` holds what JSON cannot carry exactly (NaN,
        Infinity, integers beyond 2**53, non-str keys, other types). Raises
        :class:`~caller_memory.sdk.errors.ServiceError` subclasses for requests the service refuses (invalid
        state values, a revoked token): the entry is then set aside in the outbox (see
        ``client.outbox.rejected()``), not deleted. Raises
        :class:`~caller_memory.sdk.errors.OutboxUnavailableError` if the service is unreachable *and* the
        outbox cannot be written. Once it returned a result (delivered or queued), calling it again returns
        that result without sending anything, whatever the arguments.
        """
        async with self._ending:  # two concurrent end() calls send one request
            if self._result is None:
                if self._ended_at is None:
                    self._ended_at = datetime.now(UTC).isoformat(timespec="milliseconds")
                state = checked_state(self.state)
                sent_channel = self.channel if isinstance(channel, _Default) else channel
                for name, given in (
                    ("qa", qa),
                    ("handoff_reason", handoff_reason),
                    ("handoff_to", handoff_to),
                    ("channel", sent_channel),
                ):
                    if given is not None and not isinstance(given, str):
                        raise ValueError(f"{name} must be a string or None, not {type(given).__name__}")
                if end_reason is not None and end_reason not in END_REASONS:
                    raise ValueError(f"end_reason must be one of {', '.join(END_REASONS)}, or None")
                body = {
                    "caller": self.caller,
                    "state": state,
                    "outcome": {"qa": qa, "handoff_reason": handoff_reason, "handoff_to": handoff_to},
                    "channel": sent_channel,
                    # When end() was first called, sent with every attempt and every later call (kept here
                    # and in the outbox, which keeps the first one across processes): an erasure of the
                    # caller after this moment wins over this write, however late it is delivered.
                    "ended_at": self._ended_at,
                }
                if end_reason is not None:  # only when given: a service from before it refuses the member
                    body["end_reason"] = end_reason
                # Likewise only when they say something: what the call may write and delete.
                body.update(self._trust_members())
                self._result = await self._client._end_conversation(self.conversation_id, body, self._buffer)
            return self._result

    @property
    def ended(self) -> bool:
        return self._result is not None


def _retrieved(task: asyncio.Task[Memory]) -> None:
    """A prefetch nobody took (the call ended first): its failure, if any, is not reported as unretrieved."""
    if not task.cancelled():
        task.exception()
