"""The ingestion rules of SPEC 15, once, for every platform adapter: what a call start and an end event do
to the conversations and memory, whichever platform sent them (records: service/domain/platforms/records.py;
verification, before any of this: service/domain/platforms/verification.py).

- :meth:`PlatformIngestion.start`: the caller's memory read and the conversation started (resume offered)
  within the adapter's budget, failing open (an answer without memory, flagged); a call-start retry (same
  platform and caller, started under :data:`RETRY_WINDOW_MS` ago, no messages yet) is answered from the
  conversation it started, never superseding it; the conversation is due for an inactivity end ``end_grace``
  after its start.
- :meth:`PlatformIngestion.end`: an event with the analysis ends the call at once (with the event held before
  it, if any); an event without it is held in the store and the end runs ``analysis_grace`` after it
  (:meth:`PlatformIngestion.run_held_ends`, from any process, after a restart too) unless the analysis comes.
  The end stores the transcript's user, assistant and tool messages (redacted by the append path), the
  platform's summary, and the state: the checkpoint with the mapped extracted data over it; an end for a
  conversation that never started starts one first. Duplicates and conflicts are answered as outcomes
  (:class:`EndAnswer`), never refused: a platform retries what it sees refused.
"""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from ..clock import Clock
from ..conversations.call_trust import stored_call_trust
from ..conversations.ending import ConversationService
from ..conversations.lifecycle import Lifecycle
from ..conversations.messages import role_of
from ..conversations.service import TranscriptService
from ..errors import (
    CallerMemoryError,
    Conflict,
    Gone,
    InvalidIdentifier,
    InvalidInput,
    Overloaded,
    StoreUnavailable,
)
from ..memory import Caller, MemoryService
from ..projects import Project
from ..registry import ProjectRegistry
from ..sealing import Sealer
from ..store import CallerRef, Outcome, Store
from ..store.transcripts import ConversationKey, Header, TranscriptQuery, TranscriptStatus
from ..trust import UNKNOWN_CALL, CallTrust
from .connections import Connection, parse_end_grace
from .records import (
    CallEnd,
    CallStart,
    SpokenMessage,
    clamped,
    handoff_label,
    in_ms,
    kept_messages,
    mapped_state,
    qa_value,
)

#: A call start for the same platform and caller within this long of a conversation started without
#: messages is a retry of that start (platforms retry a start they saw no answer to).
RETRY_WINDOW_MS = 60_000
#: How long an end event without the analysis waits for the one with it (SPEC 15: ``analysis_grace``).
ANALYSIS_GRACE_MS = 600_000
#: An append's messages at most (conversations/messages.py MAX_BATCH).
_BATCH = 100

EndOutcome = Literal["ended", "started_and_ended", "late", "held", "duplicate", "conflict", "ignored"]


@dataclass(frozen=True, slots=True)
class StartAnswer:
    """What an adapter renders at a call start. ``memory``: the caller's fields (decoded JSON values) the
    call may see, None when they could not be read in time (``fail_open``); ``retried``: answered from the
    conversation an earlier start made (``conversation_id`` is that one)."""

    conversation_id: str
    memory: dict[str, Any] | None
    withheld: tuple[str, ...] = ()
    returning_caller: bool = False
    resume: Mapping[str, Any] | None = None
    fail_open: bool = False
    retried: bool = False
    started: bool = True


@dataclass(frozen=True, slots=True)
class EndAnswer:
    """What became of an end event (always a 2xx for the platform): ``ended`` (``started_and_ended`` when
    it started the conversation too), ``late`` (the service had ended it: its state applied as a late end),
    ``held`` (waiting for the analysis), ``duplicate`` (ended already or held already), ``conflict`` (ended
    already by a different end), ``ignored`` (nothing to store: a caller the project does not keep)."""

    outcome: EndOutcome
    conversation_id: str
    persisted: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EndSettings:
    """The parts of a connection an end needs (kept with a held end, so that its runner needs no more)."""

    platform: str
    channel: str
    state_map: dict[str, str]
    analysis_qa_key: str | None

    @classmethod
    def of(cls, connection: Connection) -> EndSettings:
        return cls(
            connection.platform, connection.channel, dict(connection.state_map), connection.analysis_qa_key
        )


