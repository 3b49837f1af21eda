"""The conversation-memory part of the Store interface (SPEC section 10): transcripts, their lifecycle, state
checkpoints and summaries. :class:`~caller_memory.service.domain.store.core.Store` inherits it; every backend implements it with identical
semantics (tests/storage/test_transcripts.py).

The store keeps what the domain has already validated, redacted and encoded: a message is opaque JSON bytes
with the two attributes the store must order and deduplicate by (``turn_id``, ``message_id``). Times are
epoch milliseconds passed in by the caller, as everywhere in the store.

Lifecycle as the store sees it: ``open`` (the domain shows it as ``active`` or ``idle``), then ``ending``
once an end has claimed it (:meth:`TranscriptStore.claim_end`), then ``ended`` when its end processing is
done (:meth:`TranscriptStore.finish_end`). A conversation is created by its first append or by a start.

What outlives what: the transcript (messages, checkpoint, summary) lives until ``expires_at`` (the last
activity plus ``transcript_retention``), then the conversation's *header* alone lives on until
``forget_at``, so that a read can say "expired" (410) instead of "never existed" (404). An erasure of the
caller or an admin deletion leaves a marker header (``status`` ``erased`` or ``deleted``) with nothing about
the caller, until ``forget_at``.
"""

from __future__ import annotations

import base64
import builtins
import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..limits import CONVERSATION_ID_RE

if TYPE_CHECKING:
    from ..fields import StoredField
    from .refs import CallerRef


@dataclass(frozen=True, slots=True)
class ConversationKey:
    """One conversation of one project (conversation ids are unique per project)."""

    project: str
    conversation_id: str


class TranscriptStatus(enum.Enum):
    OPEN = "open"  # active or idle: appends are taken
    ENDING = "ending"  # an end claimed it; its end processing is under way (or crashed: see claim_end)
    ENDED = "ended"  # end processing done
    ERASED = "erased"  # its caller was erased: a marker that keeps nothing else
    DELETED = "deleted"  # an admin deleted the transcript: a marker that keeps nothing else


@dataclass(slots=True)
class NewMessage:
    """One message to append: its encoded body (validated and redacted JSON) and what the store checks.

    Treated as immutable; not declared frozen because a frozen dataclass is built in 3.7 times the time
    (516 ns against 140), and every append builds one per message."""

    turn_id: int
    body: bytes
    message_id: str | None = None
    #: Its token count (the client's or an estimate), added to the header's total.
    tokens: int = 0


class StoredMessage(NamedTuple):
    """One stored message as a read returns it. A named tuple: immutable like the other records, and built
    in a fifth of a frozen dataclass's time (reads build one per message: 50 to 2,000 per request)."""

    #: Position in the transcript: 0, 1, 2, ... in append order.
    seq: int
    turn_id: int
    body: bytes
    message_id: str | None = None


@dataclass(frozen=True, slots=True)
class Header:
    """A conversation as the store keeps it, without its messages. Markers (ERASED, DELETED) and headers
    of expired transcripts carry only ``status``, ``expires_at`` and ``forget_at`` meaningfully (the rest
    is zero or empty)."""

    key: ConversationKey
    status: TranscriptStatus
    #: The caller's pseudonym ("" in a marker).
    subject: str
    channel: str
    #: The agent named at the start ("" if none).
    agent: str
    started_at: int
    last_activity: int
    #: The highest turn id appended, -1 before the first message.
    turn_id: int
    messages: int
    #: Sum of the encoded sizes of the messages, and of their token counts.
    bytes: int
    tokens: int
    #: The latest state checkpoint (a JSON object, encoded), and when it was made.
    checkpoint: builtins.bytes | None
    checkpoint_at: int
    #: The summary as the domain encoded it, or None.
    summary: builtins.bytes | None
    #: How it ended (``explicit``, ``inactivity``, ``superseded``), once claimed; "" before.
    ended_by: str
    #: The ``end_reason`` of the end, "" when none was given.
    end_reason: str
    #: When the end was claimed (0 before).
    ended_at: int
    #: Until when the transcript (messages, checkpoint, summary) lives.
    expires_at: int
    #: Until when this header is remembered at all.
    forget_at: int
    #: Until when the claim of an ENDING conversation holds (a crashed end may be taken over after it).
    lease_until: int = 0
    #: Extra data the domain keeps with the end (encoded JSON: outcome, ...), "" before.
    end_data: builtins.bytes = b""
    #: The region of the caller's number when the conversation was created (ISO 3166 code such as "GB";
    #: "" when unknown, not a phone number, or written by a release that did not keep it). Never the number.
    region: str = ""

    def expired(self, now_ms: int) -> bool:
        return self.expires_at <= now_ms

    @property
    def resumable(self) -> bool:
        """Whether a callback may resume it (SPEC sections 10 and 14): it ended by the service (``inactivity``,
        ``superseded``) or its end said the call dropped. The stores keep the newest resumable conversations
        of each caller and channel by this rule (:meth:`TranscriptStore.channel_conversations`)."""
        return self.ended_by in ("inactivity", "superseded") or self.end_reason == "dropped"


