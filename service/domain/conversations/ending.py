"""Ending a conversation: persist the allowed ``state`` keys of a call, exactly once per conversation id."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ..analytics import AnalyticsService, metrics
from ..clock import Clock
from ..errors import Conflict, InvalidIdentifier, InvalidInput
from ..fields import StoredField
from ..id_rules import check_chosen_id
from ..limits import CONVERSATION_ID_RE, RECALL_WINDOW_MS
from ..memory import Caller, MemoryService, check_field_name, encode_value
from ..projects import Project
from ..redaction import enough_digits, redact_text
from ..reports import RepeatCallerMetrics
from ..store import CallerRef, EndResult, EndStatus, EndWrite, Recording, Store
from ..store import Outcome as Outcome  # part of this module's API: the HTTP layer builds one for end()
from ..store.links import ProfileMoved
from ..store.transcripts import ClaimStatus, ConversationKey, EndClaim, TranscriptStatus
from ..store.webhooks import Delivery
from ..trust import CallTrust
from .events import EndDeliveries, EndedEvent, EndListener
from .pending import PendingAnswers
from .redaction import regions_of
from .remembered import RememberedState


@dataclass(frozen=True, slots=True)
class ConversationEnd:
    """What the end of a conversation reports. The same request always gets the same report."""

    conversation_id: str
    persisted: list[str]
    ignored: list[str]
    blacklisted: bool
    repeat_caller: RepeatCallerMetrics
    replayed: bool
    #: The caller was erased after this conversation's write was made: nothing was stored.
    erased: bool = False
    #: An explicit end of a conversation the service had already ended (by inactivity or supersession):
    #: its state was applied as a merge patch (a later write wins), analytics left as recorded.
    late: bool = False
    #: State keys the call did not qualify for (:mod:`.trust`): whatever ``state`` said of them was dropped.
    withheld: list[str] = field(default_factory=list)


#: How an end may say the call ended (SPEC section 14).
END_REASONS = ("completed", "dropped", "transferred")
#: How long an end's claim on a transcript holds before another end may take over a crashed one.
END_LEASE_MS = 60_000
#: The suffix of the record id under which a late end is kept (conversation ids cannot hold '#').
LATE_SUFFIX = "#late"


def ended_by_platform(end_data: bytes) -> bool:
    """Whether an explicit end's claim (its ``end_data``: qa, handoff reason and label, then the platform
    whose end event it was) is a platform's."""
    return bool(end_data) and len(orjson.loads(end_data)) > 3


def check_conversation_id(conversation_id: str) -> None:
    if not CONVERSATION_ID_RE.match(conversation_id):
        raise InvalidInput(
            "conversation id must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
            field="conversation_id",
        )


@dataclass(frozen=True, slots=True)
class StateChanges:
    """A ``state`` mapping split by the project's ``state_keys``."""

    sets: dict[str, bytes]
    deletes: list[str]
    ignored: list[str]
    #: Keys of the state the call may not write or delete (:mod:`.trust`).
    withheld: list[str] = field(default_factory=list)

    @property
    def persisted(self) -> list[str]:
        return sorted([*self.sets, *self.deletes])


def split_state(
    project: Project, state: dict[str, Any], *, where: str = "state", withheld: tuple[str, ...] = ()
) -> StateChanges:
    """``state`` split into sets, deletes and ignored keys (not in ``state_keys``, or ``withheld`` from the
    call: neither written nor deleted)."""
    sets: dict[str, bytes] = {}
    deletes: list[str] = []
    ignored: list[str] = []
    refused: list[str] = []
    for name, value in state.items():
        check_field_name(name, where=f"{where}.{name}")
        if name not in project.ttl_ms:
            ignored.append(name)
        elif withheld and name in withheld:
            encode_value(f"{where}.{name}", value)  # still checked: bad input is refused whoever sends it
            refused.append(name)
        elif value is None:
            deletes.append(name)
        else:
            sets[name] = encode_value(f"{where}.{name}", value)
    return StateChanges(sets, deletes, sorted(ignored), sorted(refused))


def masked_outcome(outcome: Outcome, regions: Sequence[str | None]) -> Outcome:
    """``outcome`` with every phone number in its strings masked (``[phone]``)."""
    parts = (outcome.qa, outcome.handoff_reason, outcome.handoff_to)
    if not any(part is not None and enough_digits(part) for part in parts):
        return outcome
    qa, reason, to = (None if part is None else redact_text(part, regions) for part in parts)
    return Outcome(qa, reason, to)