#: The associated data's purpose: a held end opens only for its project and conversation.
HELD_END_PURPOSE = "caller-memory held platform end"


def _encode_held(
    settings: EndSettings, end: CallEnd, received_ms: int, seal: Callable[[str], bytes]
) -> bytes:
    """A held end as the store keeps it: the connection's settings, and the end itself sealed (its caller's
    number, what was said and the extracted data are never in the clear in the store)."""
    sealed = seal(
        orjson.dumps(
            {
                "caller": end.caller,
                "messages": [[m.role, m.content, m.original, m.turn_id] for m in end.messages],
                "summary": end.summary,
                "extracted": dict(end.extracted),
                "ended_at": end.ended_at,
                "started_at": end.started_at,
                "end_reason": end.end_reason,
                "transfer_label": end.transfer_label,
                "attestation": end.attestation,
            }
        ).decode()
    )
    return orjson.dumps(
        {
            "v": 1,
            "received": received_ms,
            "settings": {
                "platform": settings.platform,
                "channel": settings.channel,
                "state_map": settings.state_map,
                "analysis_qa_key": settings.analysis_qa_key,
            },
            "end": base64.b64encode(sealed).decode(),
        }
    )


def _decode_held(
    document: bytes, sealer: Sealer, project: str, conversation_id: str
) -> tuple[EndSettings, CallEnd, int]:
    data = orjson.loads(document)
    s = data["settings"]
    settings = EndSettings(s["platform"], s["channel"], dict(s["state_map"]), s["analysis_qa_key"])
    e = orjson.loads(sealer.open(base64.b64decode(data["end"]), HELD_END_PURPOSE, project, conversation_id))
    end = CallEnd(
        platform=settings.platform,
        conversation_id=conversation_id,
        caller=e["caller"],
        messages=tuple(SpokenMessage(m[0], m[1], m[2], m[3]) for m in e["messages"]),
        summary=e["summary"],
        extracted=e["extracted"],
        ended_at=e["ended_at"],
        started_at=e["started_at"],
        end_reason=e["end_reason"],
        transfer_label=e["transfer_label"],
        carries_analysis=False,
        attestation=e["attestation"],
    )
    return settings, end, int(data["received"])


def _caller_of(end: CallEnd, channel: str | None = None) -> dict[str, str]:
    """The members naming the end's caller (and ``channel``) in an append's or a summary's body; none when the
    platform sent no number (the conversation's own caller then)."""
    if not end.caller:
        return {}
    return {"caller": end.caller} if channel is None else {"caller": end.caller, "channel": channel}


def merged(first: CallEnd, analysis: CallEnd) -> CallEnd:
    """The two end events of one call as one: the analysis event's parts, the first's where it has none."""
    return CallEnd(
        platform=analysis.platform,
        conversation_id=analysis.conversation_id,
        caller=analysis.caller or first.caller,
        messages=analysis.messages if len(analysis.messages) >= len(first.messages) else first.messages,
        summary=analysis.summary if analysis.summary is not None else first.summary,
        extracted={**first.extracted, **analysis.extracted},
        ended_at=first.ended_at if first.ended_at is not None else analysis.ended_at,
        started_at=first.started_at if first.started_at is not None else analysis.started_at,
        end_reason=first.end_reason or analysis.end_reason,
        transfer_label=analysis.transfer_label or first.transfer_label,
        carries_analysis=True,
        attestation=analysis.attestation or first.attestation,
    )


