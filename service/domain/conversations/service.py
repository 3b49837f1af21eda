"""Conversation memory use cases (SPEC sections 10 and 14): history, summary, context, admin listing and
deletion; appends (:mod:`caller_memory.service.domain.conversations.appends`, what a message loses before it is stored in
:mod:`caller_memory.service.domain.conversations.redaction`); start, resume and the ends the service makes itself (inactivity,
supersession) in :mod:`caller_memory.service.domain.conversations.lifecycle`.

Every message is validated, redacted and encoded before the store sees it; the store keeps opaque
bytes. The ends the service makes run exactly the end processing of an explicit end
(:meth:`~caller_memory.service.domain.conversations.ending.ConversationService.persist` and analytics), with the last state checkpoint as the
state and its time as the write time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson

from ..analytics import AnalyticsService
from ..audit import AuditLog
from ..clock import Clock, ceil_hour_ms, floor_hour_ms, iso_utc
from ..errors import (
    Conflict,
    Forbidden,
    Gone,
    InvalidInput,
    NotFound,
)
from ..fields import StoredField
from ..memory import Caller, MemoryService
from ..projects import Project
from ..store import CallerRef, Store
from ..store.transcripts import (
    ConversationKey,
    Header,
    TranscriptQuery,
    TranscriptStatus,
)
from ..trust import TRANSCRIPT_CLASS, CallTrust
from .appends import TranscriptAppends
from .ending import (
    ConversationService,
    check_conversation_id,
    fingerprint,
)
from .events import DeletionListener, StartListener
from .messages import (
    MAX_MESSAGES,
    MAX_TRANSCRIPT_BYTES,
    Message,
    chat_of_row,
    estimate_tokens,
    stored_rows,
    turns_of_rows,
)
from .redaction import TranscriptRedaction, regions_of
from .requests import (
    EVERYONE,
    Reader,
    SummaryBody,
    ended_by_of,
    parse_body,
    status_of,
    summary_of,
    summary_section,
    token_source,
)
from .views import (
    Appended,
    CallerConversations,
    ContextSections,
    ConversationStatus,
    History,
    OpenAIHistory,
    ProfileSection,
    RecentTurnsSection,
)
from .views import Context as ContextView

log = logging.getLogger("caller_memory.transcripts")

#: Most messages a history page returns, and the default.
MAX_PAGE = 1000
DEFAULT_PAGE = 200
#: How many of the latest messages context assembly and resume look at.
CONTEXT_WINDOW = 2000
RESUME_TURNS = 3
RESUME_MESSAGES = 20
#: Share of the budget the caller's memory may take in a context; and the summarise threshold.
PROFILE_SHARE = 0.25
SUMMARY_THRESHOLD = 0.75


class TranscriptService:
    def __init__(
        self,
        store: Store,
        memory: MemoryService,
        conversations: ConversationService,
        analytics: AnalyticsService,
        clock: Clock,
        *,
        audit: AuditLog,
        max_messages: int = MAX_MESSAGES,
        max_bytes: int = MAX_TRANSCRIPT_BYTES,
        deletion_listeners: Sequence[DeletionListener] = (),
        started: StartListener | None = None,
    ) -> None:
        """``deletion_listeners``: told of a transcript an admin deleted (the archive deletes its copy);
        ``started``: of a conversation an append started (the lifecycle supersedes the caller's open ones)."""
        self._store = store
        self._memory = memory
        self._conversations = conversations
        self._analytics = analytics
        self._clock = clock
        self._audit = audit
        #: What a transcript loses before it is stored (phone numbers, the caller's identifiers).
        self.redaction = TranscriptRedaction(store, memory)
        #: Appends and the start's write (:mod:`caller_memory.service.domain.conversations.appends`).
        self.appends = TranscriptAppends(
            store,
            memory,
            clock,
            self.redaction,
            max_messages=max_messages,
            max_bytes=max_bytes,
            started=started,
        )
        #: Conversation -> its caller's pseudonym as last seen (``TranscriptAppends.subjects``: a hint).
        self._subjects = self.appends.subjects
        self._deletion_listeners = tuple(deletion_listeners)

    # Views ------------------------------------------------------------------------------------------------

    def status_view(self, header: Header, project: Project, now: int) -> ConversationStatus:
        section = summary_section(summary_of(header))
        open_ = header.status is TranscriptStatus.OPEN
        return {
            "conversation_id": header.key.conversation_id,
            "status": status_of(header, project, now),
            "channel": header.channel,
            "agent": header.agent or None,
            "started_at": iso_utc(floor_hour_ms(header.started_at)),
            "last_activity_at": iso_utc(
                header.last_activity if open_ else floor_hour_ms(header.last_activity)
            ),
            "turn_id": header.turn_id,
            "messages": header.messages,
            "tokens": header.tokens,
            "bytes": header.bytes,
            "summary": None
            if section is None
            else {"through_turn": section["through_turn"], "tokens": section["tokens"]},
            "ended_by": ended_by_of(header),
            "end_reason": header.end_reason or None,
            "end_processed": header.status is TranscriptStatus.ENDED,
            "expires_at": iso_utc(ceil_hour_ms(header.expires_at)),
        }

    # Reading ----------------------------------------------------------------------------------------------

    def _remember(self, key: ConversationKey, subject: str) -> None:
        self.appends.remember(key, subject)

    @staticmethod
    def _readable(project: Project, conversation_id: str) -> None:
        check_conversation_id(conversation_id)
        if not project.conversation.enabled:
            raise NotFound(
                f"conversation memory is off for project '{project.project_id}' "
                "(memory.conversation.enabled in its configuration)"
            )

    @staticmethod
    def _found(
        header: Header | None,
        conversation_id: str,
        now: int,
        project: Project | None = None,
        call: CallTrust | None = None,
    ) -> Header:
        """``header`` if its transcript can be read, else 404 / 410; with ``project``, also 403 when the
        reading call's trust (``call``) does not qualify for it. Every read of a transcript's content
        (history, context) goes through here: the transcript of a conversation that has ended (an earlier
        call, not this one) needs the level of the ``sensitive`` class, as its resume does."""
        if header is None:
            raise NotFound(f"conversation '{conversation_id}' has no transcript")
        if header.status is TranscriptStatus.DELETED:
            raise Gone(f"the transcript of conversation '{conversation_id}' was deleted")
        if header.status is TranscriptStatus.ERASED or header.expired(now):
            raise Gone(f"the transcript of conversation '{conversation_id}' expired or was erased")
        if (
            project is not None
            and header.status is not TranscriptStatus.OPEN
            and not project.trust.may_resume_transcript(call)
        ):
            raise Forbidden(
                "this call's caller-ID trust does not qualify for the transcript of an ended conversation "
                f"(the '{TRANSCRIPT_CLASS}' class needs '{project.trust.transcript_level}')"
            )
        return header

    async def _live(
        self,
        project: Project,
        conversation_id: str,
        query: TranscriptQuery | None = None,
        *,
        content: bool = False,
        call: CallTrust | None = None,
    ) -> tuple[Header, list[Message], int]:
        """The conversation's header and messages (decoded), or 404 / 410; with ``content`` (a read of what
        was said), 403 when ``call`` does not qualify for it (:meth:`_found`)."""
        self._readable(project, conversation_id)
        now = self._clock.now_ms()
        header, stored = await self._store.read_conversation(
            ConversationKey(project.project_id, conversation_id), now, query
        )
        header = self._found(header, conversation_id, now, project if content else None, call)
        return header, Message.decode_all([m.body for m in stored]), now

    async def status(self, project: Project, conversation_id: str) -> ConversationStatus:
        header, _, now = await self._live(project, conversation_id)
        return self.status_view(header, project, now)

    async def _audit_read(
        self, project: Project, conversation_id: str, what: str, reader: str | None
    ) -> None:
        """Reads of transcripts by an admin (or the operator) are audited; the agent in the call is not."""
        if reader is not None:
            await self._audit.record(
                project.project_id,
                reader,
                "transcript.read",
                {"conversation_id": conversation_id, "read": what},
            )

    async def history(
        self,
        project: Project,
        conversation_id: str,
        *,
        reader: Reader = EVERYONE,
        after_turn: int | None = None,
        limit: int = DEFAULT_PAGE,
        openai: bool = False,
        call: CallTrust | None = None,
        audited_as: str | None = None,
    ) -> tuple[History | OpenAIHistory, Header]:
        """``call``: the reading call's trust. The transcript of a conversation that has ended (an earlier
        call, not this one) needs the level of the ``sensitive`` class, as its resume does. ``audited_as``:
        the reader, when the read is audited (an admin or the operator; None: the agent in the call)."""
        read = await self._history(
            project,
            conversation_id,
            reader=reader,
            after_turn=after_turn,
            limit=limit,
            openai=openai,
            call=call,
        )
        await self._audit_read(project, conversation_id, "history", audited_as)
        return read

    async def _history(
        self,
        project: Project,
        conversation_id: str,
        *,
        reader: Reader,
        after_turn: int | None,
        limit: int,
        openai: bool,
        call: CallTrust | None,
    ) -> tuple[History | OpenAIHistory, Header]:
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidInput(f"limit must be 1 to {MAX_PAGE}", field="limit")
        header, messages, now = await self._live(
            project,
            conversation_id,
            TranscriptQuery(after_turn=after_turn, limit=limit + 1),
            content=True,
            call=call,
        )
        next_after: int | None = None
        if len(messages) > limit:
            # Pages end on a whole turn: the last turn of a full page continues on the next one.
            messages = messages[:limit]
            last = messages[-1].turn_id
            whole = [m for m in messages if m.turn_id < last]
            if whole:
                messages = whole
                next_after = whole[-1].turn_id
            else:
                # One turn fills the page: pages go by turn (after_turn), so this one holds the whole turn,
                # however long, rather than lose its end between two pages.
                _, rest = await self._store.read_conversation(
                    header.key, now, TranscriptQuery(after_turn=after_turn, limit=MAX_MESSAGES + 1)
                )
                turn = Message.decode_all([m.body for m in rest if m.turn_id == last])
                more = len(rest) > len(turn)
                messages, next_after = turn, (last if more else None)
        visible = [m for m in messages if m.visible_to(reader.agent)]
        if openai:
            chat: OpenAIHistory = {"messages": [m.openai() for m in visible if m.role != "tool"]}
            return chat, header
        ended = header.status is not TranscriptStatus.OPEN
        start = header.started_at if ended else None
        body: History = {
            "conversation_id": conversation_id,
            "status": status_of(header, project, now),
            "turn_id": header.turn_id,
            "started_at": iso_utc(floor_hour_ms(header.started_at)),
            "times": "offset_ms" if ended else "epoch_ms",
            "contents": [m.platform(start) for m in visible],
            "next_after_turn": next_after,
        }
        return body, header

    @staticmethod
    def etag(header: Header, reader: Reader, *parts: object) -> str:
        """Changes whenever what a read returns may change (new messages, summary, status)."""
        summary = header.summary.decode() if header.summary is not None else None
        digest = fingerprint(
            header.messages, header.status.value, header.turn_id, summary, reader.agent, *parts
        )
        return f'W/"{digest[:20]}"'

    async def context(
        self,
        project: Project,
        conversation_id: str,
        max_tokens: int,
        *,
        reader: Reader = EVERYONE,
        call: CallTrust | None = None,
        audited_as: str | None = None,
    ) -> ContextView:
        """``audited_as``: the reader, when the read is audited (an admin or the operator; None: the agent
        in the call)."""
        context = await self._context(project, conversation_id, max_tokens, reader=reader, call=call)
        await self._audit_read(project, conversation_id, "context", audited_as)
        return context

    async def _context(
        self,
        project: Project,
        conversation_id: str,
        max_tokens: int,
        *,
        reader: Reader,
        call: CallTrust | None,
    ) -> ContextView:
        self._readable(project, conversation_id)
        now = self._clock.now_ms()
        key = ConversationKey(project.project_id, conversation_id)
        hint = self._subjects.get(key)
        if hint is not None and hint in project.blacklist:
            hint = None  # a blacklisted caller's memory is not shown: nothing to read
        # The transcript and (when the hint is right) the caller's memory in one store call.
        found, stored, fields = await self._store.read_context(
            key, hint, now, TranscriptQuery(last=CONTEXT_WINDOW)
        )
        header = self._found(found, conversation_id, now, project, call)
        if header.subject:
            self._remember(key, header.subject)
        if hint != header.subject or project.identity_linking:
            # Read for another caller than the conversation's: never shown. With linking, the conversation's
            # caller may have become an identifier linked to a profile since it started: read_fields follows
            # the link (read_context reads the subject's own fields only).
            fields = None
        rows = stored_rows([m.body for m in stored])
        summary = summary_of(header, reader)
        through = summary["through_turn"] if summary else -1
        profile = await self._profile(
            project,
            header,
            int(max_tokens * PROFILE_SHARE),
            now,
            read=fields,
            withheld=project.trust.withheld(call),
        )
        summarised = summary_section(summary)
        if summarised is not None and summarised["tokens"] > max_tokens - profile["tokens"]:
            summarised = None  # a summary longer than the budget is left out: the context stays within it
        left = max_tokens - profile["tokens"] - (summarised["tokens"] if summarised else 0)
        # Each turn's messages and token cost, counted once (a read of 2,000 messages counts each once).
        turns, costs = turns_of_rows(rows, through, reader.agent)
        unsummarized = sum(costs.values())
        chosen: list[list[list[Any]]] = []
        recent_tokens = 0
        for turn in sorted(turns, reverse=True):  # newest first: older turns are dropped first
            cost = costs[turn]
            if cost > left:
                break
            left -= cost
            recent_tokens += cost
            chosen.append(turns[turn])
        chosen.reverse()
        kept = [row for group in chosen for row in group]
        recent: RecentTurnsSection = {
            "provenance": "transcript",
            "tokens": recent_tokens,
            "token_source": token_source(row[4] for row in kept),
            "from_turn": kept[0][2] if kept else None,
            "to_turn": kept[-1][2] if kept else None,
            "dropped_turns": len(turns) - len(chosen),
            "messages": [chat_of_row(row) for row in kept],
        }
        sections: ContextSections = {"profile": profile, "summary": summarised, "recent_turns": recent}
        total = profile["tokens"] + (summarised["tokens"] if summarised else 0) + recent["tokens"]
        return {
            "conversation_id": conversation_id,
            "status": status_of(header, project, now),
            "max_tokens": max_tokens,
            "tokens": total,
            "unsummarized_tokens": unsummarized,
            "needs_summary": unsummarized > SUMMARY_THRESHOLD * max_tokens,
            "sections": sections,
        }

    async def _profile(
        self,
        project: Project,
        header: Header,
        cap: int,
        now: int,
        *,
        read: dict[str, StoredField] | None = None,
        withheld: tuple[str, ...] = (),
    ) -> ProfileSection:
        """The caller's memory (live fields under the current TTLs), within ``cap`` tokens: fields in name
        order until the next would pass it. ``read``: the fields of ``header.subject`` already read with the
        transcript (None: read them here)."""
        fields: dict[str, Any] = {}
        omitted: list[str] = []
        tokens = 0
        if header.subject and header.subject not in project.blacklist:
            stored = read
            if stored is None:
                stored = await self._store.read_fields(CallerRef(project.project_id, header.subject), now)
            for name in sorted(stored):
                f = stored[name]
                if now >= min(f.expires_at, f.written_at + project.ttl_ms.get(name, 0)):
                    continue
                if withheld and name in withheld:
                    continue
                cost = estimate_tokens(name) + estimate_tokens(f.value.decode()) + 1
                if tokens + cost > cap:
                    omitted.append(name)
                    continue
                tokens += cost
                fields[name] = orjson.loads(f.value)
        return {
            "provenance": "caller_memory",
            "tokens": tokens,
            "token_source": "estimate",
            "fields": fields,
            "omitted": omitted,
            "withheld": list(withheld),
        }

    # Writing ----------------------------------------------------------------------------------------------

    # Writing (:mod:`caller_memory.service.domain.conversations.appends`) -----------------------------------------------------------------

    def caller(self, project: Project, raw: str) -> Caller:
        """The caller a request names (422 naming ``caller`` when it is no identifier)."""
        return self.appends.caller(project, raw)

    async def append(
        self,
        project: Project,
        conversation_id: str,
        document: Any,
        *,
        received_at: int | None = None,
        writer: str | None = None,
    ) -> Appended:
        """:meth:`~caller_memory.service.domain.conversations.appends.TranscriptAppends.append`."""
        return await self.appends.append(
            project, conversation_id, document, received_at=received_at, writer=writer
        )

    async def add_late(self, project: Project, header: Header, raw_caller: str, messages: list[Any]) -> bool:
        """:meth:`~caller_memory.service.domain.conversations.appends.TranscriptAppends.add_late`."""
        return await self.appends.add_late(project, header, raw_caller, messages)

    async def put_summary(
        self, project: Project, conversation_id: str, document: Any, *, reader: Reader = EVERYONE
    ) -> ConversationStatus:
        """``reader``: who writes it. Under ``transcript_scope: "agent"`` an agent's summary is its own: kept
        with its author, shown to that agent only (:func:`~caller_memory.service.domain.conversations.requests.summary_of`), and not replaced by
        another agent (403); an admin (``EVERYONE``) may replace any."""
        body: SummaryBody = parse_body(SummaryBody, document, "summary")
        header, _, now = await self._live(project, conversation_id)
        if reader.agent is not None and header.summary is not None:
            author = orjson.loads(header.summary).get("agent")
            if author != reader.agent:
                raise Forbidden(
                    "the conversation's summary was written by another agent (transcript_scope 'agent': "
                    "each agent's summary is its own); an admin may replace it"
                )
        if body.through_turn > header.turn_id:
            raise InvalidInput(
                "through_turn is beyond the conversation's latest turn (GET the conversation for its turn_id)",
                field="through_turn",
            )
        caller = self.caller(project, body.caller) if body.caller is not None else None
        if caller is not None and caller.subject != header.subject:
            raise Conflict(f"conversation '{conversation_id}' belongs to another caller")
        own = await self.redaction.owned(project, caller, header.subject, now)
        redactor = self.redaction.redactor(project, caller, own, regions_of(project, caller, header.region))
        text = (await redactor([body.text]))[0]
        kept: dict[str, Any] = {"text": text, "through_turn": body.through_turn, "tokens": body.tokens}
        if reader.agent is not None:
            kept["agent"] = reader.agent
        summary = orjson.dumps(kept)
        updated = await self._store.put_summary(header.key, summary, now)
        if updated is None:
            raise Gone(f"the transcript of conversation '{conversation_id}' expired or was erased")
        return self.status_view(updated, project, now)

    # Admin ------------------------------------------------------------------------------------------------

    async def for_caller(
        self, project: Project, raw_identifier: str, *, limit: int = 50, cursor: str | None = None
    ) -> CallerConversations:
        """One page of the caller's conversations, newest start first: at most ``limit``, after ``cursor``
        (the ``next_cursor`` of the previous page). A page may hold fewer than ``limit`` while more follow
        (expired transcripts are left out); ``next_cursor`` is None on the last."""
        from ..store.transcripts import PagePosition  # (kept local: this method's edit stands alone)

        after = None if cursor is None else PagePosition.parse(cursor)
        if cursor is not None and after is None:
            raise InvalidInput(
                "cursor is not one this listing returned; start again without it", field="cursor"
            )
        caller = self.caller(project, raw_identifier)
        now = self._clock.now_ms()
        ref = CallerRef(project.project_id, caller.subject)
        ref = CallerRef(project.project_id, await self._store.resolve_profile(ref, now))
        page = await self._store.caller_conversations_page(ref, now, limit, after)
        return {
            "conversations": [self.status_view(h, project, now) for h in page.headers if not h.expired(now)],
            "next_cursor": None if page.next is None else page.next.token(),
        }

    async def remember(
        self, project: Project, conversation_id: str, name: str, value: Any, call: CallTrust | None
    ) -> bool:
        """Remember ``name`` = ``value`` for the call's end (MCP's ``remember``; :mod:`.remembered`): checked
        like an end's state, redacted like its checkpoint. False: not kept (a blacklisted caller's call)."""
        remembered = self._conversations.remembered
        header, _, now = await self._live(project, conversation_id)
        encoded = remembered.check(project, header, name, value, call)
        if header.subject in project.blacklist:
            return False
        encoded = await self.redaction.state_value(project, header.subject, header.region, encoded, now)
        await remembered.keep(header, name, encoded, now)
        return True

    async def delete(self, project: Project, conversation_id: str, *, actor: str | None = None) -> Header:
        """Delete a conversation's transcript (and its archived copy), audited as done by ``actor`` (None:
        not audited, for a caller that has no actor to name)."""
        check_conversation_id(conversation_id)
        now = self._clock.now_ms()
        header = await self._store.delete_conversation(
            ConversationKey(project.project_id, conversation_id), now
        )
        if header is None:
            raise NotFound(f"conversation '{conversation_id}' has no transcript")
        for listener in self._deletion_listeners:  # its archived copy goes too
            await listener.conversation_deleted(project, header)
        if actor is not None:
            await self._audit.record(
                project.project_id,
                actor,
                "transcript.deleted",
                {"conversation_id": conversation_id, "messages": header.messages},
            )
        return header
