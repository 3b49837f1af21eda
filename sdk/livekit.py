"""Caller Memory for LiveKit Agents (the SDK's ``livekit`` extra): the caller's memory in the model's context
every turn without delaying it, tools that write ``conv.state`` and the outcome, the transcript into
conversation memory, and the end of the call persisted however the call ends.

::

    from caller_memory.sdk.livekit import MemoryAgent, remember_caller

    class Receptionist(MemoryAgent):  # instead of Agent
        ...

    async def entrypoint(ctx: JobContext) -> None:
        client = await MemoryClient(url, token=token, project=project).open()  # aclose() it after the end
        await ctx.connect()
        participant = await ctx.wait_for_participant()
        session = AgentSession(llm=..., stt=..., tts=..., vad=...)
        remember_caller(session, client, participant=participant, job=ctx)  # the one line
        await session.start(Receptionist(instructions="..."), room=ctx.room)

Why it is built this way (LiveKit Agents 1.7 and 1.8):

- The memory goes into the context in :meth:`MemoryAgent.llm_node`, on a copy of each inference's context:
  LiveKit's documented place, ``on_user_turn_completed``, edits the turn's context after a preemptive
  generation started (on by default) and is never called by ``session.run()``; and LiveKit hands the tool
  follow-up the same context object, where an edit in place would add a second memory message. The message
  is never added to ``session.history``.
- The read starts when the call starts (a personal greeting) and when the caller starts speaking
  (``user_state_changed`` to ``speaking``); an inference waits for it at most the client's read budget.
- The end starts in its own task from the session's ``close`` event (the bot, the caller's hang-up, an
  error) and from a job shutdown callback that waits for it (a worker's shutdown leaves a job a few seconds
  for its callbacks). The end is in the SDK's outbox from its first moment: a killed process keeps it.
- Caller-ID trust: the STIR/SHAKEN result, from the SIP headers LiveKit puts in the participant's attributes
  when the trunk asks (:func:`attestation_from_participant`), goes with every read and the end, and so does
  a step-up check passed mid-call (:meth:`CallMemory.step_up_passed`).
- LiveKit logs room names and SIP identities (both usually hold the number) and what the caller says: every
  :class:`CallMemory` puts a filter masking phone numbers on LiveKit's loggers (:func:`mask_livekit_logs`).
  Its tracing spans copy ``sip.phoneNumber``; only the application can turn that off (docs/livekit.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import weakref
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from livekit import rtc
from livekit.agents import (
    Agent,
    AgentSession,
    CloseEvent,
    ConversationItemAddedEvent,
    JobContext,
    ModelSettings,
    RunContext,
    UserStateChangedEvent,
    function_tool,
    llm,
)
from livekit.agents.voice.generation import INSTRUCTIONS_MESSAGE_ID

from . import _trust
from ._livekit_sip import (
    HANG_UPS,
    SIP_ATTESTATION_ATTRIBUTES,
    SIP_CALL_ID,
    SIP_PHONE_NUMBER,
    attestation_from_participant,
    caller_from_participant,
)
from ._log_masking import mask_livekit_logs
from .client import MemoryClient
from .conversation import DEFAULT_CHANNEL, Conversation, EndResult
from .memory import Memory
from .render import render_memory

__all__ = [
    "MEMORY_MESSAGE_ID",
    "SIP_ATTESTATION_ATTRIBUTES",
    "SIP_CALL_ID",
    "SIP_PHONE_NUMBER",
    "CallMemory",
    "MemoryAgent",
    "attestation_from_participant",
    "caller_from_participant",
    "mask_livekit_logs",
    "memory_tools",
    "remember_caller",
]

#: The id of the one memory message in each inference's context.
MEMORY_MESSAGE_ID = "caller_memory"
#: LiveKit's ids of the instructions messages (whose values "must not change", says LiveKit): the memory
#: message goes right after them, so that the instructions stay a cacheable prefix.
_INSTRUCTION_IDS: tuple[str, ...] = (INSTRUCTIONS_MESSAGE_ID,)
with contextlib.suppress(ImportError):  # LiveKit Agents 1.8 added dynamic instructions (1.7 has none)
    from livekit.agents.llm.chat_context import DYNAMIC_INSTRUCTIONS_MESSAGE_ID

    _INSTRUCTION_IDS += (DYNAMIC_INSTRUCTIONS_MESSAGE_ID,)
#: How long the job's shutdown callback waits for the session's own close before ending the call itself.
CLOSE_GRACE = 2.0
#: The end reason for each way LiveKit closes a session. A job shutdown or an error cuts the call short:
#: "dropped", so that the caller is offered ``resume`` on calling back.
END_REASONS: dict[str, str] = {
    "participant_disconnected": "completed",
    "user_initiated": "completed",
    "task_completed": "completed",
    "error": "dropped",
    "job_shutdown": "dropped",
}

log = logging.getLogger("caller_memory.sdk")  # masked by the SDK (numbers never reach a handler)

_calls: weakref.WeakKeyDictionary[AgentSession[Any], CallMemory] = weakref.WeakKeyDictionary()


def _no_request_bodies(record: logging.LogRecord) -> bool:
    """The OpenAI client before 3.0 (LiveKit Agents 1.7 needs ``openai<3``) logs each request's body at DEBUG,
    the model's context with the memory and the caller's words: keep its method and URL, as 3.0 does."""
    if record.msg == "Request options: %s" and isinstance(record.args, dict):  # one dict: args is the dict
        record.args = {k: v for k, v in record.args.items() if k in ("method", "url")}
    return True


@dataclass
class _Pending:
    """A transcript message waiting for its turn's read (its turn id is known once the read is done)."""

    turn: asyncio.Task[tuple[Memory, int]]
    message: dict[str, Any]