@dataclass(slots=True)
class PlatformIngestion:
    store: Store
    memory: MemoryService
    transcripts: TranscriptService
    lifecycle: Lifecycle
    conversations: ConversationService
    clock: Clock
    #: Seals a held end (CALLER_MEMORY_SECRET_KEY); without a key, an end never waits.
    sealer: Sealer
    analysis_grace_ms: int = ANALYSIS_GRACE_MS
    #: Told each event the counts below count, by kind (the service's metrics): ``clamped_time``,
    #: ``failed_open`` or ``transcript_refused``.
    observe: Callable[[str], None] = field(default=lambda kind: None)
    #: End times a platform sent outside [the conversation's start, the time received] (for the metrics).
    clamped_times: int = field(default=0)
    #: Call starts answered without memory (store slow or down).
    failed_open: int = field(default=0)
    #: End events whose transcript the conversation refused (another caller's, ended meanwhile, expired).
    transcripts_refused: int = field(default=0)

    # Call start ---------------------------------------------------------------------------------------------

    async def start(
        self, project: Project, connection: Connection, start: CallStart, *, admitted: bool = True
    ) -> StartAnswer:
        """Read memory and start the conversation within ``start.budget_s``; an answer in any case.
        ``admitted`` False: the project (or the service) holds every request in flight it may, so the answer
        is made without the store (without memory), never refused."""
        try:
            if not admitted:
                raise Overloaded("the project holds every request in flight it may")
            async with asyncio.timeout(start.budget_s):
                return await self._start(project, connection, start)
        except (TimeoutError, StoreUnavailable, Overloaded):
            return self.failed_open_answer(start.conversation_id)
        except InvalidInput:
            # A caller the service cannot read as a number (withheld, anonymous): a call without memory.
            return StartAnswer(start.conversation_id, {}, started=False)

    def failed_open_answer(self, conversation_id: str) -> StartAnswer:
        """The answer of a call start without memory (the store slow or down, a bound met, a secret that
        does not open), counted."""
        self.failed_open += 1
        self.observe("failed_open")
        return StartAnswer(conversation_id, None, fail_open=True, started=False)

    async def _start(self, project: Project, connection: Connection, start: CallStart) -> StartAnswer:
        caller = self.memory.caller(project, start.caller)
        call = CallTrust.of(start.attestation, False)
        now = self.clock.now_ms()
        ref = CallerRef(project.project_id, caller.subject)
        # The caller's conversations open on the channel (what a start looks at anyway: a cost that does not
        # grow with the caller's history), read with the memory.
        here, view = await asyncio.gather(
            self._open_here(ref, connection.channel, now, caller.blacklisted),
            self.memory.read(project, start.caller, call),
        )
        retry = max(
            (
                h
                for h in here
                if h.key.conversation_id.startswith(f"{start.platform}:")
                and h.started_at >= now - RETRY_WINDOW_MS
                and h.messages == 0
                and not h.ended_by
                and h.status is TranscriptStatus.OPEN
            ),
            key=lambda h: (h.started_at, h.key.conversation_id),
            default=None,
        )
        fields = {name: orjson.loads(value) for name, value in view.fields.items()}
        this = retry.key.conversation_id if retry else start.conversation_id
        returning = bool(fields) or await self._called_before(ref, this, now, caller.blacklisted)
        if retry is not None:
            return StartAnswer(
                retry.key.conversation_id, fields, view.withheld, returning, None, retried=True
            )
        grace_ms = int(parse_end_grace(connection.end_grace).total_seconds() * 1000)
        started = await self.lifecycle.start(
            project,
            start.conversation_id,
            {"caller": start.caller, "channel": connection.channel, "attestation": start.attestation}
            if start.attestation is not None
            else {"caller": start.caller, "channel": connection.channel},
            due_after_ms=grace_ms,  # due end_grace after the start, with the start's own write
        )
        if started["stored"]:
            # What the call's later turns through the memory proxy must not bring forward.
            await self.store.hold_inactivity_end(
                project.project_id, start.conversation_id, now + grace_ms, now
            )
        resume = started.get("resume")
        return StartAnswer(
            start.conversation_id,
            fields,
            view.withheld,
            returning,
            resume,
            started=bool(started["stored"]),
        )

    # Call end -----------------------------------------------------------------------------------------------

    async def end(self, project: Project, connection: Connection, end: CallEnd) -> EndAnswer:
        """One end event. Without the analysis it is held (``held``; ``duplicate`` when one is held already)
        and the end runs when the analysis comes or ``analysis_grace`` after it; with it, the end runs now,
        with what a held event had."""
        now = self.clock.now_ms()
        settings = EndSettings.of(connection)
        if not end.carries_analysis and self.sealer.configured:
            header = await self._header(project, end.conversation_id, now)
            if header is not None and header.ended_by == "explicit":
                return EndAnswer("duplicate", end.conversation_id)
            kept = await self.store.hold_platform_end(
                project.project_id,
                end.conversation_id,
                _encode_held(settings, end, now, lambda text: self._seal(project, end.conversation_id, text)),
                now + self.analysis_grace_ms,
            )
            return EndAnswer("held" if kept else "duplicate", end.conversation_id)
        held = await self.store.take_platform_end(project.project_id, end.conversation_id)
        received = now
        if held is not None:
            _, first, received = _decode_held(held, self.sealer, project.project_id, end.conversation_id)
            end = merged(first, end)
        return await self._run_end(project, settings, end, received)

    async def end_more(self, project: Project, connection: Connection, end: CallEnd) -> EndAnswer:
        """An end event without the analysis, of a platform that sends more than one (Telnyx: the hang-up and
        the transcript, in no set order): what another such event of the call holds already is added to it,
        and the two are held again, for the event with the analysis (or ``analysis_grace``)."""
        held = await self.store.take_platform_end(project.project_id, end.conversation_id)
        if held is not None:
            try:
                _, first, _ = _decode_held(held, self.sealer, project.project_id, end.conversation_id)
            except ValueError:  # sealed with a key the operator no longer has: nothing of it can be used
                pass
            else:
                end = replace(merged(first, end), carries_analysis=False)
        return await self.end(project, connection, end)

    async def end_part(
        self, project: Project, connection: Connection, end: CallEnd, *, wait_ms: int
    ) -> EndAnswer:
        """One of the two end events of a platform that sends them in no set order (Agora's agent-left and
        history): the first is held (``held``) and the end runs when the other comes, the two merged, or
        ``wait_ms`` after the first if it never does (from any process, after a restart too). Of two parts
        racing through two processes, one holds and the other takes it."""
        now = self.clock.now_ms()
        settings = EndSettings.of(connection)
        for _ in range(2):
            held = await self.store.take_platform_end(project.project_id, end.conversation_id)
            if held is not None:
                _, first, received = _decode_held(held, self.sealer, project.project_id, end.conversation_id)
                return await self._run_end(project, settings, merged(first, end), received)
            header = await self._header(project, end.conversation_id, now)
            if header is not None and header.ended_by == "explicit":
                return EndAnswer("duplicate", end.conversation_id)
            if not self.sealer.configured:  # nothing can be held without the key: the end runs now
                return await self._run_end(project, settings, end, now)
            document = _encode_held(
                settings, end, now, lambda text: self._seal(project, end.conversation_id, text)
            )
            if await self.store.hold_platform_end(
                project.project_id, end.conversation_id, document, now + wait_ms
            ):
                return EndAnswer("held", end.conversation_id)
        return EndAnswer("duplicate", end.conversation_id)

    async def run_held_ends(self, projects: ProjectRegistry, *, limit: int = 100) -> int:
        """Run the held ends whose analysis did not come within ``analysis_grace`` (any process; each is
        taken by one). Returns how many ran."""
        ran = 0
        for project_id, conversation_id in await self.store.due_platform_ends(self.clock.now_ms(), limit):
            held = await self.store.take_platform_end(project_id, conversation_id)
            if held is None:
                continue  # another process took it
            try:
                settings, end, received = _decode_held(held, self.sealer, project_id, conversation_id)
                project = await projects.get(project_id)
                await self._run_end(project, settings, end, received)
            except (StoreUnavailable, Overloaded):
                # Held again, to be run at the next pass: a held end is never lost to an outage.
                await self.store.hold_platform_end(project_id, conversation_id, held, self.clock.now_ms())
                raise
            except (CallerMemoryError, ValueError):
                continue  # the project is gone, refuses it, or its caller no longer opens: nothing to keep
            ran += 1
        return ran

    def _seal(self, project: Project, conversation_id: str, text: str) -> bytes:
        return self.sealer.seal(text, HELD_END_PURPOSE, project.project_id, conversation_id)

    async def _header(self, project: Project, conversation_id: str, now: int) -> Header | None:
        header, _ = await self.store.read_conversation(
            ConversationKey(project.project_id, conversation_id), now
        )
        return header

    async def _open_here(self, ref: CallerRef, channel: str, now: int, blacklisted: bool) -> list[Header]:
        return [] if blacklisted else await self.store.channel_conversations(ref, channel, now)

    async def _called_before(self, ref: CallerRef, this: str, now: int, blacklisted: bool) -> bool:
        """Whether the caller has a conversation other than ``this`` (two of the newest are enough)."""
        if blacklisted:
            return False
        page = await self.store.caller_conversations_page(ref, now, 2)
        return any(h.key.conversation_id != this for h in page.headers)

    def _ended_at(self, end: CallEnd, start_ms: int, received: int) -> int:
        """When the call ended: the platform's time in its unit, within [start, received] (counted when
        outside), else when the end was received."""
        if end.ended_at is None:
            return received
        ended_at, outside = clamped(in_ms(end.ended_at, start_ms), start_ms, received)
        if outside:
            self.clamped_times += 1
            self.observe("clamped_time")
        return ended_at

    def _readable_caller(self, project: Project, end: CallEnd) -> bool:
        """Whether the end's caller is one the service can keep a call under (no number, Agora's, is the
        conversation's own caller)."""
        if not end.caller:
            return True
        try:
            self.memory.caller(project, end.caller)
        except (InvalidIdentifier, InvalidInput):
            return False
        return True

    async def _run_end(
        self, project: Project, settings: EndSettings, end: CallEnd, received: int
    ) -> EndAnswer:
        conversation_id = end.conversation_id
        if not self._readable_caller(project, end):
            return EndAnswer("ignored", conversation_id)  # withheld, anonymous: nothing to keep it under
        header = await self._header(project, conversation_id, self.clock.now_ms())
        answer: EndOutcome = "ended"
        if header is not None and header.ended_by == "explicit":
            return EndAnswer("duplicate", conversation_id)
        if header is None or header.status in (TranscriptStatus.DELETED, TranscriptStatus.ERASED):
            if not end.caller:  # no number to start one with (Agora's events carry none): nothing to end
                return EndAnswer("ignored", conversation_id)
            try:
                started = await self.lifecycle.start(
                    project, conversation_id, {"caller": end.caller, "channel": settings.channel}
                )
            except Conflict:  # the id is another caller's: answered, never refused
                return EndAnswer("conflict", conversation_id)
            if not started["stored"]:
                return EndAnswer("ignored", conversation_id)
            header = await self._header(project, conversation_id, self.clock.now_ms())
            answer = "started_and_ended"
            if header is None:
                return EndAnswer("ignored", conversation_id)
        late = header.ended_by in ("inactivity", "superseded")
        ended_at = self._ended_at(end, header.started_at, received)
        try:
            header = await self._keep_transcript(project, settings, end, header, received, late=late)
        except (Conflict, Gone):
            # The transcript is another caller's, was ended meanwhile or expired: the end's state still
            # applies (a transcript refused is never the platform's fault, so never its error).
            self.transcripts_refused += 1
            self.observe("transcript_refused")
        checkpoint = orjson.loads(header.checkpoint) if header.checkpoint else None
        # The names remembered through MCP, over it.
        checkpoint = await self.conversations.remembered.over(
            project, header.key, checkpoint or {}, header.checkpoint_at
        )
        state = mapped_state(checkpoint, end.extracted, settings.state_map)
        outcome = Outcome(
            qa=qa_value(end.extracted, settings.analysis_qa_key),
            handoff_to=handoff_label(end.transfer_label, [project.default_region]),
        )
        # The trust the call's start brought (and any step-up since), else what the end event says.
        call = await stored_call_trust(self.store, project.project_id, conversation_id, self.clock.now_ms())
        if call is UNKNOWN_CALL and end.attestation:
            call = CallTrust.of(end.attestation, False)
        try:
            result = await self.conversations.end(
                project,
                conversation_id,
                # Without a number (Agora), the conversation's own caller.
                end.caller or Caller("", header.subject, header.subject in project.blacklist),
                state,
                outcome,
                channel=settings.channel,
                received_at=received,
                ended_at=ended_at,
                end_reason=end.end_reason,
                call=call,
                source=settings.platform,
                remembered_in=True,
            )
        except Conflict:
            return EndAnswer("conflict", conversation_id)
        if result.late:
            answer = "late"
        return EndAnswer(answer, conversation_id, tuple(result.persisted))

    async def _keep_transcript(
        self,
        project: Project,
        settings: EndSettings,
        end: CallEnd,
        header: Header,
        received: int,
        *,
        late: bool,
    ) -> Header:
        """The end's transcript and summary, on time or late; the header after them."""
        conversation_id = end.conversation_id
        if not late:
            await self._store_transcript(project, settings, end, header, received)
            return header
        # Ended by the service before the platform's end came: its transcript is added once, to a
        # transcript without messages, and its summary to one without a summary.
        messages = kept_messages(settings.platform, end.messages)
        if messages and header.messages == 0:
            await self.transcripts.add_late(project, header, end.caller, messages)
            header = await self._header(project, conversation_id, self.clock.now_ms()) or header
        if end.summary and header.summary is None and header.turn_id >= 0:
            await self.transcripts.put_summary(
                project,
                conversation_id,
                {"text": end.summary, "through_turn": header.turn_id, **_caller_of(end)},
            )
        return header

    async def _not_recorded(
        self, key: ConversationKey, messages: list[dict[str, Any]], now: int
    ) -> list[dict[str, Any]]:
        """Of an end's ``messages``, those past what the conversation holds: the ``n``-th message of a role is
        taken only if the transcript holds fewer than ``n`` of that role. The memory proxy records each turn
        from the platform's own requests (other ids, the same messages), and the platform's transcript is
        the whole call: what it adds is what the proxy could not see (the last answer, a turn that did not
        reach the model). Run again, it adds nothing."""
        _, stored = await self.store.read_conversation(key, now, TranscriptQuery())
        held = Counter(role_of(m.body) for m in stored)
        seen: Counter[str] = Counter()
        kept: list[dict[str, Any]] = []
        for message in messages:
            role = message["role"]
            seen[role] += 1
            if seen[role] > held[role]:
                kept.append(message)
        return kept

    async def _store_transcript(
        self, project: Project, settings: EndSettings, end: CallEnd, header: Header, received: int
    ) -> None:
        messages = kept_messages(
            settings.platform, end.messages, header.turn_id + 1 if header.messages else 0
        )
        if header.messages:  # recorded already (the memory proxy's turns): only what it did not record
            messages = await self._not_recorded(header.key, messages, received)
        for at in range(0, len(messages), _BATCH):
            await self.transcripts.append(
                project,
                end.conversation_id,
                {**_caller_of(end, settings.channel), "messages": messages[at : at + _BATCH]},
                received_at=received,
            )
        through = messages[-1]["turn_id"] if messages else header.turn_id
        if end.summary and through >= 0:  # a summary is of turns: a conversation without any has none
            await self.transcripts.put_summary(
                project,
                end.conversation_id,
                {"text": end.summary, "through_turn": through, **_caller_of(end)},
            )