def outcome_body(outcome: Outcome) -> dict[str, Any]:
    return {"qa": outcome.qa, "handoff_reason": outcome.handoff_reason, "handoff_to": outcome.handoff_to}


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(orjson.dumps(list(parts), option=orjson.OPT_SORT_KEYS)).hexdigest()


def explicit_event(
    key: ConversationKey,
    subject: str,
    *,
    channel: str | None,
    end_reason: str | None,
    outcome: Outcome,
    changes: StateChanges,
    made_at: int,
    repeat_caller: dict[str, Any] | None = None,
    started_at: int = 0,
    expires_at: int = 0,
    late: bool = False,
    source: str | None = None,
) -> EndedEvent:
    """What an explicit end (on time or late) tells the webhooks and the archive."""
    return EndedEvent(
        key=key,
        subject=subject,
        channel=channel,
        ended_by="explicit",
        end_reason=end_reason,
        outcome=outcome_body(outcome),
        persisted=changes.persisted,
        repeat_caller=repeat_caller or {},
        made_at=made_at,
        started_at=started_at,
        expires_at=expires_at,
        late=late,
        source=source,
    )


@dataclass(frozen=True, slots=True)
class _Verdict:
    late: bool = False  # the service ended it (or is ending it): this end is late
    claimed: bool = False  # this end claimed the transcript (or had claimed it): it finishes it
    #: The transcript expired: a conflicting record is the service's end's (never a 409 for that).
    expired_transcript: bool = False
    #: The conversation's start and its transcript's expiry, when it has one (for the webhook event).
    started_at: int = 0
    expires_at: int = 0
    #: The transcript's end processing had finished already: this is a retry of a completed end.
    finished: bool = False