class CallMemory:
    """One call's caller memory in an :class:`AgentSession`. Made by :func:`remember_caller`; tools reach it
    with ``CallMemory.of(context)``.

    - :attr:`state`: what to remember about the caller, written at the end (the keys the project's
      ``state_keys`` allow; the others are reported as ignored).
    - :meth:`set_outcome`, :meth:`transfer`: the outcome sent with the end (and analytics).
    - :meth:`wait_ended`: the end's result, once it is persisted (or kept in the outbox)."""

    def __init__(
        self,
        client: MemoryClient,
        *,
        caller: str | None = None,
        conversation_id: str | None = None,
        channel: str = DEFAULT_CHANNEL,
        agent: str | None = None,
        transcript: bool = True,
        attestation: str | None = None,
        step_up: bool = False,
    ) -> None:
        mask_livekit_logs()  # here, not at import: for the loggers LiveKit made since, too
        logging.getLogger("openai._base_client").addFilter(_no_request_bodies)  # once: addFilter sees to it
        self.client = client
        self.channel = channel
        self.agent = agent
        self.transcript = transcript
        self._attestation = _trust.checked_attestation(attestation)
        self._step_up = _trust.checked_step_up(step_up)
        self.conversation: Conversation | None = None
        self._state: dict[str, Any] = {}
        self._outcome: dict[str, str | None] = {"qa": None, "handoff_reason": None, "handoff_to": None}
        self._end_reason: str | None = None
        self._turn: asyncio.Task[tuple[Memory, int]] | None = None
        self._answered = False
        self._pending: list[_Pending] = []
        self._last_ctx: llm.ChatContext | None = None
        self._generated = ""
        #: Whether anything was said yet (the agent's first words before the caller's are its greeting).
        self._heard = False
        self._closed = asyncio.Event()
        self._end: asyncio.Task[EndResult | None] | None = None
        self._no_number_said = False
        self.set_caller(caller, conversation_id)

    def __repr__(self) -> str:
        conv = self.conversation
        return f"<CallMemory {conv.conversation_id if conv else 'without a caller'}>"

    # The caller -------------------------------------------------------------------------------------

    def set_caller(self, caller: str | None, conversation_id: str | None = None) -> None:
        """Name the caller (their number, in any form the project reads) once it is known; the memory read
        starts at once. Without a number there is no memory for the call: not an error, said once in the
        log. A second call does nothing (a call has one caller). Messages said before it are not kept."""
        if self.conversation is not None:
            return
        if not caller:
            if not self._no_number_said:
                self._no_number_said = True
                log.info(
                    "no caller number for this call (a SIP participant without sip.phoneNumber, say, when "
                    "the dispatch rule hides it): no caller memory until one is set"
                )
            return
        try:
            conv = self._conversation(caller, conversation_id)
        except ValueError as exc:  # a call id the service would refuse: use one of ours instead
            log.warning("conversation id not usable (%s); using a generated one", exc)
            conv = self._conversation(caller, None)
        conv.state.update(self._state)
        self.conversation = conv
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # the first turn reads it
        conv.prefetch()  # the greeting's memory, read while the session starts

    def _conversation(self, caller: str, conversation_id: str | None) -> Conversation:
        return self.client.conversation(
            conversation_id
            or f"lk-{secrets.token_hex(8).translate(str.maketrans('0123456789', 'ghijklmnop'))}",
            caller=caller,
            channel=self.channel,
            agent=self.agent,
            transcript=self.transcript,
            attestation=self._attestation,
            step_up=self._step_up,
        )

    def step_up_passed(self) -> None:
        """The caller passed a step-up check (your tool verified a PIN or a one-time code): from the next turn
        on, the reads and the end carry it, so the fields that need it are read and may be written. Before the
        caller is known, it is kept for the conversation."""
        self._step_up = True
        if self.conversation is not None:
            self.conversation.step_up_passed()

    @property
    def state(self) -> dict[str, Any]:
        """``conv.state``: what to remember about the caller, written at the end of the call."""
        return self.conversation.state if self.conversation is not None else self._state

    @property
    def memory(self) -> Memory | None:
        """The memory of the current turn, or None before the first read finished (or without a caller).
        To wait for the read: :meth:`memory_message`."""
        turn = self._turn
        if turn is None or not turn.done() or turn.cancelled():
            return None
        return turn.result()[0]

    # The outcome ------------------------------------------------------------------------------------

    def set_outcome(
        self, *, qa: str | None = None, handoff_reason: str | None = None, handoff_to: str | None = None
    ) -> None:
        """The call's outcome, sent with the end (given values replace earlier ones)."""
        for name, value in (("qa", qa), ("handoff_reason", handoff_reason), ("handoff_to", handoff_to)):
            if value is not None:
                self._outcome[name] = value

    def transfer(self, to: str, reason: str | None = None) -> None:
        """Record a transfer (its destination and reason); the call ends as ``transferred``. Making the SIP
        transfer itself is the application's job (LiveKit's ``transfer_sip_participant``)."""
        self.set_outcome(handoff_to=to, handoff_reason=reason)
        self._end_reason = "transferred"

    # The session ------------------------------------------------------------------------------------

    @classmethod
    def of(cls, where: RunContext[Any] | AgentSession[Any] | Agent) -> CallMemory:
        """The call of a tool's ``RunContext``, a session or a running agent. LookupError when
        :func:`remember_caller` was not called for that session."""
        session = where.session if isinstance(where, RunContext | Agent) else where
        try:
            return _calls[session]
        except KeyError:
            raise LookupError("no caller memory for this session: call remember_caller() first") from None

    def attach(self, session: AgentSession[Any]) -> None:
        """Listen to ``session``: prefetch when the caller starts speaking, forward the transcript, end the
        call when it closes. :func:`remember_caller` does it."""
        _calls[session] = self
        session.on("user_state_changed", self._on_user_state)
        session.on("conversation_item_added", self._on_item)
        session.on("close", self._on_close)

    def watch_job(self, job: JobContext, participant: rtc.Participant | None = None) -> None:
        """End the call (and wait for its end) in the job's shutdown; with ``participant``, end it as
        ``dropped`` as soon as that participant leaves for another reason than a hang-up (LiveKit does
        not close the session then, the call would end only with the job)."""
        job.add_shutdown_callback(self._on_shutdown)
        if participant is not None:
            identity = participant.identity

            def left(gone: rtc.RemoteParticipant) -> None:
                if gone.identity == identity and gone.disconnect_reason not in HANG_UPS:
                    self._end_reason = self._end_reason or "dropped"
                    self._start_end("dropped")

            job.room.on("participant_disconnected", left)

    def _on_user_state(self, event: UserStateChangedEvent) -> None:
        if event.new_state == "speaking" and self.conversation is not None:
            self.conversation.prefetch()

    # Turns ------------------------------------------------------------------------------------------

    def _new_turn(self) -> asyncio.Task[tuple[Memory, int]]:
        """Start a turn: its read (``begin_turn()``, within the read budget), after the previous turn's,
        so that turns, and the messages waiting for them, complete in order."""
        conv = self.conversation
        assert conv is not None
        previous = self._turn

        async def turn() -> tuple[Memory, int]:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            memory = await conv.begin_turn()
            return memory, conv.turn_id

        task = asyncio.get_running_loop().create_task(turn())
        task.add_done_callback(self._turn_done)
        self._turn, self._answered = task, False
        return task

    def _current_turn(self) -> asyncio.Task[tuple[Memory, int]]:
        """This turn (a new one once the agent answered the last)."""
        if self._turn is None or self._answered:
            return self._new_turn()
        return self._turn

    def _turn_done(self, task: asyncio.Task[tuple[Memory, int]]) -> None:
        if not task.cancelled():
            task.exception()  # begin_turn() never raises for the service; retrieved either way
        self._flush()

    async def memory_message(self, chat_ctx: llm.ChatContext) -> str | None:
        """The memory message's text for an inference on ``chat_ctx`` (None: nothing to say). Waits for
        the turn's read, at most the read budget. A tool follow-up (LiveKit passes it the same context
        object, with the tool's output last) reuses its turn's memory."""
        conv = self.conversation
        if conv is None:
            return None
        items = chat_ctx.items
        follow_up = chat_ctx is self._last_ctx or bool(items and items[-1].type == "function_call_output")
        self._last_ctx = chat_ctx
        turn = self._turn if follow_up and self._turn is not None else self._current_turn()
        memory, _ = await asyncio.shield(turn)
        return render_memory(memory, conv.resume)

    async def with_memory(self, chat_ctx: llm.ChatContext) -> llm.ChatContext:
        """A copy of ``chat_ctx`` with the memory message right after the instructions (never ``chat_ctx``
        itself: LiveKit reuses it for the tool follow-up), or ``chat_ctx`` when there is nothing to say.
        For an ``llm_node`` of your own; :class:`MemoryAgent` calls it."""
        text = await self.memory_message(chat_ctx)
        if text is None:
            return chat_ctx
        ctx = chat_ctx.copy()
        ctx.items[:] = [item for item in ctx.items if item.id != MEMORY_MESSAGE_ID]
        at = 0
        for index, item in enumerate(ctx.items):
            if item.id in _INSTRUCTION_IDS:
                at = index + 1
        ctx.items.insert(at, llm.ChatMessage(id=MEMORY_MESSAGE_ID, role="system", content=[text]))
        return ctx

    async def watch(self, stream: AsyncIterable[Any]) -> AsyncIterator[Any]:
        """``stream`` (an ``llm_node``'s output) passed on unchanged; its text is kept as the ``original``
        of the assistant message if the caller interrupts it."""
        self._generated = ""
        async for chunk in stream:
            if isinstance(chunk, str):
                self._generated += chunk
            elif isinstance(chunk, llm.ChatChunk) and chunk.delta is not None and chunk.delta.content:
                self._generated += chunk.delta.content
            yield chunk

    # The transcript ---------------------------------------------------------------------------------

    def _on_item(self, event: ConversationItemAddedEvent) -> None:
        item = event.item
        if self.conversation is None or not self.transcript or not isinstance(item, llm.ChatMessage):
            return
        text = item.text_content
        if not text or item.role not in ("user", "assistant"):
            return
        message: dict[str, Any] = {"role": item.role, "content": text}
        if item.role == "user":
            turn = self._current_turn()
            self._heard = True
            # Audio turns carry the speech-to-text confidence; typed ones (session.run) do not.
            message["source"] = "asr" if item.transcript_confidence is not None else "message"
        else:
            turn = self._current_turn() if self._turn is None else self._turn
            self._answered = True
            # The agent's first words, before the caller said anything, are its greeting.
            message["source"] = "llm" if self._heard else "greeting"
            self._heard = True
            if item.interrupted:
                message["interrupted"] = True
                original = self._generated
                if original and original.strip() != text.strip():
                    message["original"] = original
        self._pending.append(_Pending(turn, message))
        self._flush()

    def _flush(self) -> None:
        """Hand the messages whose turn's read is done to the SDK (which sends them in the background)."""
        conv = self.conversation
        while self._pending and self._pending[0].turn.done():
            pending = self._pending.pop(0)
            if conv is None or conv.ended or pending.turn.cancelled():
                continue
            turn_id = pending.turn.result()[1]
            try:
                conv.add_message(**pending.message, turn_id=turn_id)
            except (RuntimeError, ValueError) as exc:  # ended meanwhile; a message the service refuses
                log.warning("conversation %s: a message was not kept: %s", conv.conversation_id, exc)

    # The end ----------------------------------------------------------------------------------------

    def _on_close(self, event: CloseEvent) -> None:
        # A synchronous handler (LiveKit's emitter takes no coroutine): the end runs in its own task, so
        # that the close, and the hang-up, never wait for it.
        self._closed.set()
        self._start_end(event.reason.value)

    async def _on_shutdown(self, reason: str) -> None:
        await self.finish()

    async def finish(self, grace: float = CLOSE_GRACE) -> EndResult | None:
        """For a job's shutdown callback: wait (at most ``grace`` seconds) for the session's close, whose
        reason says how the call ended, end the call if nothing did (as ``dropped``), and wait for the end.
        The job's shutdown callbacks run together, after the session's close in a worker shutdown. Never
        raises: a refused end is logged (and set aside in the outbox)."""
        try:
            async with asyncio.timeout(grace):
                await self._closed.wait()
        except TimeoutError:
            pass
        self._start_end("job_shutdown")
        try:
            return await self.wait_ended()
        except Exception as exc:  # a shutdown goes on; what was refused is in the outbox
            log.warning("the end of the call failed at shutdown: %s", exc)
            return None

    def end(self, reason: str = "user_initiated") -> asyncio.Task[EndResult | None]:
        """End the call now (the session's close does it; this is for a call ended otherwise), in its own
        task; a second call returns the first one's task."""
        return self._start_end(reason)

    def _start_end(self, reason: str) -> asyncio.Task[EndResult | None]:
        if self._end is None:
            self._end = asyncio.get_running_loop().create_task(self._ended(reason))
            self._end.add_done_callback(_logged)
        return self._end

    async def _ended(self, reason: str) -> EndResult | None:
        conv = self.conversation
        if conv is None:
            return None
        if self._turn is not None and not self._turn.done():
            await asyncio.wait([self._turn])  # bounded by the read budget: its messages go first
        self._flush()
        end_reason = self._end_reason or END_REASONS.get(reason, "completed")
        return await conv.end(**self._outcome, end_reason=end_reason)

    async def wait_ended(self) -> EndResult | None:
        """The end's result once it is persisted (or kept in the outbox: ``queued``); None for a call
        without a caller, or one that has not ended. Raises what ``conv.end()`` raises (a refusal)."""
        if self._end is None:
            return None
        return await asyncio.shield(self._end)

    @property
    def ended(self) -> bool:
        """Whether the end has started."""
        return self._end is not None


