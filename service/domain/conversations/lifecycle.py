"""The ends the service makes itself and the start of a conversation (SPEC sections 10 and 14): an inactivity
end of a conversation nobody ended, the supersession of a still-open conversation when its caller calls back
on the same channel, and the ``resume`` offer of a dropped call.

These run exactly the end processing of an explicit end (:meth:`~caller_memory.service.domain.conversations.ending.ConversationService.persist`
and analytics), with the last state checkpoint as the state and its time as the write time, exactly once: the
store's end claim decides who runs it, and a crash half-way is taken over once the claim's lease lapses.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import orjson

from ..analytics import AnalyticsService, metrics
from ..clock import Clock, floor_hour_ms, iso_utc
from ..id_rules import check_chosen_id
from ..projects import Project
from ..registry import ProjectRegistry
from ..store import CallerRef, EndStatus, Recording, Store
from ..store.transcripts import (
    AppendStatus,
    ClaimStatus,
    ConversationKey,
    EndClaim,
    Header,
    TranscriptQuery,
    TranscriptStatus,
)
from ..trust import CallTrust
from .call_trust import keep_start_trust
from .ending import (
    END_LEASE_MS,
    ConversationService,
    Outcome,
    check_conversation_id,
    fingerprint,
    outcome_body,
    split_state,
)
from .events import EndedEvent
from .messages import Message
from .pending import PendingAnswers
from .redaction import regions_of
from .requests import (
    EVERYONE,
    Reader,
    StartBody,
    check_agent,
    ended_by_of,
    parse_body,
    refuse,
    summary_of,
    summary_section,
)
from .service import RESUME_MESSAGES, RESUME_TURNS, TranscriptService
from .views import PlatformMessage, Resume, Started

#: The suffix of the record under which the service finishes a crashed explicit end (ids cannot hold '#').
TAKEOVER_SUFFIX = "#takeover"
#: The lease the inactivity runner takes, so that replicas do not run the same due ends at once.
INACTIVITY_LEASE = "inactivity"


class ServiceEnds:
    """The ends the service makes: supersession (by a start, or by an append that started a conversation:
    the transcripts' :class:`~caller_memory.service.domain.conversations.events.StartListener`) and
    inactivity. Built before the transcripts' use cases, which tell it of the conversations appends start."""

    def __init__(
        self,
        store: Store,
        conversations: ConversationService,
        analytics: AnalyticsService,
        clock: Clock,
        *,
        pending: PendingAnswers | None = None,
    ) -> None:
        """``pending``: the memory proxy's last answers, recorded before the service ends a call."""
        self._store = store
        self._conversations = conversations
        self._analytics = analytics
        self._clock = clock
        self._pending = pending

    async def supersede(
        self,
        project: Project,
        ref: CallerRef,
        channel: str,
        conversation_id: str,
        now: int,
        *,
        resume: bool = True,
    ) -> tuple[list[str], list[Header]]:
        """End the caller's other conversations still open on ``channel`` (any channel with
        ``cross_channel``) as ``superseded``; returns their ids, and the headers of the caller's other
        conversations there that a resume may offer (with ``resume``: the latest resumable ones within
        ``resume_window`` too). Reads what the store keeps by caller and channel, never all of the caller's
        conversations: a caller with thousands costs a start what one with a few does."""
        cc = project.conversation
        headers = await self._store.channel_conversations(
            ref,
            None if cc.cross_channel else channel,
            now,
            now - cc.resume_window_ms if resume else None,
        )
        headers.sort(key=lambda h: (h.started_at, h.key.conversation_id), reverse=True)
        superseded: list[str] = []
        candidates: list[Header] = []
        for header in headers:
            if header.key.conversation_id == conversation_id or header.expired(now):
                continue
            if header.status is TranscriptStatus.OPEN:
                ended = await self.end_by_service(project, header, "superseded")
                if ended is not None:
                    superseded.append(header.key.conversation_id)
                    header = ended
            candidates.append(header)
        return superseded, candidates

    async def conversation_started(self, project: Project, header: Header) -> None:
        """A conversation started by its first append (no start: the SDK's start failed, or a client that
        does not use it) supersedes like a start (and offers no resume: nobody would read it)."""
        ref = CallerRef(project.project_id, header.subject)
        now = self._clock.now_ms()
        await self.supersede(project, ref, header.channel, header.key.conversation_id, now, resume=False)

    # Ends the service makes -------------------------------------------------------------------------------

    async def end_by_service(self, project: Project, header: Header, ended_by: str) -> Header | None:
        """End an open conversation nobody ended (``inactivity``) or that a callback replaced
        (``superseded``): the same end processing as an explicit end, with the last checkpoint as the state,
        written at the checkpoint's time. Exactly once: the store's claim decides who runs it, and a crash
        half-way is taken over once the claim's lease lapses. Returns the header once ended, or None when
        another end has it (or it is not due)."""
        if self._pending is not None and header.status is TranscriptStatus.OPEN:
            # The call's last answer through the memory proxy, if any: recorded at its streaming time, so
            # that an inactivity end stays due.
            await self._pending.flush(project, header.key)
        now = self._clock.now_ms()
        cc = project.conversation
        # Taking over a crashed end (ENDING, lease lapsed) keeps what that end said about itself.
        takeover = header.status is TranscriptStatus.ENDING
        claim = await self._store.claim_end(
            EndClaim(
                header.key,
                ended_by,
                header.end_reason if takeover else "",
                now - cc.end_after_inactivity_ms if ended_by == "inactivity" and not takeover else None,
                now + END_LEASE_MS,
                header.end_data if takeover else b"",
            ),
            now,
        )
        if claim.status is ClaimStatus.NOT_DUE and claim.header is not None:
            await self._store.reschedule(header.key, claim.header.last_activity + cc.end_after_inactivity_ms)
            return None
        if claim.status is not ClaimStatus.CLAIMED or claim.header is None:
            return None
        claimed = claim.header
        state: dict[str, Any] = orjson.loads(claimed.checkpoint) if claimed.checkpoint else {}
        ref = CallerRef(project.project_id, claimed.subject)
        written_at = claimed.checkpoint_at or claimed.last_activity
        digest = fingerprint(claimed.subject, state, "service end")
        # The names remembered through MCP since the checkpoint, over it.
        state = await self._conversations.remembered.over(project, claimed.key, state, claimed.checkpoint_at)
        changes = split_state(project, state)
        made_at = claimed.last_activity
        # What a crashed explicit end said about the call (its outcome), when this takes it over.
        # (qa, handoff_reason, handoff_to), then the platform whose end it was, if one (ending.py).
        outcome = Outcome(*orjson.loads(claimed.end_data)[:3]) if claimed.end_data else Outcome()
        # A crashed explicit end is the client's: its retry (from the SDK's outbox) must still be applied
        # under the conversation's own record, so the service's end of it is kept under another.
        record_id = claimed.key.conversation_id + (TAKEOVER_SUFFIX if ended_by == "explicit" else "")
        result, ref = await self._conversations.persist(
            project,
            ref,
            record_id,
            digest,
            changes,
            made_at=made_at,
            written_at=written_at,
            analytics_outcome=outcome,
            now=now,
        )
        repeat_caller: dict[str, Any] = {}
        recording: Recording | None = None
        if result.status in (EndStatus.APPLIED, EndStatus.REPLAYED) and result.analytics is not None:
            recording = self._analytics.recording(
                project,
                ref,
                claimed.key.conversation_id,
                channel=claimed.channel or None,
                outcome=outcome,
                found=result.analytics,
                made_at=made_at,
                now=now,
                ended_by=claimed.ended_by,
                end_reason=claimed.end_reason or None,
            )
            repeat_caller = dict(metrics(result.analytics.first))
        if result.status in (EndStatus.APPLIED, EndStatus.REPLAYED):
            await self._conversations.process_end(
                project,
                EndedEvent(
                    key=claimed.key,
                    subject=claimed.subject,
                    channel=claimed.channel or None,
                    ended_by=claimed.ended_by,
                    end_reason=claimed.end_reason or None,
                    outcome=outcome_body(outcome),
                    persisted=changes.persisted,
                    repeat_caller=repeat_caller,
                    made_at=made_at,
                    started_at=claimed.started_at,
                    expires_at=claimed.expires_at,
                ),
                recording,
                now,
            )
        # CONFLICT: an explicit end of this id was applied already (its transcript claim was lost): done.
        return await self._store.finish_end(claimed.key, self._clock.now_ms())

    async def run_due(self, projects: ProjectRegistry, holder: str, *, lease_ms: int = 60_000) -> int | None:
        """Run the inactivity ends that are due under the store's lease (replicas take turns); None when
        another replica holds it."""
        if not await self._store.acquire_lease(INACTIVITY_LEASE, holder, self._clock.now_ms(), lease_ms):
            return None
        try:
            return await self.run_inactivity_ends(projects)
        finally:
            await self._store.release_lease(INACTIVITY_LEASE, holder)

    async def run_inactivity_ends(
        self, projects: ProjectRegistry, *, limit: int = 500, budget_s: float = 5.0
    ) -> int:
        """End the conversations that are due (``projects``: the registry, to read each one's settings).
        Returns how many this run ended."""
        started = time.perf_counter()
        ended = 0
        now = self._clock.now_ms()
        for key in await self._store.due_conversations(now, limit):
            if time.perf_counter() - started > budget_s:
                break
            project = await projects.find(key.project)
            if project is None:  # projects are never deleted: its configuration is unreadable for now
                continue
            header, _ = await self._store.read_conversation(key, now)
            if header is None or header.status in (TranscriptStatus.ERASED, TranscriptStatus.DELETED):
                # Gone since it was scheduled: a claim answers MISSING and takes it out of the due index.
                await self._store.claim_end(EndClaim(key, "inactivity", "", now, now), now)
                continue
            if header.status is TranscriptStatus.ENDING:
                # A crashed end: take it over as the end it was.
                if header.lease_until > now:
                    continue
                if await self.end_by_service(project, header, header.ended_by or "inactivity"):
                    ended += 1
                continue
            if header.status is not TranscriptStatus.OPEN:
                continue
            held = await self._store.inactivity_end_held_until(key.project, key.conversation_id, now)
            if held is not None:  # a platform's call: ended for inactivity only end_grace after its start
                await self._store.reschedule(key, held)
                continue
            if await self.end_by_service(project, header, "inactivity") is not None:
                ended += 1
        return ended


class Lifecycle:
    def __init__(self, store: Store, transcripts: TranscriptService, ends: ServiceEnds, clock: Clock) -> None:
        """``ends``: the same the transcripts' use cases were given (their appends start conversations)."""
        self._store = store
        self._transcripts = transcripts
        self.ends = ends
        self._clock = clock

    async def supersede(
        self,
        project: Project,
        ref: CallerRef,
        channel: str,
        conversation_id: str,
        now: int,
        *,
        resume: bool = True,
    ) -> tuple[list[str], list[Header]]:
        """:meth:`ServiceEnds.supersede`."""
        return await self.ends.supersede(project, ref, channel, conversation_id, now, resume=resume)

    async def end_by_service(self, project: Project, header: Header, ended_by: str) -> Header | None:
        """:meth:`ServiceEnds.end_by_service`."""
        return await self.ends.end_by_service(project, header, ended_by)

    async def run_due(self, projects: ProjectRegistry, holder: str, *, lease_ms: int = 60_000) -> int | None:
        """:meth:`ServiceEnds.run_due`."""
        return await self.ends.run_due(projects, holder, lease_ms=lease_ms)

    async def run_inactivity_ends(
        self, projects: ProjectRegistry, *, limit: int = 500, budget_s: float = 5.0
    ) -> int:
        """:meth:`ServiceEnds.run_inactivity_ends`."""
        return await self.ends.run_inactivity_ends(projects, limit=limit, budget_s=budget_s)

    # Start, supersession, resume ---------------------------------------------------------------------------

    async def start(
        self,
        project: Project,
        conversation_id: str,
        document: Any,
        *,
        reader: Reader = EVERYONE,
        writer: str | None = None,
        due_after_ms: int | None = None,
    ) -> Started:
        """``writer``: the agent the token acts as; the conversation's agent is then that one.
        ``due_after_ms``: how long after the start an inactivity end is due, instead of the project's
        ``end_after_inactivity`` (a platform's call: its ``end_grace``), written with the start itself."""
        check_conversation_id(conversation_id)
        body: StartBody = parse_body(StartBody, document, "start")
        if writer is not None:
            check_agent(body.agent, writer, "agent")
            body = body.model_copy(update={"agent": writer})
        caller = self._transcripts.caller(project, body.caller)
        # Ids that hold a phone number are refused here, at the first request that names them.
        regions = regions_of(project, caller)
        check_chosen_id(conversation_id, "conversation_id", "conversation id", regions)
        check_chosen_id(body.channel, "channel", "channel", regions)
        check_chosen_id(body.agent, "agent", "agent name", regions)
        if not project.conversation.enabled or caller.blacklisted:
            reason: Any = "disabled" if not project.conversation.enabled else "blacklisted"
            return {"conversation": None, "stored": False, "reason": reason, "resume": None, "superseded": []}
        call = CallTrust.of(body.attestation, body.step_up)
        now = self._clock.now_ms()
        ref = CallerRef(project.project_id, caller.subject)
        if project.identity_linking:  # the conversation is the profile's, whichever identifier called
            ref = CallerRef(project.project_id, await self._store.resolve_profile(ref, now))
        superseded, candidates = await self.supersede(project, ref, body.channel, conversation_id, now)
        key = ConversationKey(project.project_id, conversation_id)
        write = self._transcripts.appends.write(
            project,
            key,
            caller,
            ref.subject,
            channel=body.channel,
            agent=body.agent or "",
            messages=[],
            checkpoint=None,
            made_at=now,
            now=now,
        )
        if due_after_ms is not None:
            write = replace(write, due_at=now + due_after_ms)
        result = await self._store.append_messages(write, now)
        if result.status is AppendStatus.ERASED:
            return {
                "conversation": None,
                "stored": False,
                "reason": "erased",
                "resume": None,
                "superseded": [],
            }
        if result.status not in (AppendStatus.APPENDED, AppendStatus.ENDED):
            refuse(result.status, conversation_id, result.detail)
        assert result.header is not None
        await keep_start_trust(
            self._store,
            project.project_id,
            conversation_id,
            call,
            expires_at_ms=result.header.expires_at,
            now_ms=now,
        )
        resume = await self._resume(project, candidates, now, reader, call)
        return {
            "conversation": self._transcripts.status_view(result.header, project, now),
            "stored": True,
            "resume": resume,
            "superseded": superseded,
        }

    async def _resume(
        self, project: Project, candidates: list[Header], now: int, reader: Reader, call: CallTrust | None
    ) -> Resume | None:
        window = project.conversation.resume_window_ms
        resumable = [
            h
            for h in candidates
            if h.last_activity >= now - window
            and (h.ended_by in ("inactivity", "superseded") or h.end_reason == "dropped")
        ]
        if not resumable:
            return None
        chosen = max(resumable, key=lambda h: (h.last_activity, h.started_at))
        header, stored = await self._store.read_conversation(
            chosen.key, now, TranscriptQuery(last=RESUME_MESSAGES)
        )
        if (
            header is None
            or header.expired(now)
            or header.status
            in (
                TranscriptStatus.ERASED,
                TranscriptStatus.DELETED,
            )
        ):
            return None
        messages = [Message(m.body) for m in stored]
        turns = sorted({m.turn_id for m in messages})[-RESUME_TURNS:]
        transcript = project.trust.may_resume_transcript(call)
        last: list[PlatformMessage] = [
            m.platform(header.started_at)
            for m in messages
            if transcript and m.turn_id in turns and m.visible_to(reader.agent)
        ]
        withheld = project.trust.withheld(call)
        state = orjson.loads(header.checkpoint) if header.checkpoint else None
        if state is not None and withheld:
            state = {name: value for name, value in state.items() if name not in withheld}
        return {
            "conversation_id": header.key.conversation_id,
            "channel": header.channel,
            "ended_by": ended_by_of(header),
            "end_reason": header.end_reason or None,
            "last_activity_at": iso_utc(floor_hour_ms(header.last_activity)),
            "summary": summary_section(summary_of(header, reader)) if transcript else None,
            "last_turns": last,
            "state": state,
            "withheld": list(withheld),
        }