class ConversationService:
    def __init__(
        self,
        store: Store,
        memory: MemoryService,
        analytics: AnalyticsService,
        clock: Clock,
        *,
        listeners: Sequence[EndListener] = (),
        deliveries: EndDeliveries | None = None,
        pending: PendingAnswers | None = None,
        remembered: RememberedState | None = None,
    ) -> None:
        """``listeners``: told in turn by every end's processing before its webhook events are made (the
        archive writes the conversation): explicit ends here, the service's ends from
        :class:`~caller_memory.service.domain.conversations.lifecycle.Lifecycle`. One that fails fails the
        end, which is then redone whole. ``deliveries``: the webhooks, where they are on: the events of each
        end (:meth:`process_end`). ``pending``: the memory proxy's last answers, recorded before the end.
        ``remembered``: the state keys remembered through MCP, which the end's state takes where it does not
        say."""
        self._store = store
        self._memory = memory
        self._analytics = analytics
        self._clock = clock
        self._listeners = tuple(listeners)
        self._deliveries = deliveries
        self._pending = pending
        self.remembered = remembered or RememberedState(store, clock)

    async def process_end(
        self, project: Project, event: EndedEvent | None, recording: Recording | None, now: int
    ) -> None:
        """What every end does once its state is persisted, in this order: tell the end's listeners (the archive
        writes the conversation), then record the conversation in analytics (``recording``, when they were
        on at its end) and queue the webhook events of ``event`` (none for a retry of a completed end), in
        one store call (on one Redis server, one round trip). Memory, archive, webhooks: a receiver is told
        of an end only once the archive holds it, and an archive that fails sends nothing (the end fails and
        is redone whole: each part is idempotent, the same object, delivery ids and recording). Durable once
        this returns."""
        if event is not None:
            for listener in self._listeners:
                await listener.conversation_ended(project, event)
        deliveries: list[Delivery] = []
        if event is not None and self._deliveries is not None:
            deliveries = await self._deliveries.ended_deliveries(project, event)
        together = event is not None and recording is not None and recording.caller.subject == event.subject
        if recording is not None:
            await self._store.record_conversation(recording, now, deliveries if together else ())
        if deliveries and event is not None and not together:
            await self._store.enqueue_deliveries(
                deliveries, CallerRef(project.project_id, event.subject), event.made_at, now
            )
        if deliveries and self._deliveries is not None:
            self._deliveries.queued(deliveries)

    async def end(
        self,
        project: Project,
        conversation_id: str,
        caller: str | Caller,
        state: dict[str, Any],
        outcome: Outcome,
        *,
        channel: str | None,
        received_at: int | None = None,
        ended_at: int | None = None,
        end_reason: str | None = None,
        call: CallTrust | None = None,
        source: str | None = None,
        remembered_in: bool = False,
    ) -> ConversationEnd:
        """``received_at`` is when the request arrived (default: now); ``ended_at`` when the client says the
        conversation ended (its first attempt to send this). The write counts as made at the earlier of the
        two, so that an erasure in between wins over a late delivery.

        With conversation memory on, the end also ends the transcript. If the service ended it already (by
        inactivity or supersession), this is a *late* end: its state is applied as a merge patch written at
        ``made_at`` (a field written later stays), analytics stay as recorded, and ``late`` is true.

        ``call``: the call's trust (:mod:`.trust`); the state keys it does not qualify for are neither written
        nor deleted, and listed in ``withheld``. Through a linked identifier, the end is the profile's.
        ``source``: the platform whose end event this is (told to the webhooks), None for the API's.
        ``caller`` may be the caller already known (a platform's end of a conversation whose events carry no
        number: the conversation's own caller). ``remembered_in``: ``state`` holds what the call remembered
        through MCP already (a platform's end merged it with its extracted data)."""
        check_conversation_id(conversation_id)
        if end_reason is not None and end_reason not in END_REASONS:
            raise InvalidInput(f"end_reason must be one of {', '.join(END_REASONS)}", field="end_reason")
        try:
            who = caller if isinstance(caller, Caller) else self._memory.caller(project, caller)
        except InvalidIdentifier as exc:
            raise InvalidInput(exc.detail.replace("identifier", "caller", 1), field="caller") from None
        regions = regions_of(project, who)
        # An outcome is a label: a number in it (a transfer's handoff_to) is masked, never refused (an end
        # must not be lost for it).
        outcome = masked_outcome(outcome, regions)

        def check_ids() -> None:  # at the first request that names them (none started the conversation)
            check_chosen_id(conversation_id, "conversation_id", "conversation id", regions)
            check_chosen_id(channel, "channel", "channel", regions)

        withheld = project.trust.withheld(call)
        # The request's own state stays what its retries are compared by (``digest`` below).
        key = ConversationKey(project.project_id, conversation_id)
        persisted = await self.remembered.under(project, key, state, who, merged=remembered_in)
        changes = split_state(project, persisted, withheld=withheld)
        if who.blacklisted:
            # Nothing is read, written or counted for a blacklisted caller; a retry is as harmless.
            return ConversationEnd(conversation_id, [], sorted(state), True, {}, False)
        now = self._clock.now_ms()
        made_at = min(now if received_at is None else received_at, now if ended_at is None else ended_at)
        ref = CallerRef(project.project_id, who.subject)
        key = ConversationKey(project.project_id, conversation_id)
        # Identifies the request (no caller data): a retry must send the same, whatever ended it first.
        digest = fingerprint(
            who.subject,
            state,
            [outcome.qa, outcome.handoff_reason, outcome.handoff_to],
            channel,
            *([end_reason] if end_reason is not None else []),
        )
        verdict = _Verdict()
        if not project.conversation.enabled:
            check_ids()
        else:
            verdict, ref = await self._judge(
                project,
                key,
                ref,
                end_reason=end_reason,
                outcome=outcome,
                now=now,
                check_ids=check_ids,
                source=source,
            )
            if verdict.late:
                return await self._late_end(
                    project,
                    ref,
                    conversation_id,
                    changes=changes,
                    made_at=made_at,
                    digest=digest,
                    channel=channel,
                    end_reason=end_reason,
                    outcome=outcome,
                    source=source,
                )
        result, ref = await self.persist(
            project,
            ref,
            conversation_id,
            digest,
            changes,
            made_at=made_at,
            written_at=None,
            analytics_outcome=outcome,
            now=now,
        )
        if result.status is EndStatus.CONFLICT and verdict.expired_transcript:
            # The transcript expired and the record was written by another end: the service's (an inactivity
            # end keeps the record longer than the transcript). Never a 409 for that: a late end, which is
            # itself a 409 if a different late end came first.
            return await self._late_end(
                project,
                ref,
                conversation_id,
                changes=changes,
                made_at=made_at,
                digest=digest,
                channel=channel,
                end_reason=end_reason,
                outcome=outcome,
                source=source,
            )
        if result.status is EndStatus.CONFLICT:
            raise Conflict(
                f"conversation '{conversation_id}' was already ended with a different request; "
                "a retry must send the same caller, state, outcome, channel and end_reason"
            )
        if result.status is EndStatus.ERASED:
            return ConversationEnd(conversation_id, [], sorted(state), False, {}, False, erased=True)
        repeat_caller: RepeatCallerMetrics = {}
        recording: Recording | None = None
        if result.analytics is not None:  # analytics were on when the conversation was first applied
            recording = self._analytics.recording(
                project,
                ref,
                conversation_id,
                channel=channel,
                outcome=outcome,
                found=result.analytics,
                made_at=made_at,
                now=now,
                ended_by="explicit",
                end_reason=end_reason,
                attestation=None if call is None else call.attestation,
            )
            repeat_caller = metrics(result.analytics.first)
        event = None  # a retry of a completed end: its archive and webhooks were made then
        if not verdict.finished:
            event = explicit_event(
                key,
                ref.subject,
                channel=channel,
                end_reason=end_reason,
                outcome=outcome,
                changes=changes,
                made_at=made_at,
                repeat_caller=dict(repeat_caller),
                started_at=verdict.started_at,
                expires_at=verdict.expires_at,
                source=source,
            )
        await self.process_end(project, event, recording, now)
        if verdict.claimed:
            await self._store.finish_end(key, self._clock.now_ms())
        return ConversationEnd(
            conversation_id=conversation_id,
            persisted=changes.persisted,
            ignored=changes.ignored,
            blacklisted=False,
            repeat_caller=repeat_caller,
            replayed=result.status is EndStatus.REPLAYED,
            withheld=changes.withheld,
        )

    async def _judge(
        self,
        project: Project,
        key: ConversationKey,
        ref: CallerRef,
        *,
        end_reason: str | None,
        outcome: Outcome,
        now: int,
        check_ids: Callable[[], None],
        source: str | None,
    ) -> tuple[_Verdict, CallerRef]:
        """:meth:`_judged`, for the caller's profile (with linking, the transcript is the profile's,
        started through any identifier); returns it with the verdict. The call's last answer through the
        memory proxy, if one is kept, is recorded first (before the end claims the transcript)."""
        if self._pending is not None:
            await self._pending.flush(project, key)
        if project.identity_linking:
            ref = CallerRef(project.project_id, await self._store.resolve_profile(ref, now))
        verdict = await self._judged(
            project,
            key,
            ref.subject,
            end_reason=end_reason,
            outcome=outcome,
            now=now,
            check_ids=check_ids,
            source=source,
        )
        return verdict, ref

    async def _judged(
        self,
        project: Project,
        key: ConversationKey,
        subject: str,
        *,
        end_reason: str | None,
        outcome: Outcome,
        now: int,
        check_ids: Callable[[], None],
        source: str | None,
    ) -> _Verdict:
        """How an explicit end relates to the conversation's transcript. It is looked at first: an end
        naming another caller than the live transcript's is refused (409) before anything is written, as
        start, append and summary refuse it (it must neither claim this caller's transcript nor take the id
        from the rightful end), and an end the service already made (or is making) makes this one late,
        whatever its claim says. ``check_ids``: refuses ids that hold a phone number, for an end that is the
        first request to name them (no transcript). An end through the API after a platform's end (``source``
        None, the stored end a platform's) is late too: the business's state still applies, as a merge."""
        header, _ = await self._store.read_conversation(key, now)
        if header is None:
            check_ids()
            return _Verdict()
        if header.subject not in (subject, ""):
            if header.expired(now):
                return _Verdict()  # the id's transcript is gone: its record decides (a reuse, or a conflict)
            owner = header.subject
            if project.identity_linking:  # linked since it started: the profile it belongs to now
                owner = await self._store.resolve_profile(CallerRef(project.project_id, owner), now)
            if owner != subject:
                raise Conflict(f"conversation '{key.conversation_id}' belongs to another caller")
        if header.expired(now):
            return _Verdict(expired_transcript=True)
        if header.status is not TranscriptStatus.OPEN and (
            header.ended_by not in ("", "explicit") or (source is None and ended_by_platform(header.end_data))
        ):
            return _Verdict(late=True)
        claim = await self._store.claim_end(
            EndClaim(
                key,
                "explicit",
                end_reason or "",
                None,
                now + END_LEASE_MS,
                orjson.dumps(
                    [outcome.qa, outcome.handoff_reason, outcome.handoff_to, *([source] if source else [])]
                ),
            ),
            now,
        )
        after = claim.header
        if (
            claim.status is ClaimStatus.ALREADY
            and after is not None
            and (after.ended_by != "explicit" or (source is None and ended_by_platform(after.end_data)))
        ):
            return _Verdict(late=True)
        return _Verdict(
            claimed=claim.status in (ClaimStatus.CLAIMED, ClaimStatus.ALREADY),
            started_at=header.started_at,
            expires_at=header.expires_at,
            finished=header.status is TranscriptStatus.ENDED,
        )

    async def _late_end(
        self,
        project: Project,
        ref: CallerRef,
        conversation_id: str,
        *,
        changes: StateChanges,
        made_at: int,
        digest: str,
        channel: str | None,
        end_reason: str | None,
        outcome: Outcome,
        source: str | None = None,
    ) -> ConversationEnd:
        now = self._clock.now_ms()
        result, ref = await self.persist(
            project,
            ref,
            conversation_id + LATE_SUFFIX,
            digest,
            changes,
            made_at=made_at,
            written_at=made_at,
            analytics_outcome=None,
            now=now,
        )
        if result.status is EndStatus.CONFLICT:
            raise Conflict(
                f"conversation '{conversation_id}' was already ended late with a different request; "
                "a retry must send the same caller, state, outcome, channel and end_reason"
            )
        if result.status is EndStatus.ERASED:
            ignored = sorted([*changes.persisted, *changes.ignored])
            return ConversationEnd(conversation_id, [], ignored, False, {}, False, erased=True, late=True)
        key = ConversationKey(project.project_id, conversation_id)
        event = explicit_event(
            key,
            ref.subject,
            channel=channel,
            end_reason=end_reason,
            outcome=outcome,
            changes=changes,
            made_at=made_at,
            late=True,
            source=source,
        )
        await self.process_end(project, event, None, now)
        return ConversationEnd(
            conversation_id=conversation_id,
            persisted=changes.persisted,
            ignored=changes.ignored,
            blacklisted=False,
            repeat_caller={},
            replayed=result.status is EndStatus.REPLAYED,
            late=True,
            withheld=changes.withheld,
        )

    async def persist(
        self,
        project: Project,
        ref: CallerRef,
        record_id: str,
        digest: str,
        changes: StateChanges,
        *,
        made_at: int,
        written_at: int | None,
        analytics_outcome: Outcome | None,
        now: int,
    ) -> tuple[EndResult, CallerRef]:
        """The first step of every end (explicit, late, inactivity, supersession): the caller's memory and
        the conversation's record, exactly once per ``record_id``. ``written_at`` (None: now) is the write
        time of the fields: a field written after it stays as it is. Returns the result and the caller it
        was written for: ``ref``, or the profile ``ref`` is linked to."""
        at = now if written_at is None else written_at
        stored = {
            name: StoredField(value=value, expires_at=at + project.ttl_ms[name], written_at=at)
            for name, value in changes.sets.items()
            if at + project.ttl_ms[name] > now  # a field that would be born dead is not written
        }
        analytics = (
            AnalyticsService.input_for(project, now, analytics_outcome)
            if project.analytics_enabled and analytics_outcome is not None
            else None
        )
        end = EndWrite(
            caller=ref,
            conversation_id=record_id,
            fingerprint=digest,
            expires_at=now + min(RECALL_WINDOW_MS, project.retention_ms),
            made_at=made_at,
            sets=stored,
            deletes=changes.deletes,
            analytics=analytics,
            written_at=written_at,
        )
        try:
            return await self._store.end_conversation(end, now), ref
        except ProfileMoved as moved:  # a linked identifier: the end is the profile's
            profile = CallerRef(ref.project, moved.profile)
            return await self._store.end_conversation(replace(end, caller=profile), now), profile