@dataclass(slots=True)
class AppendWrite:
    """A batch of messages (possibly empty) and/or a state checkpoint for one conversation.

    Treated as immutable; not declared frozen, which makes building it (once per append, 14 fields) take
    1.7 us instead of 0.6."""

    key: ConversationKey
    #: The caller, their channel and agent: used only when this append creates the conversation (``create``).
    caller: CallerRef
    channel: str
    agent: str
    #: Whether this append may create the conversation (the client named caller and channel).
    create: bool
    messages: Sequence[NewMessage]
    #: A new state checkpoint (a JSON object, encoded) to keep instead of the current one, or None.
    checkpoint: bytes | None
    #: When the append was made (the client's first attempt): a caller erased at or after it is not
    #: brought back, and a checkpoint older than the kept one does not replace it.
    made_at: int
    #: The transcript's expiry and the header's, recomputed from this activity.
    expires_at: int
    forget_at: int
    #: When the conversation becomes due for an inactivity end, from this activity.
    due_at: int
    #: Limits of one conversation, checked atomically with the append: nothing is written when one would be
    #: passed. (The project's bound is the domain's, on :meth:`TranscriptStore.transcript_bytes`.)
    max_messages: int
    max_bytes: int
    #: The region of the caller's number (``Header.region``), kept only when this append creates the
    #: conversation.
    region: str = ""


class AppendStatus(enum.Enum):
    APPENDED = "appended"  # written (or, for a message id already there with the same body, a no-op)
    NOT_FOUND = "not_found"  # no such conversation and ``create`` was false
    ENDED = "ended"  # the conversation is ENDING or ENDED: nothing written
    EXPIRED = "expired"  # its transcript expired: nothing written
    ERASED = "erased"  # its caller was erased after the append was made, or the transcript was deleted
    ID_CONFLICT = "id_conflict"  # a message id already there with another body: nothing written
    TURN_ORDER = "turn_order"  # a turn id lower than the conversation's current one: nothing written
    TOO_MANY_MESSAGES = "too_many_messages"  # max_messages would be passed: nothing written
    TOO_MANY_BYTES = "too_many_bytes"  # max_bytes would be passed: nothing written
    OTHER_CALLER = "other_caller"  # the conversation exists for another caller: nothing written


@dataclass(frozen=True, slots=True)
class AppendResult:
    status: AppendStatus
    #: The header after the append (before, when nothing was written); None when there is none.
    header: Header | None
    #: How many of the messages were new (the others were already there with the same id and body).
    added: int = 0
    #: For ID_CONFLICT: the message id; for TURN_ORDER: the offending turn id (as text).
    detail: str = ""
    #: True only when this append created the conversation and the backend knows the caller has no other
    #: conversation listed (so no start has anything to supersede); False says nothing (a backend may always
    #: answer False: the domain then looks).
    alone: bool = False


@dataclass(frozen=True, slots=True)
class TranscriptQuery:
    """Which messages a read returns, in order: those with a turn id above ``after_turn`` (all when None),
    or, with ``last``, only the last ``last`` of them; at most ``limit`` (the first ``limit`` of those)."""

    after_turn: int | None = None
    last: int | None = None
    limit: int | None = None


#: How many resumable ended conversations a store keeps at hand per caller and channel (and per caller across
#: channels) for :meth:`TranscriptStore.channel_conversations`: resume offers the latest one, so a few leave
#: room for some of them being deleted or erased meanwhile.
RESUMABLE_KEPT = 8


class PagePosition(NamedTuple):
    """Where a page of a caller's conversations ends: the last conversation's start and id."""

    started_at: int
    conversation_id: str

    def token(self) -> str:
        """The position as an opaque cursor (URL-safe); :meth:`parse` reads it back."""
        raw = f"{self.started_at}.{self.conversation_id}".encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def parse(cls, token: str) -> PagePosition | None:
        """The position a :meth:`token` holds; None for anything else."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("ascii")
        except ValueError:  # binascii.Error and UnicodeDecodeError alike
            return None
        started, dot, conversation_id = raw.partition(".")
        if (
            not dot
            or not started.isdigit()
            or len(started) > 16
            or not CONVERSATION_ID_RE.match(conversation_id)
        ):
            return None
        return cls(int(started), conversation_id)


@dataclass(frozen=True, slots=True)
class CallerPage:
    """A page of a caller's conversations (:meth:`TranscriptStore.caller_conversations_page`)."""

    headers: list[Header]
    #: Where the next page starts (pass it as ``after``); None when no conversation follows.
    next: PagePosition | None


