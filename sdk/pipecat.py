"""Caller Memory for Pipecat: one processor, placed between the user context aggregator and the LLM.

::

    from caller_memory.sdk.pipecat import CallerMemory

    caller = twilio_caller(call_data)  # the number and attestation your voice webhook signed (Twilio)
    memory = CallerMemory(
        client, conversation_id=call_data.call_id, caller=caller.number, attestation=caller.attestation
    )
    pipeline = Pipeline([transport.input(), stt, pair.user(), memory, llm, tts, transport.output(), pair.assistant()])
    ...
    await runner.run()
    await memory.finished()  # the end of the call, persisted (or kept in the outbox)

- **Memory in every turn, without delaying it.** The read starts when the pipeline starts (the greeting) and
  when the caller starts speaking (``UserStartedSpeakingFrame``: hidden behind their speech). The user
  aggregator's ``LLMContextFrame`` takes it (``conv.begin_turn()``, at most the read budget) and puts it in
  the shared ``LLMContext`` as **one** ``developer`` message (:func:`~caller_memory.sdk.render_memory`),
  replaced in place every turn. Function-call follow-ups go straight to the LLM and reuse it.
- **Tools** (:meth:`CallerMemory.state_tool`, :meth:`~CallerMemory.outcome_tool`,
  :meth:`~CallerMemory.transfer_tool`) write ``conv.state`` and the outcome of the call.
- **The transcript** (``transcript=True``): user messages and assistant turns (an interrupted one with what
  was spoken, and the generated text as ``original``) go to conversation memory in the background.
- **The end of the call**, however it ends (``EndFrame``, ``CancelFrame``), in its own task so that the frame
  carrying the hang-up is never held back; :meth:`CallerMemory.finished` waits for it.
- **Caller-ID trust.** The call's STIR/SHAKEN attestation (:func:`twilio_caller` for a Twilio stream whose
  parameters your webhook signed with :mod:`caller_memory.sdk.twilio`, :func:`attestation_from`, or
  ``attestation=``) and a step-up check passed mid-call (:meth:`CallerMemory.step_up_passed`) go with every read and the end: the
  fields the call does not qualify for are withheld (``conv.memory.withheld``).
- **Logs.** Pipecat logs the caller's number and the whole LLM context through loguru at DEBUG: every
  ``CallerMemory`` installs :func:`install_log_redaction` (importing this module changes no logger; call it
  at your app's start for what Pipecat logs before the first one). See docs/pipecat.md.

This is the only module of the SDK that imports Pipecat; it is imported only by Pipecat users.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

# Pipecat 1.14 moved the LLM adapters under pipecat.adapters.llm (the old modules stay, deprecated, until 2.0);
# 1.13 has only the old ones.
try:
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
except ImportError:  # Pipecat 1.13
    from pipecat.adapters.schemas.function_schema import FunctionSchema
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    LLMContextFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    StartFrame,
    UserStartedSpeakingFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    AssistantTurnStoppedMessage,
    LLMAssistantAggregator,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup
from pipecat.services.llm_service import FunctionCallParams, LLMService

from . import _log_masking, _trust
from ._log_masking import redact_log_record
from ._telemetry import within
from ._telephony import attestation_from, caller_from, twilio_caller
from .client import CONVERSATION_ID, MemoryClient
from .conversation import DEFAULT_CHANNEL, Conversation, EndResult
from .errors import CallerMemoryError
from .memory import Memory
from .render import render_memory

__all__ = [
    "CallerMemory",
    "attestation_from",
    "caller_from",
    "install_log_redaction",
    "redact_log_record",
    "twilio_caller",
]

#: A child logger's records skip the parent's filters: this one masks its own (install_log_redaction()).
log = logging.getLogger("caller_memory.sdk.pipecat")

#: How long the end of a call waits for the terminal frame to reach the end of the pipeline (so that the
#: assistant turn it closes is in the transcript) before it is sent anyway.
END_WAIT = 2.0

#: Generated ids are hex written with the letters g-p for 0-9: no run of digits in them that the logs'
#: number masking would take for a phone number.
_NO_DIGITS = str.maketrans("0123456789", "ghijklmnop")


# Logs -----------------------------------------------------------------------------------------------------


def install_log_redaction() -> None:
    """Keep the caller's number and memory out of Pipecat's logs. Idempotent; called by every
    :class:`CallerMemory` (so that it is back after an app replaced it). Call it yourself once at your app's
    start when Pipecat logs before the first ``CallerMemory`` is made (the telephony handshake of
    ``parse_telephony_websocket``, a server's websocket frames): importing this module does not.

    - A loguru patcher (:func:`redact_log_record`), chained before the app's own (found, best effort, as
      ``logger._core.patcher``: loguru has no public way to read it). A later ``logger.configure(patcher=...)``
      replaces it: call :func:`redact_log_record` from yours (or create the CallerMemory after it).
    - ``PIPECAT_LOG_LLM_CONTEXT=off`` unless the environment sets it: LLM services then log inferences
      without the context (the memory, the caller's words); Pipecat's cached mode too, if an LLM service was
      already made. ``PIPECAT_LOG_LLM_CONTEXT=full`` keeps the context (and the memory) in DEBUG logs.
    - A masking filter on the std-logging ``uvicorn.error`` logger, which logs every websocket frame at DEBUG
      (a Twilio ``start`` frame's tail is its custom parameters: the number), and on this drop-in's own.
    """
    _log_masking.mask_loguru()
    if "PIPECAT_LOG_LLM_CONTEXT" not in os.environ:
        os.environ["PIPECAT_LOG_LLM_CONTEXT"] = "off"
        from pipecat.utils import log_config

        if getattr(log_config, "_llm_context_log_mode", None) is not None:
            log_config._llm_context_log_mode = log_config._LLMContextLogMode.OFF
    _log_masking.mask_std_logger("uvicorn.error")
    _log_masking.mask_std_logger(log.name)


# The processor --------------------------------------------------------------------------------------------


class _Watcher(BaseObserver):
    """Sees every frame's first push in the pipeline: the LLM's generated text (the ``original`` of an
    interrupted turn) and the assistant aggregator (to follow its turns). An observer rather than more
    processors, so that the integration stays one entry in the pipeline."""

    def __init__(self, owner: CallerMemory) -> None:
        super().__init__()
        self._owner = owner

    async def on_push_frame(self, data: FramePushed) -> None:
        source = data.source
        if isinstance(source, LLMService):
            frame = data.frame
            if data.direction != FrameDirection.DOWNSTREAM:
                return
            if isinstance(frame, LLMFullResponseStartFrame):
                self._owner._generated = []
            elif isinstance(frame, LLMTextFrame):
                self._owner._generated.append(frame.text)
        elif isinstance(source, LLMAssistantAggregator):
            self._owner._follow(source)  # its StartFrame, the first frame it passes on


class CallerMemory(FrameProcessor):
    """Caller Memory in a Pipecat pipeline, between the user context aggregator and the LLM.

    - ``client``: an open :class:`~caller_memory.sdk.MemoryClient` (one per process, shared by the calls).
    - ``conversation_id``: the call's id from the telephony layer (``call_data.call_id``). Without one, or
      with one the service would refuse, a ``pc-<hex>`` id is generated (logged once, at WARNING).
    - ``caller``: the caller's number (``call_data.from_number``), or None: no number means no memory for
      this call (not an error; said once in the log, at INFO, without a number). Set it later with
      :meth:`set_caller` (Genesys AudioHook: :meth:`follow_genesys`).
    - ``channel``, ``agent``: as for ``client.conversation()`` (``channel``: the SDK's ``"phone"`` unless
      named, so that resume and supersession meet calls made with the bare SDK or LiveKit's drop-in);
      ``transcript``: keep what is said in the service's conversation memory (the project needs
      ``conversation.enabled``).
    - ``attestation``: the call's caller-ID attestation as the provider gave it (:func:`twilio_caller`
      checks the one your Twilio webhook signed; the service normalises it), None for none; ``step_up``: the caller already passed a
      step-up check. Later: :meth:`step_up_passed`.
    - ``prefetch``: start the next turn's read when the caller starts speaking (True).
    - ``name``: the processor's name in Pipecat's logs and metrics.

    What it logs goes to the std-logging logger ``caller_memory.sdk.pipecat`` (not loguru).

    ``conv`` is the call's :class:`~caller_memory.sdk.Conversation` (None without a number): write
    ``conv.state`` from your own tools too. ``outcome`` is sent with the end (``qa``, ``handoff_reason``,
    ``handoff_to``, ``end_reason``); the tools set it, and so can you.
    """

    def __init__(
        self,
        client: MemoryClient,
        conversation_id: str | None = None,
        caller: str | None = None,
        *,
        channel: str = DEFAULT_CHANNEL,
        agent: str | None = None,
        transcript: bool = True,
        prefetch: bool = True,
        name: str | None = None,
        attestation: str | None = None,
        step_up: bool = False,
    ) -> None:
        super().__init__(name=name)
        install_log_redaction()
        self.client = client
        self.channel = channel
        self.agent = agent
        self.transcript = transcript
        self.prefetch = prefetch
        self.conv: Conversation | None = None
        self.outcome: dict[str, str | None] = {
            "qa": None,
            "handoff_reason": None,
            "handoff_to": None,
            "end_reason": None,
        }
        #: Seconds each turn's context frame was held here (waiting for the memory read), in order.
        self.turn_waits: list[float] = []
        #: The terminal frame that ended the call ("EndFrame", "CancelFrame"), once seen.
        self.ended_by: str | None = None
        self._conversation_id = conversation_id
        self._attestation = _trust.checked_attestation(attestation)
        self._step_up = _trust.checked_step_up(step_up)
        self._tail: str | None = None
        self._started = False
        self._message: dict[str, Any] | None = None  # the one memory message, in the context
        self._tracing: Any = None  # Pipecat's tracing context (its turns' spans), from setup()
        self._forwarded: set[int] = set()
        self._kept: list[object] = []  # the forwarded messages, so that their ids stay theirs
        self._generated: list[str] = []
        self._spoke = False
        self._followed: set[int] = set()
        self._watcher = _Watcher(self)
        self._finished = asyncio.Event()
        self._end_task: asyncio.Task[EndResult | None] | None = None
        self._no_number_said = False
        if caller is not None or conversation_id is not None:
            self.set_caller(caller, conversation_id)

    # The caller --------------------------------------------------------------------------------------

    def set_caller(
        self, caller: str | None, conversation_id: str | None = None, *, attestation: str | None = None
    ) -> Conversation | None:
        """Name the caller (and the conversation id) of this call, also after it started (Genesys gives the
        number only once the stream is open). The first number wins; without one there is no memory. If the
        pipeline already runs, the memory read starts at once. A missing id, or one the service would refuse
        (1-128 letters, digits, '.', '_', ':' or '-'), is replaced by a generated ``pc-<hex>`` one.
        ``attestation``, when given, replaces the one the processor was made with (before the caller is
        named; after, the call has the one it started with)."""
        if conversation_id is not None:
            self._conversation_id = conversation_id
        if attestation is not None and self.conv is None:
            self._attestation = _trust.checked_attestation(attestation)
        if self.conv is not None:
            return self.conv
        number = caller_from(caller)
        if number is None:
            if caller is not None or self._conversation_id is not None:
                self._say_no_number()
            return None
        given = self._conversation_id
        if not isinstance(given, str) or not CONVERSATION_ID.fullmatch(given):
            # As the LiveKit drop-in does. The refused id is not logged: it may be the number itself.
            why = "no conversation id" if given is None else "a conversation id the service would refuse"
            given = self._conversation_id = f"pc-{secrets.token_hex(8).translate(_NO_DIGITS)}"
            log.warning("%s; using the generated %s", why, given)
        self.conv = self.client.conversation(
            given,
            caller=number,
            channel=self.channel,
            agent=self.agent,
            transcript=self.transcript,
            attestation=self._attestation,
            step_up=self._step_up,
        )
        self._tail = _log_masking.call_started(number)
        if self._started:
            self.conv.prefetch()
        return self.conv

    def _say_no_number(self) -> None:
        if not self._no_number_said:
            self._no_number_said = True
            log.info(
                "call %s: no caller number from the telephony layer; no caller memory for this call "
                "unless set_caller() names one",
                self._conversation_id or "(no id yet)",
            )

    def step_up_passed(self) -> None:
        """The caller passed a step-up check (your tool verified a PIN or a one-time code): from the next turn
        on, the reads and the end carry it (``conv.step_up_passed()``), so the fields that need it are read and
        may be written. Before the caller is named, it is kept for the conversation."""
        self._step_up = True
        if self.conv is not None:
            self.conv.step_up_passed()

    def follow_genesys(self, serializer: Any) -> None:
        """Take the caller from a Genesys AudioHook serializer when its ``open`` message arrives (the
        participant's ``ani``, the Genesys ``conversationId``)."""

        async def on_open(serializer: Any, message: Any) -> None:
            participant = serializer.participant or {}
            self.set_caller(participant.get("ani"), self._conversation_id or serializer.conversation_id)

        serializer.add_event_handler("on_open", on_open)

    # Pipecat ---------------------------------------------------------------------------------------------

    async def setup(self, setup: FrameProcessorSetup) -> None:  # type: ignore[override]  # Pipecat narrows it itself
        await super().setup(setup)
        # Pipecat's tracing (enable_tracing=True) keeps each turn's span here, not as the current span.
        self._tracing = getattr(setup, "tracing_context", None)
        worker = setup.pipeline_worker
        worker.add_observer(self._watcher)

        async def on_finished(worker: Any, frame: Frame) -> None:
            if isinstance(frame, EndFrame | CancelFrame):
                self._schedule_end(frame)
                self._finished.set()

        worker.add_event_handler("on_pipeline_finished", on_finished)

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            self._started = True
            if self.conv is not None:
                self.conv.prefetch()  # the greeting's read
            else:
                self._say_no_number()
        elif isinstance(frame, UserStartedSpeakingFrame):
            if self.prefetch and self.conv is not None and not self.conv.ended:
                with within(self._turn_context()):  # the read's span in the turn's
                    self.conv.prefetch()
            await self.push_frame(frame, direction)
        elif isinstance(frame, LLMContextFrame) and direction == FrameDirection.DOWNSTREAM:
            if frame.speculation:  # a provisional context: the turn's memory as it is, no new turn
                self._place(frame.context, self._rendered())
            else:
                await self._turn(frame.context)
            await self.push_frame(frame, direction)
        elif isinstance(frame, EndFrame | CancelFrame):
            self._schedule_end(frame)  # never held back: the hang-up rides on this frame
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    # Turns -------------------------------------------------------------------------------------------

    async def _turn(self, context: LLMContext) -> None:
        conv = self.conv
        if conv is None or conv.ended:
            return
        started = time.perf_counter()
        with within(self._turn_context()):
            await conv.begin_turn()  # takes the prefetched read; at most the read budget
        self.turn_waits.append(time.perf_counter() - started)
        self._forward_user_messages(context)
        self._place(context, self._rendered())

    def _turn_context(self) -> object | None:
        """Pipecat's current turn, as an OpenTelemetry context (None without Pipecat's tracing)."""
        return self._tracing.get_turn_context() if self._tracing is not None else None

    def _rendered(self) -> str | None:
        conv = self.conv
        if conv is None:
            return None
        try:
            memory: Memory | None = conv.memory
        except RuntimeError:  # no turn yet
            memory = None
        return render_memory(memory, conv.resume if self.transcript else None)

    def _place(self, context: LLMContext, text: str | None) -> None:
        """The one memory message, replaced in place (found by identity: the app may add its own developer
        messages), inserted first the first time; removed when there is nothing to say."""
        messages = context.messages  # the context's own list
        index = next((i for i, m in enumerate(messages) if m is self._message), None)
        if text is None:
            if index is not None:
                del messages[index]
            self._message = None
            return
        message: dict[str, Any] = {"role": "developer", "content": text}
        if index is None:
            messages.insert(0, message)  # type: ignore[arg-type]
        else:
            messages[index] = message  # type: ignore[call-overload]
        self._message = message

    def _forward_user_messages(self, context: LLMContext) -> None:
        conv = self.conv
        if conv is None or not self.transcript:
            return
        for message in context.messages:
            if id(message) in self._forwarded or message is self._message:
                continue
            if isinstance(message, dict) and message.get("role") == "user":
                text = _text_of(message.get("content"))
                if text:
                    self._add(conv, "user", text, source="asr")
            self._forwarded.add(id(message))
            self._kept.append(message)

    def _follow(self, aggregator: LLMAssistantAggregator) -> None:
        if id(aggregator) in self._followed:
            return
        self._followed.add(id(aggregator))

        async def on_stopped(aggregator: Any, message: AssistantTurnStoppedMessage) -> None:
            self._assistant_turn(message.content, message.interrupted)

        aggregator.add_event_handler("on_assistant_turn_stopped", on_stopped)

    def _assistant_turn(self, content: str, interrupted: bool) -> None:
        conv = self.conv
        original = "".join(self._generated)
        self._generated = []
        if conv is None or not self.transcript or conv.ended or not content.strip():
            return
        source = "llm" if self._spoke or conv.turn_id > 1 else "greeting"
        self._spoke = True
        if interrupted:  # content: what was spoken; original: what the LLM had generated when it stopped
            extra = {"original": original} if original.strip() and original.strip() != content.strip() else {}
            self._add(conv, "assistant", content, source=source, interrupted=True, **extra)
        else:
            self._add(conv, "assistant", content, source=source)

    def _add(self, conv: Conversation, role: str, content: str, **options: Any) -> None:
        try:
            conv.add_message(role, content, **options)
        except (ValueError, RuntimeError) as exc:  # refused before sending (too long, ended)
            log.warning(
                "call %s: a %s message was not added to the transcript: %s", conv.conversation_id, role, exc
            )

    # Tools -------------------------------------------------------------------------------------------

    def state_tool(
        self,
        name: str,
        description: str,
        fields: Mapping[str, str] | Iterable[str],
        *,
        required: Iterable[str] | None = None,
    ) -> FunctionSchema:
        """A tool (a ``FunctionSchema`` with its handler) that writes ``conv.state``: ``fields`` maps each
        string argument the model passes to the state key it is stored under (or lists keys used as both).
        The model gets back what was remembered. Put it in ``LLMContext(tools=ToolsSchema(standard_tools=[...]))``."""
        mapping = dict(fields) if isinstance(fields, Mapping) else {key: key for key in fields}

        async def handler(params: FunctionCallParams) -> None:
            saved: dict[str, Any] = {}
            for argument, key in mapping.items():
                value = params.arguments.get(argument)
                if value is not None:
                    saved[argument] = value
                    if self.conv is not None:
                        self.conv.state[key] = value
            await params.result_callback(saved)

        properties = {argument: {"type": "string"} for argument in mapping}
        return FunctionSchema(name, description, properties, list(required or mapping), handler=handler)

    def outcome_tool(
        self,
        name: str = "set_call_outcome",
        qa_values: Iterable[str] = ("resolved", "unresolved", "escalated"),
    ) -> FunctionSchema:
        """A tool that records how the call went (``qa``, one of ``qa_values``: the same three as the
        LiveKit drop-in's by default), sent with the end of the call."""
        values = list(qa_values)

        async def handler(params: FunctionCallParams) -> None:
            qa = params.arguments.get("qa")
            if isinstance(qa, str) and qa in values:
                self.outcome["qa"] = qa
                await params.result_callback({"qa": qa})
            else:
                await params.result_callback({"error": f"qa must be one of {', '.join(values)}"})

        return FunctionSchema(
            name,
            "Record how this call went, before it ends.",
            {"qa": {"type": "string", "enum": values}},
            ["qa"],
            handler=handler,
        )

    def transfer_tool(
        self,
        destinations: Iterable[str],
        *,
        name: str = "transfer_call",
        on_transfer: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> FunctionSchema:
        """A tool that hands the call over to one of ``destinations``: records ``handoff_to``,
        ``handoff_reason`` and ``end_reason="transferred"`` for the end, then awaits ``on_transfer(to,
        reason)``, which does the transfer itself (a SIP REFER, a Twilio redirect: the app's part)."""
        targets = list(destinations)

        async def handler(params: FunctionCallParams) -> None:
            to, reason = params.arguments.get("to"), params.arguments.get("reason")
            if not isinstance(to, str) or to not in targets:
                await params.result_callback({"error": f"to must be one of {', '.join(targets)}"})
                return
            reason = reason if isinstance(reason, str) and reason else "transfer"
            self.outcome.update(handoff_to=to, handoff_reason=reason, end_reason="transferred")
            if on_transfer is not None:
                await on_transfer(to, reason)
            await params.result_callback({"transferred_to": to})

        return FunctionSchema(
            name,
            "Transfer the caller to a human team.",
            {"to": {"type": "string", "enum": targets}, "reason": {"type": "string"}},
            ["to", "reason"],
            handler=handler,
        )

    # The end -------------------------------------------------------------------------------------------

    def _schedule_end(self, frame: Frame) -> None:
        if self._end_task is not None:
            return
        self.ended_by = type(frame).__name__
        if self.outcome["end_reason"] is None and isinstance(frame, EndFrame):
            self.outcome["end_reason"] = "completed"
        # A plain task, not the processor's: it must outlive the pipeline's teardown.
        self._end_task = asyncio.get_running_loop().create_task(self._end())

    async def _end(self) -> EndResult | None:
        conv = self.conv
        try:
            if conv is None:
                return None
            # Let the terminal frame reach the end of the pipeline first: the assistant aggregator closes
            # its last turn as it passes, and that turn belongs in the transcript before the end.
            try:
                async with asyncio.timeout(END_WAIT):
                    await self._finished.wait()
            except TimeoutError:
                pass
            for _ in range(3):  # the aggregator's event handlers run as tasks
                await asyncio.sleep(0)
            return await conv.end(**self.outcome)
        except CallerMemoryError as exc:  # a refusal (set aside in the outbox) or an unusable outbox
            log.warning("call %s: the end was not taken: %s", conv.conversation_id if conv else None, exc)
            return None
        finally:
            if self._tail is not None:
                _log_masking.call_ended(self._tail)
                self._tail = None

    async def finished(self) -> EndResult | None:
        """Wait for the end of the call to be persisted (or queued in the outbox): await it after
        ``runner.run()`` returns, or in a shutdown handler.

        None when there was no caller number, when the pipeline never ended, or when ``conv.end()`` raised
        a :class:`~caller_memory.sdk.errors.CallerMemoryError`: it does not raise those but logs them at
        WARNING (a refusal is then in ``client.outbox.rejected()``; with ``OutboxUnavailableError`` the end
        is lost). It raises the ValueError of a ``conv.state`` that JSON cannot carry."""
        if self._end_task is None:
            return None
        return await asyncio.shield(self._end_task)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""