def _logged(task: asyncio.Task[EndResult | None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("the end of the call failed: %s", exc)


def remember_caller(
    session: AgentSession[Any],
    client: MemoryClient,
    *,
    participant: rtc.Participant | None = None,
    caller: str | None = None,
    conversation_id: str | None = None,
    job: JobContext | None = None,
    channel: str = DEFAULT_CHANNEL,
    agent: str | None = None,
    transcript: bool = True,
    attestation: str | None = None,
    attestation_attribute: str | None = None,
    step_up: bool = False,
) -> CallMemory:
    """The one line: caller memory for the call ``session`` serves. Call it before ``session.start()``.

    The caller and the conversation id come from ``participant``'s SIP attributes (``sip.phoneNumber``,
    ``sip.callID``) or from ``caller`` and ``conversation_id`` (which win); later with
    ``CallMemory.set_caller()``. Take the participant from ``await ctx.wait_for_participant()`` (it needs
    the connected room). With ``job``, the job's shutdown waits for the end; with both ``job`` and
    ``participant``, a caller whose line drops ends the call at once, as ``dropped`` (with ``job`` alone,
    the call ends with the job). ``channel``: the SDK's ``"phone"`` unless named (resume and supersession need
    one channel). The session's agents derive from :class:`MemoryAgent`. Masks numbers in LiveKit's logs.

    The call's caller-ID attestation is ``attestation`` (the provider's value as given, or ``A``, ``B``,
    ``C``, ``failed``, ``unknown``), else the participant's (:func:`attestation_from_participant`, reading
    ``attestation_attribute`` or :data:`SIP_ATTESTATION_ATTRIBUTES`). ``step_up``: the caller already passed
    a step-up check; later, :meth:`CallMemory.step_up_passed`."""
    if participant is not None:
        number, call_id = caller_from_participant(participant)
        caller, conversation_id = caller or number, conversation_id or call_id
        if attestation is None:
            attestation = attestation_from_participant(participant, attestation_attribute)
    call = CallMemory(
        client,
        caller=caller,
        conversation_id=conversation_id,
        channel=channel,
        agent=agent,
        transcript=transcript,
        attestation=attestation,
        step_up=step_up,
    )
    call.attach(session)
    if job is not None:
        call.watch_job(job, participant)
    return call


class MemoryAgent(Agent):
    """An :class:`~livekit.agents.Agent` whose every inference carries the caller's memory as one message
    right after its instructions (``render_memory``: data, framed as not being instructions), read within
    the read budget; tool follow-ups reuse their turn's memory. Derive your agents from it instead of
    ``Agent``. Overriding ``llm_node`` yourself: ``call = CallMemory.of(self)``, then
    ``call.watch(Agent.default.llm_node(self, await call.with_memory(chat_ctx), tools, model_settings))``.

    Realtime (speech-to-speech) models do not run ``llm_node``: see docs/livekit.md."""

    async def llm_node(
        self, chat_ctx: llm.ChatContext, tools: list[llm.Tool], model_settings: ModelSettings
    ) -> AsyncIterator[llm.ChatChunk | str | Any]:
        call = _calls.get(self.session)
        if call is None:  # remember_caller() was not called: an agent like any other
            async for chunk in Agent.default.llm_node(self, chat_ctx, tools, model_settings):
                yield chunk
            return
        ctx = await call.with_memory(chat_ctx)
        async for chunk in call.watch(Agent.default.llm_node(self, ctx, tools, model_settings)):
            yield chunk


# Tools ---------------------------------------------------------------------------------------------


async def _remember(context: RunContext[Any], key: str, value: str) -> str:
    """Remember something about the caller for their next calls.

    Args:
        key: what it is (one of the names this agent was told it may remember, e.g. caller_name)
        value: the value, as the caller gave it
    """
    CallMemory.of(context).state[key] = value
    return f"noted {key}"


async def _record_outcome(
    context: RunContext[Any],
    qa: Literal["resolved", "unresolved", "escalated"],
    transfer_to: str | None = None,
    transfer_reason: str | None = None,
) -> str:
    """Record how the call went, before it ends: whether the caller's request was resolved and, when the
    call is being transferred, to whom and why.

    Args:
        qa: resolved, unresolved or escalated
        transfer_to: where the call is transferred to, if it is
        transfer_reason: why it is transferred, if it is
    """
    call = CallMemory.of(context)
    call.set_outcome(qa=qa)
    if transfer_to:
        call.transfer(transfer_to, transfer_reason)
    return "recorded"


def memory_tools() -> list[llm.Tool]:
    """Two ready tools for an agent's ``tools=``: ``remember(key, value)`` writes ``conv.state`` (keys the
    project does not store are reported as ignored at the end), ``record_outcome(qa, transfer_to,
    transfer_reason)`` sets the outcome (a transfer ends the call as ``transferred``). Tools of your own
    reach the call with ``CallMemory.of(context)``."""
    return [
        function_tool(_remember, name="remember"),
        function_tool(_record_outcome, name="record_outcome"),
    ]