@dataclass(frozen=True, slots=True)
class EndClaim:
    """An end taking a conversation from OPEN to ENDING (:meth:`TranscriptStore.claim_end`)."""

    key: ConversationKey
    #: ``explicit``, ``inactivity`` or ``superseded``.
    ended_by: str
    end_reason: str
    #: For ``inactivity``: claim only if the last activity is at or before this (the project's current
    #: ``end_after_inactivity`` ago). None: whatever the last activity.
    idle_since: int | None
    #: How long the claim holds before another end may take over a crashed one.
    lease_until: int
    end_data: bytes = b""


class ClaimStatus(enum.Enum):
    CLAIMED = "claimed"  # this end claimed it (OPEN -> ENDING), or took over an ENDING one whose lease lapsed
    NOT_DUE = "not_due"  # inactivity only: there was activity after ``idle_since`` (header: the current one)
    ALREADY = "already"  # it was ENDING (lease held) or ENDED already; header says how
    MISSING = "missing"  # no such conversation, or only a marker, or an expired transcript (and the claim
    # takes it out of the due index, so that it is not due again)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    status: ClaimStatus
    header: Header | None


class TranscriptStore(ABC):
    """Conversation memory (SPEC section 10). Each method is atomic with respect to every other on the same
    conversation; a conversation's data (header, messages, message ids, checkpoint, summary) is kept
    together (one Redis Cluster slot)."""

    @abstractmethod
    async def append_messages(self, write: AppendWrite, now_ms: int) -> AppendResult:
        """Append ``write.messages`` in order, whole or not at all, and keep ``write.checkpoint``.

        Creates the conversation when it does not exist and ``write.create`` is true (OPEN, started and last
        active at ``now_ms``, with ``write.region``, listed among the caller's conversations so that an
        erasure finds it, and among those of its channel, :meth:`channel_conversations`), unless
        the caller was erased at or after ``write.made_at`` (ERASED; this holds for an append to an existing
        conversation too). ``write.caller`` is looked at only with ``write.create``. Refuses, writing
        nothing and in this order: a marker header (ERASED), a conversation of another caller when ``write.create`` is true
        (OTHER_CALLER), an expired transcript (EXPIRED), a conversation that is not OPEN (ENDED), a message
        id already there with another body (ID_CONFLICT), a turn id lower than the previous message's
        (TURN_ORDER), and a limit that would be passed (TOO_MANY_MESSAGES, TOO_MANY_BYTES).

        A message whose id is already there with the same body is skipped (not counted in ``added``) before
        turn order and limits are checked, so a retry of earlier turns is a no-op; on an
        existing conversation, a batch that adds nothing and keeps no checkpoint changes nothing, not even
        the last activity (an empty batch with ``create`` creates the conversation: that is a start).
        Otherwise the last activity becomes ``now_ms``, the expiries and the inactivity due time are those
        of ``write``, and the checkpoint replaces the kept one unless that one was made after
        ``write.made_at``."""

    @abstractmethod
    async def read_conversation(
        self, key: ConversationKey, now_ms: int, query: TranscriptQuery | None = None
    ) -> tuple[Header | None, list[StoredMessage]]:
        """The header (None if the conversation was never stored or is forgotten) and, with ``query`` and a
        transcript that has not expired, its messages (:class:`TranscriptQuery`). One round trip."""

    @abstractmethod
    async def read_context(
        self, key: ConversationKey, subject: str | None, now_ms: int, query: TranscriptQuery | None = None
    ) -> tuple[Header | None, list[StoredMessage], dict[str, StoredField] | None]:
        """:meth:`read_conversation` and, with ``subject`` (the caller the domain believes the conversation
        is of), that caller's live memory fields (as ``Store.read_fields`` returns them), read together
        where the backend can (one round trip on one Redis server, two concurrent calls on a cluster, one
        read on SQLite). The fields are returned only when the header's ``subject`` is ``subject``; they
        are None when no subject was given, the hint was wrong, there is no header or it is a marker:
        one caller's memory is never returned with another's conversation (the domain reads the right
        caller's fields itself then). The fields may be of a moment a little apart from the transcript's
        (the two are not read atomically on a cluster)."""

    @abstractmethod
    async def put_summary(self, key: ConversationKey, summary: bytes, now_ms: int) -> Header | None:
        """Replace the summary of a conversation whose transcript has not expired (any status but a marker);
        returns the header after it, or None when there is no such transcript (or only a marker). A summary
        is not activity: the last activity and expiries stay."""

    @abstractmethod
    async def claim_end(self, claim: EndClaim, now_ms: int) -> ClaimResult:
        """Take the conversation from OPEN to ENDING for one end (see :class:`ClaimStatus`), recording
        ``ended_by``, ``end_reason``, ``end_data``, ``lease_until`` and ``ended_at = now_ms``. An ENDING
        conversation whose lease ended at or before ``now_ms`` (its end crashed) is claimed again by any end,
        which replaces ``ended_by``, ``end_reason``, ``end_data`` and the lease (``ended_at`` stays the first
        claim's). The header returned is the one after the claim (for ALREADY and NOT_DUE, the current one).
        While ENDING, the conversation is due again at ``lease_until`` (see :meth:`due_conversations`); ENDED,
        it leaves the due index."""

    @abstractmethod
    async def finish_end(self, key: ConversationKey, now_ms: int) -> Header | None:
        """Mark an ENDING conversation ENDED (its end processing is done) and take it out of the due index;
        idempotent (an ENDED one stays as it is). Returns the header after it; None if there is none or
        only a marker."""

    @abstractmethod
    async def due_conversations(self, now_ms: int, limit: int) -> list[ConversationKey]:
        """Up to ``limit`` conversations whose inactivity due time is at or before ``now_ms`` (or whose end
        claim lapsed), most overdue first. Costs in proportion to what it returns. A conversation stays due
        until it is claimed (:meth:`claim_end`) or rescheduled (:meth:`reschedule`); one that can never be
        claimed (expired, a marker, forgotten, erased) may be dropped from the index on the way."""

    @abstractmethod
    async def reschedule(self, key: ConversationKey, due_at: int) -> None:
        """Set the inactivity due time of a conversation that is OPEN or ENDING (nothing otherwise)."""

    @abstractmethod
    async def caller_conversations(self, caller: CallerRef, now_ms: int) -> list[Header]:
        """The headers of the caller's conversations not yet forgotten (markers excluded), newest start
        first (then conversation id, descending): all of them, which costs in proportion to their number (an
        erasure names them all); a listing pages with :meth:`caller_conversations_page`."""

    @abstractmethod
    async def caller_conversations_page(
        self, caller: CallerRef, now_ms: int, limit: int, after: PagePosition | None = None
    ) -> CallerPage:
        """One page of :meth:`caller_conversations`, in the same order (newest start first, then conversation
        id, descending): those after ``after`` (from the first when None), at most ``limit``. A page may
        hold fewer than ``limit`` even when more follow (an index entry of a conversation deleted or forgotten
        meanwhile is skipped); ``next`` is None only when none follows. Every conversation that lives from the
        first page to the last is on exactly one page. Costs in proportion to ``limit``, not to the caller's
        number of conversations (a caller listed by an earlier release is indexed once, at its first page
        or start)."""

    @abstractmethod
    async def channel_conversations(
        self, caller: CallerRef, channel: str | None, now_ms: int, resumable_since: int | None = None
    ) -> list[Header]:
        """What a start of a conversation of ``caller`` on ``channel`` (any channel when None) looks at, in a
        cost that does not grow with the caller's number of conversations: the headers of every conversation
        there still OPEN or ENDING, and, with ``resumable_since``, of the newest ENDED ones there that are
        :attr:`Header.resumable` with a last activity at or after it (at least the newest
        :data:`RESUMABLE_KEPT` of them that have not been deleted or erased). Markers, expired transcripts
        and other callers' conversations are left out; the order is unspecified.

        Kept by the store on every transition: a creating append lists it, :meth:`finish_end` moves it from
        the open ones to the resumable ones (or drops it), a deletion or an erasure removes it; an index entry
        left behind (a crash between a conversation's write and its caller's index, an expiry, a conversation
        forgotten) is checked against the header, left out, and corrected on the way."""

    @abstractmethod
    async def delete_conversation(self, key: ConversationKey, now_ms: int) -> Header | None:
        """Delete the transcript (messages, checkpoint, summary) and leave a DELETED marker until the header's
        ``forget_at``; returns the header as it was (None, changing nothing, when there was none or only a
        marker). The conversation leaves its caller's list and the due index."""

    @abstractmethod
    async def transcript_bytes(self, project: str, now_ms: int, since: int) -> int:
        """The bytes of messages the project appended at or after ``since`` (the domain passes now minus
        ``transcript_retention``: an upper bound of its live transcripts), less those of transcripts deleted
        or erased since. Every append that adds messages counts their encoded bytes (hour buckets are fine:
        a bucket that starts before ``since`` but ends after it may be counted whole)."""
