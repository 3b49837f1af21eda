"""Appending to a conversation (SPEC sections 10 and 14): a batch of messages and/or a state checkpoint,
validated, redacted (:mod:`caller_memory.service.domain.conversations.redaction`) and encoded before the store sees it, which keeps opaque
bytes; and the write a start makes. The idempotency of a retry, an append's refusals in their order, and the
project's bound on its transcripts' bytes are here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ..clock import Clock
from ..errors import InvalidIdentifier, InvalidInput, PayloadTooLarge, TranscriptsFull
from ..limits import MAX_STATE_ENTRIES, MAX_VALUE_BYTES, RECALL_WINDOW_MS
from ..memory import Caller, MemoryService
from ..projects import Project
from ..store import CallerRef, Store
from ..store.transcripts import (
    AppendResult,
    AppendStatus,
    AppendWrite,
    ConversationKey,
    Header,
    NewMessage,
    TranscriptQuery,
    TranscriptStatus,
)
from ..trust import CallTrust
from .ending import check_conversation_id, split_state
from .events import StartListener
from .messages import MAX_MESSAGES, MAX_TRANSCRIPT_BYTES, Incoming, check_batch_order
from .redaction import TranscriptRedaction, caller_region, check_ids, regions_of
from .requests import (
    attributed,
    message_may_hold_number,
    parse_append,
    refuse,
    status_of,
)
from .views import Appended

#: How long a project's transcript byte count is reused before it is asked again.
BYTES_CACHE_MS = 1000
#: How many messages from the first retried turn on a retry's identical messages are looked for among.
RETRY_WINDOW = 1000
#: How many conversations' callers a process remembers (a hint for reading a context in one store call).
SUBJECT_CACHE = 8192


def _refusal(header: Header | None, now: int) -> AppendStatus | None:
    """How an append without caller and channel to the conversation of ``header`` is refused, before the
    store is asked (None: it would be taken)."""
    if header is None or header.status is TranscriptStatus.DELETED:
        return AppendStatus.NOT_FOUND
    if header.status is TranscriptStatus.ERASED:
        return AppendStatus.ERASED
    if header.expired(now):
        return AppendStatus.EXPIRED
    if header.status is not TranscriptStatus.OPEN:
        return AppendStatus.ENDED
    return None


class TranscriptAppends:
    """The appends of one process (its caches: the projects' transcript bytes, the conversations' callers)."""

    def __init__(
        self,
        store: Store,
        memory: MemoryService,
        clock: Clock,
        redaction: TranscriptRedaction,
        *,
        max_messages: int = MAX_MESSAGES,
        max_bytes: int = MAX_TRANSCRIPT_BYTES,
        started: StartListener | None = None,
    ) -> None:
        """``started``: told when an append started a conversation (the lifecycle supersedes the caller's
        open ones)."""
        self._store = store
        self._memory = memory
        self._clock = clock
        self.redaction = redaction
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._bytes_cache: dict[str, tuple[int, int]] = {}
        #: Conversation -> the caller's pseudonym, as last seen (appends, starts, reads): which caller's memory
        #: a context reads with its transcript. Only a hint: the store and the domain check it against the
        #: header. Bounded; the oldest entry goes first.
        self.subjects: dict[ConversationKey, str] = {}
        self._started = started

    def remember(self, key: ConversationKey, subject: str) -> None:
        """Keep ``subject`` as the caller of ``key`` (see ``subjects``)."""
        subjects = self.subjects
        if subjects.get(key) != subject:
            subjects[key] = subject
            if len(subjects) > SUBJECT_CACHE:
                del subjects[next(iter(subjects))]

    def caller(self, project: Project, raw: str) -> Caller:
        try:
            return self._memory.caller(project, raw)
        except InvalidIdentifier as exc:
            raise InvalidInput(exc.detail.replace("identifier", "caller", 1), field="caller") from None

    async def _check_project_bytes(self, project: Project, now: int) -> None:
        cached = self._bytes_cache.get(project.project_id)
        if cached is None or now - cached[1] >= BYTES_CACHE_MS:
            total = await self._store.transcript_bytes(
                project.project_id, now, now - project.conversation.transcript_retention_ms
            )
            cached = (total, now)
            self._bytes_cache[project.project_id] = cached
        limit = project.conversation.max_transcript_bytes
        if cached[0] >= limit:
            raise TranscriptsFull(
                f"the project's transcripts hold {cached[0]:,} bytes, at its limit "
                f"(memory.conversation.max_transcript_bytes = {limit:,}); ends are still taken"
            )

    def write(
        self,
        project: Project,
        key: ConversationKey,
        caller: Caller | None,
        subject: str,
        *,
        channel: str,
        agent: str,
        messages: list[NewMessage],
        checkpoint: bytes | None,
        made_at: int,
        now: int,
    ) -> AppendWrite:
        cc = project.conversation
        expires_at = now + cc.transcript_retention_ms
        if subject:  # appends that name the caller, and starts
            self.remember(key, subject)
        # The caller's region, kept with the conversation (never the number): "" for other identifiers.
        region = caller_region(caller)
        if caller is not None:
            self.redaction.remember_region(key, region)
        return AppendWrite(
            key=key,
            caller=CallerRef(project.project_id, subject),
            channel=channel,
            agent=agent,
            create=caller is not None,
            messages=messages,
            checkpoint=checkpoint,
            made_at=made_at,
            expires_at=expires_at,
            forget_at=expires_at + min(RECALL_WINDOW_MS, project.retention_ms),
            due_at=now + cc.end_after_inactivity_ms,
            max_messages=self.max_messages,
            max_bytes=self.max_bytes,
            region=region,
        )

    async def append(
        self,
        project: Project,
        conversation_id: str,
        document: Any,
        *,
        received_at: int | None = None,
        writer: str | None = None,
    ) -> Appended:
        """``writer``: the agent the token acts as (an agent token minted for one), which the messages it
        writes are attributed to (a message naming another agent is refused)."""
        check_conversation_id(conversation_id)
        body = parse_append(document)
        if writer is not None:
            body = attributed(body, writer)
        problem = check_batch_order(body.messages)
        if problem is not None:
            raise InvalidInput(problem, field="messages")
        if (body.caller is None) != (body.channel is None):
            raise InvalidInput(
                "send caller and channel together (both start a conversation), or neither", field="caller"
            )
        caller = self.caller(project, body.caller) if body.caller is not None else None
        call = CallTrust.of(body.attestation, body.step_up) if body.state is not None else None
        checkpoint = self._checkpoint(project, body.state, call)
        not_stored: Appended = {
            "conversation_id": conversation_id,
            "stored": False,
            "status": None,
            "turn_id": -1,
            "added": 0,
            "messages": 0,
            "bytes": 0,
            "tokens": 0,
        }
        if not project.conversation.enabled:
            return {**not_stored, "reason": "disabled"}
        if caller is not None and caller.blacklisted:
            return {**not_stored, "reason": "blacklisted"}
        now = self._clock.now_ms()
        made_at = min(received_at or now, body.sent_at or now)
        key = ConversationKey(project.project_id, conversation_id)
        subject, region = await self._whose(project, key, caller, body.messages, now)
        regions = regions_of(project, caller, region)
        check_ids(conversation_id, body, regions, creates=caller is not None)
        own = await self.redaction.owned(project, caller, subject, now)
        redactor = self.redaction.redactor(project, caller, own, regions)
        checkpoint = await self.redaction.checkpoint(checkpoint, redactor)
        # A message without its timestamp gets the batch's first attempt time (stable across retries, so a
        # retry is still the same message), else its arrival time.
        encoded = await self.redaction.encode(body.messages, redactor, body.sent_at or now)
        if encoded and not await self._room_for(project, key, caller is not None, now):
            return {**not_stored, "reason": "erased"}
        write = self.write(
            project,
            key,
            caller,
            subject if caller is not None else "",
            channel=body.channel or "",
            agent=body.agent or "",
            messages=encoded,
            checkpoint=checkpoint,
            made_at=made_at,
            now=now,
        )
        result = await self._store.append_messages(write, now)
        if result.status is AppendStatus.ID_CONFLICT and body.sent_at is None:
            result = await self._again_with_stored_times(write, body.messages, now) or result
        status = result.status
        if status is AppendStatus.ERASED:
            return {**not_stored, "reason": "erased"}
        refuse(status, conversation_id, result.detail)
        header = result.header
        assert header is not None  # every accepted append has one
        if caller is None and header.subject:
            self.remember(key, header.subject)
        created = caller is not None and header.started_at == now and header.messages == result.added
        if created and not result.alone and self._started is not None:
            await self._started.conversation_started(project, header)
        if result.added:
            self._count_added(project, encoded)
        return {
            "conversation_id": conversation_id,
            "stored": True,
            "status": status_of(header, project, now),
            "turn_id": header.turn_id,
            "added": result.added,
            "messages": header.messages,
            "bytes": header.bytes,
            "tokens": header.tokens,
        }

    async def add_late(self, project: Project, header: Header, raw_caller: str, messages: list[Any]) -> bool:
        """A platform's transcript for a conversation the service ended before the platform's end came
        (SPEC 15): validated, redacted and encoded as an append's messages are, and added once, to a
        transcript without messages (:meth:`~caller_memory.service.domain.store.Store.add_late_messages`).
        Whether it was added."""
        body = parse_append({"messages": messages})
        problem = check_batch_order(body.messages)
        if problem is not None:
            raise InvalidInput(problem, field="messages")
        # "": the conversation's own caller (a platform whose events carry no number: Agora).
        caller = self.caller(project, raw_caller) if raw_caller else None
        if (caller is not None and caller.subject != header.subject) or not body.messages:
            return False
        now = self._clock.now_ms()
        own = await self.redaction.owned(project, caller, header.subject, now)
        redactor = self.redaction.redactor(project, caller, own, regions_of(project, caller, header.region))
        encoded = await self.redaction.encode(body.messages, redactor, now)
        if len(encoded) > self.max_messages or sum(len(m.body) for m in encoded) > self.max_bytes:
            return False
        added = await self._store.add_late_messages(header.key, encoded, now)
        if added:
            self._count_added(project, encoded)
        return added

    async def encode_answer(self, project: Project, key: ConversationKey, message: Any) -> NewMessage | None:
        """One message of an append's shape (the memory proxy's last answer of a call), validated, redacted and
        encoded as an append of it would be, for :class:`~caller_memory.service.domain.conversations.pending.
        PendingAnswers` to record later; None when it is not one an append would take."""
        try:
            body = parse_append({"messages": [message]})
        except InvalidInput:
            return None
        now = self._clock.now_ms()
        subject, region = await self._whose(project, key, None, body.messages, now)
        own = await self.redaction.owned(project, None, subject, now)
        redactor = self.redaction.redactor(project, None, own, regions_of(project, None, region))
        try:
            (encoded,) = await self.redaction.encode(body.messages, redactor, now)
        except PayloadTooLarge:
            return None
        return encoded

    def _count_added(self, project: Project, encoded: Sequence[NewMessage]) -> None:
        """Add what an append stored to the project's cached byte count (:meth:`_check_project_bytes`)."""
        cached = self._bytes_cache.get(project.project_id)
        if cached is not None:
            added = sum(len(m.body) for m in encoded)
            self._bytes_cache[project.project_id] = (cached[0] + added, cached[1])

    async def _room_for(self, project: Project, key: ConversationKey, creates: bool, now: int) -> bool:
        """507 when the project's transcripts are at their bound (:meth:`_check_project_bytes`). What the
        append names is judged first: an append to a conversation that never started (or has ended, expired
        or was deleted) gets that answer, not 507. False: the caller was erased (the append is dropped)."""
        try:
            await self._check_project_bytes(project, now)
        except TranscriptsFull:
            if not creates:
                found, _ = await self._store.read_conversation(key, now)
                status = _refusal(found, now)
                if status is AppendStatus.ERASED:
                    return False
                if status is not None:
                    refuse(status, key.conversation_id, "")
            raise
        return True

    async def _again_with_stored_times(
        self, write: AppendWrite, incoming: Sequence[Incoming], now: int
    ) -> AppendResult | None:
        """An append refused for a message id, made again once the messages sent without times take the
        stored ones' (:meth:`_stored_times`); None when none does."""
        timed = await self._stored_times(write.key, incoming, list(write.messages), now)
        if timed is None:
            return None
        write.messages = timed
        return await self._store.append_messages(write, now)

    async def _stored_times(
        self, key: ConversationKey, incoming: Sequence[Incoming], encoded: list[NewMessage], now: int
    ) -> list[NewMessage] | None:
        """A retry of messages sent with ids but without ``timestamp`` (and without ``sent_at``): the service
        gave each the time it arrived, so the retry's bodies differ from the stored ones by that time alone.
        Each such message takes the body stored under its id when the two differ only there (it is the same
        message, sent again); None when no message does. Read only after an append was refused for an id."""
        untimed = {
            m.message_id: index
            for index, m in enumerate(incoming)
            if m.message_id is not None and m.timestamp is None
        }
        if not untimed:
            return None
        first = min(incoming[index].turn_id for index in untimed.values())
        # Bounded: a retry repeats the latest turns; ids further back than a page are not looked for (409).
        query = TranscriptQuery(after_turn=first - 1, limit=RETRY_WINDOW)
        _, stored = await self._store.read_conversation(key, now, query)
        out, changed = list(encoded), False
        for message in stored:
            index = untimed.get(message.message_id) if message.message_id is not None else None
            if index is None:
                continue
            kept, sent = orjson.loads(message.body), orjson.loads(encoded[index].body)
            # Rows are encode_message's list: the timestamp is its fourth item.
            if len(kept) == len(sent) and kept[:3] + kept[4:] == sent[:3] + sent[4:]:
                out[index] = NewMessage(
                    encoded[index].turn_id, message.body, message.message_id, encoded[index].tokens
                )
                changed = True
        return out if changed else None

    async def _whose(
        self,
        project: Project,
        key: ConversationKey,
        caller: Caller | None,
        messages: Sequence[Incoming],
        now: int,
    ) -> tuple[str, str]:
        """Whose conversation an append is (the caller's profile, "" when it names no caller and that does
        not matter) and the region its numbers are read in besides the project's (their caller's, kept with
        the conversation: a foreign caller's national form is theirs). Read from the conversation only when
        it matters: text without digits enough for a number, in a project without links, is redacted the
        same whoever the caller is."""
        if caller is not None:
            return await self._owner(project, caller, now), ""
        digits = any(message_may_hold_number(m) for m in messages)
        known = self.redaction.known_region(key)
        if (project.identity_linking and messages) or (
            digits and (known is None or not project.conversation.redact_phone_numbers)
        ):
            # The caller's own identifiers are removed whatever the option says: find out who they are.
            header, _ = await self._store.read_conversation(key, now)
            if header is None:
                return "", ""
            self.redaction.remember_region(key, header.region)
            return header.subject, header.region
        return "", known or ""

    async def _owner(self, project: Project, caller: Caller | None, now: int) -> str:
        """Whose conversation an append names: its caller's profile ("" when it names no caller)."""
        if caller is None:
            return ""
        if not project.identity_linking:
            return caller.subject
        return await self._store.resolve_profile(CallerRef(project.project_id, caller.subject), now)

    @staticmethod
    def _checkpoint(
        project: Project, state: dict[str, Any] | None, call: CallTrust | None = None
    ) -> bytes | None:
        """The checkpoint to keep: ``state`` checked like an end's, without the keys ``call`` may not write
        (an end that applies it must not write them either)."""
        if state is None:
            return None
        changes = split_state(project, state)  # field names and value sizes checked like an end's
        withheld = project.trust.withheld(call)
        if withheld and changes.persisted:
            state = {name: value for name, value in state.items() if name not in withheld}
        encoded = orjson.dumps(state)
        if len(encoded) > MAX_STATE_ENTRIES * MAX_VALUE_BYTES:  # pragma: no cover - bounded by the two above
            raise PayloadTooLarge("state is too large", field="state")
        return encoded
