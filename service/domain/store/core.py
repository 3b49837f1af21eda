"""The core of the Store interface: projects, tokens, caller memory, ends, analytics, sweeps, erasure and
the audit log, with their records. The conventions every backend follows are in the package's docstring."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..fields import StoredField, WriteCondition
from .refs import CallerRef
from .webhooks import Delivery


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A project token as stored: the secret itself is never kept, only its SHA-256."""

    token_id: str
    project: str
    role: str
    secret_hash: bytes
    created_at: int
    label: str = ""
    #: For an agent token of a project with ``transcript_scope: "agent"``: the agent it acts as ("" none).
    agent: str = ""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a conversation ended, as the client reports it (each part optional)."""

    qa: str | None = None
    handoff_reason: str | None = None
    handoff_to: str | None = None


#: Bucket kinds of analytics counters.
BUCKET_KINDS = ("hour", "day", "week")


@dataclass(frozen=True, slots=True)
class AnalyticsInput:
    """What the end of a conversation gives analytics: no caller data, times already hour-rounded.

    ``first_expires_at`` is when a first-interaction record created now expires (exact: now + retention).
    ``first_after`` applies the project's *current* retention to a stored first interaction: one created at
    or before it (now - retention) is past retention, whatever retention it was created under.
    """

    hour: int
    day: int
    week: int
    outcome: Outcome
    first_expires_at: int
    first_after: int = 0


@dataclass(frozen=True, slots=True)
class EndWrite:
    """The end of a conversation, as :meth:`Store.end_conversation` applies it."""

    caller: CallerRef
    conversation_id: str
    #: Identifies the request body (a hash: no caller data): a retry with another body is a conflict.
    fingerprint: str
    #: Until when the conversation id is remembered (its record: replays, conflicts, erasure markers).
    expires_at: int
    #: When the write was made: an erasure at or after it wins.
    made_at: int
    sets: Mapping[str, StoredField] = field(default_factory=dict)
    deletes: Sequence[str] = ()
    #: Given when the project has analytics on: the end then looks up the caller's first interaction.
    analytics: AnalyticsInput | None = None
    #: The write time of ``sets`` and ``deletes``: a field of the caller written after it is left as it is
    #: (an older state checkpoint never overwrites a later write). None: ``now_ms``.
    written_at: int | None = None


@dataclass(frozen=True, slots=True)
class ListingPage:
    """One page of a project's analytics listing: the conversations whose sort key is in ``[start, stop)``,
    in sort-key order (or reverse)."""

    start: str
    stop: str
    #: Only repeat (True) or first (False) conversations; None: both.
    repeat: bool | None = None
    #: The sort key of the last entry of the previous page (exclusive, in the direction of travel).
    after: str | None = None
    limit: int = 100
    descending: bool = False
    #: Leave out entries recorded at or before this time (the current retention's cutoff); an entry without
    #: its recording time counts as recorded at its hour.
    recorded_after: int | None = None


@dataclass(frozen=True, slots=True)
class FirstInteraction:
    conversation_id: str
    hour: int
    qa: str | None
    handoff_reason: str | None
    handoff_to: str | None


@dataclass(frozen=True, slots=True)
class EndAnalytics:
    """What the end of a conversation found out for analytics, when it was first applied (a replay gets the
    same, whatever it sends)."""

    #: The conversation's hour.
    hour: int
    #: The caller's first interaction inside the retention window: None when this conversation is it.
    first: FirstInteraction | None
    #: The bucket kinds (of :data:`BUCKET_KINDS`, in that order) that see this caller for the first time.
    new_buckets: tuple[str, ...]


class EndStatus(enum.Enum):
    APPLIED = "applied"  # first time: the fields were written and the record stored
    REPLAYED = "replayed"  # the same conversation with the same body: nothing written
    CONFLICT = "conflict"  # the same conversation id with another body: nothing written
    ERASED = "erased"  # the caller was erased after this write was made: nothing written


@dataclass(frozen=True, slots=True)
class EndResult:
    """What :meth:`Store.end_conversation` did."""

    status: EndStatus
    #: APPLIED or REPLAYED with analytics on when the conversation was first applied: what to record (with
    #: :meth:`Store.record_conversation`). None otherwise: nothing is to be recorded.
    analytics: EndAnalytics | None = None


@dataclass(frozen=True, slots=True)
class ConversationEntry:
    """One ended conversation as analytics lists it (no caller data; times hour-rounded)."""

    conversation_id: str
    hour: int
    channel: str | None
    qa: str | None
    handoff_reason: str | None
    handoff_to: str | None
    #: The caller's first interaction inside the retention window, when this is a repeat call.
    first: FirstInteraction | None
    #: How it ended: ``explicit`` (the end call), ``inactivity`` or ``superseded`` (by the service).
    ended_by: str = "explicit"
    #: The end's ``end_reason`` (``completed``, ``dropped``, ``transferred``), or None.
    end_reason: str | None = None
    #: The call's caller-ID attestation as normalised (``A``, ``B``, ``C``, ``failed``, ``unknown``); None
    #: when the end carried no call (a service's end, an admin's).
    attestation: str | None = None

    @property
    def sort_key(self) -> str:
        """Listing order: by hour, then by conversation id (stable, the same on every backend)."""
        return f"{self.hour:013d}:{self.conversation_id}"


@dataclass(frozen=True, slots=True)
class Counters:
    """Aggregates of one time bucket: ``kind`` (hour, day, week), its start, and name -> count."""

    kind: str
    bucket: int
    values: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Recording:
    """An ended conversation to add to its project's analytics (:meth:`Store.record_conversation`)."""

    #: Whose conversation it was: if they were erased at or after ``made_at``, it is not listed.
    caller: CallerRef
    entry: ConversationEntry
    increments: Sequence[Counters]
    #: When what is written expires (a bucket lives as long as its latest conversation).
    expires_at: int
    #: When the end of the conversation was made (:attr:`EndWrite.made_at`).
    made_at: int


class RecordStatus(enum.Enum):
    RECORDED = "recorded"  # listed and counted
    DUPLICATE = "duplicate"  # the conversation id was recorded already: nothing changed
    ERASED = (
        "erased"  # the caller was erased at or after the end was made: not listed (counters may count it)
    )


@dataclass(frozen=True, slots=True)
class ErasureResult:
    """What :meth:`Store.erase_caller` removed."""

    fields: int
    first_interaction: bool
    #: Ended-conversation records that linked a conversation id to the caller.
    conversations: int
    #: Analytics listing entries of the caller's conversations.
    listed: int
    #: Transcripts (with their checkpoints and summaries) of the caller's conversations.
    transcripts: int = 0
    #: Links removed: the profile's list of links (its aliases' own records are erased with them, by the
    #: domain), and the caller's own alias record if it was one.
    links: int = 0
    #: The profile the caller was a live alias of ("" if none): the domain erases it next.
    alias_of: str = ""
    #: The subjects of the live links the profile's list held: the domain erases each next.
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One audit record: who did what, when, with which receipt. Never a phone number or a stored value."""

    at: int
    actor: str
    action: str
    details: Mapping[str, Any]
    receipt_id: str | None = None
    id: str = ""  # assigned by the store, increasing


@dataclass(frozen=True, slots=True)
class PatchResult:
    """Outcome of :meth:`Store.patch_fields`.

    ``applied`` is False when the write condition did not hold; nothing was changed then, and ``fields``
    is the memory as it is.
    """

    applied: bool
    fields: dict[str, StoredField]


class CoreStore(ABC):
    """Persistent storage for projects, tokens, caller memory, analytics, retention and the audit log; the
    other capabilities are in their own modules of this package, and :class:`~caller_memory.service.domain.store.Store`
    inherits them all."""

    @abstractmethod
    async def open(self) -> None:
        """Connect, create or migrate the schema, and check the store is usable.

        Raises ``StoreCorrupt`` if existing data cannot be read, ``StoreUnavailable`` if unreachable.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release connections. Safe to call twice."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` unless the store answers now (used by ``/readyz``)."""

    def read_cache_counts(self) -> tuple[int, int] | None:
        """Memory reads the store's read cache answered and those that went to the store while it was on,
        since the store was opened (``/metrics``); None for a store without a read cache."""
        return None

    # Projects -----------------------------------------------------------------------------------------

    @abstractmethod
    async def put_project(self, project: str, document: bytes, now_ms: int) -> bool:
        """Create or replace a project's configuration document. Returns True if it was created."""

    @abstractmethod
    async def get_project(self, project: str) -> bytes | None:
        """The stored configuration document, or None if there is no such project."""

    # Tokens -------------------------------------------------------------------------------------------

    @abstractmethod
    async def put_token(self, token: TokenRecord) -> None:
        """Store a new token. Token ids are random and never reused."""

    @abstractmethod
    async def get_token(self, token_id: str) -> TokenRecord | None:
        """Look a token up by id, whatever its project."""

    @abstractmethod
    async def list_tokens(self, project: str) -> list[TokenRecord]:
        """The project's tokens, oldest first."""

    @abstractmethod
    async def delete_token(self, project: str, token_id: str) -> bool:
        """Revoke a token of ``project``. Returns False if it did not exist there."""

    # Caller memory ------------------------------------------------------------------------------------

    @abstractmethod
    async def read_fields(self, caller: CallerRef, now_ms: int) -> dict[str, StoredField]:
        """Every field of the caller whose stored expiry is after ``now_ms``. If ``caller.subject`` is a live
        alias (:mod:`caller_memory.service.domain.store.links`), the fields of its profile instead: one hop, in one round trip when the
        subject is not an alias."""

    @abstractmethod
    async def patch_fields(
        self,
        caller: CallerRef,
        sets: Mapping[str, StoredField],
        deletes: Sequence[str],
        now_ms: int,
        condition: WriteCondition | None = None,
    ) -> PatchResult:
        """Atomically delete ``deletes`` and then set ``sets``, and return the caller's not-expired fields.

        A name in both is set. Every field in ``sets`` expires after ``now_ms`` (the domain guarantees it).
        If ``condition`` is given, it is evaluated against the caller's live fields under
        ``condition.ttl_ms`` (which must list every state key: a field without an entry is not live) before
        anything else, and nothing is written unless it holds. Dead fields of the caller are removed on the
        way. The caller's data as a whole is kept no longer than its latest field expiry.

        The returned fields are filtered by stored expiry only; the domain applies the current TTLs.

        Raises :class:`~caller_memory.service.domain.store.links.ProfileMoved` (nothing written) if ``caller.subject`` is a live alias.
        """

    @abstractmethod
    async def erase_caller(self, caller: CallerRef, now_ms: int, tombstone_until: int) -> ErasureResult:
        """Remove everything stored about the caller: memory, first-interaction record, the records that link
        conversation ids to the caller, and the analytics listing entries of those conversations (counters,
        which are anonymous, stay). Leaves a tombstone (erased at ``now_ms``, kept until
        ``tombstone_until``) so that a write made before the erasure and arriving after it is dropped, and a
        conversation recorded after the erasure is not listed (:meth:`record_conversation`).

        Each conversation record still live is replaced by an erasure marker that keeps nothing about the
        caller and expires when the record would have: until then every end of that conversation id, for
        whichever caller and whenever made, is ERASED (a retry of a conversation whose effects the erasure
        removed must not re-apply them). ``conversations`` counts the records unlinked.

        The caller's own alias record (if it is an alias) and its list of links (if it is a profile) are
        removed too, and counted in ``links``; the profile that alias record named and the aliases that list
        named (both live ones only) are returned (``alias_of``, ``aliases``): the domain erases them next."""

    @abstractmethod
    async def end_conversation(self, end: EndWrite, now_ms: int) -> EndResult:
        """Apply the end of a conversation exactly once: the first step of ending it (the second, with
        analytics, is :meth:`record_conversation`).

        If the caller was erased at or after ``end.made_at`` (a live tombstone), or an erasure left a live
        marker for this conversation id (see :meth:`erase_caller`), nothing is written and the status is
        ERASED.

        If a live record (expiring after ``now_ms``) exists for ``(project, conversation_id)``: when it was
        stored for the same caller with the same fingerprint, nothing is written and the status is REPLAYED,
        with the analytics found when it was first applied; otherwise nothing is written (CONFLICT). Without
        one, ``end.sets`` and ``end.deletes`` are applied as by :meth:`patch_fields` (no condition) and the
        record is stored (expiring at ``end.expires_at``), both atomically with respect to the caller's
        memory (APPLIED). A set or delete of a field whose stored ``written_at`` is after the end's write
        time (``end.written_at``, else ``now_ms``) is skipped: the later write wins.

        With ``end.analytics``, the same atomic step looks up the caller's first-interaction record: a live
        one (expiring after ``now_ms``, created after ``analytics.first_after``; a record without its
        creation time counts as created at its hour) makes this a repeat call; otherwise a new one is
        created from this conversation (hour-rounded, created at ``now_ms``, expiring at
        ``analytics.first_expires_at``). It also notes which of the hour, day and week buckets see this
        caller for the first time. :attr:`EndResult.analytics` says what it found (APPLIED and REPLAYED
        alike); it is None when analytics were off when the conversation was first applied.

        If ``end.caller.subject`` is a live alias (:mod:`caller_memory.service.domain.store.links`), raises
        :class:`~caller_memory.service.domain.store.links.ProfileMoved` and writes nothing (no claim of the id is left behind either) --
        except for a replay: an end first applied while the subject was not yet an alias is REPLAYED as above.
        """

    # Analytics ----------------------------------------------------------------------------------------

    @abstractmethod
    async def record_conversation(
        self, recording: Recording, now_ms: int, deliveries: Sequence[Delivery] = ()
    ) -> RecordStatus:
        """Add an ended conversation to its project's analytics, once per conversation id, recorded at
        ``now_ms``; and queue ``deliveries``, the webhook events of its end (about ``recording.caller``), as
        :meth:`~.webhooks.WebhookStore.enqueue_deliveries` does with that caller and
        ``recording.made_at``, durable once this returns. Both in one call because every end makes them
        together: on one Redis server they go in one round trip, in SQLite in one transaction (a failure
        may leave either done: each is idempotent, and the end's retry redoes both).

        Lists the entry and adds each of the increments to the counters of its bucket; DUPLICATE, changing
        nothing, if the conversation id was already recorded. What is written expires at
        ``recording.expires_at``. The recording time is kept with the entry, and the latest of a bucket's
        with the bucket, so that reads and sweeps can apply a retention shorter than the one ``expires_at``
        was computed with.

        A conversation whose caller was erased at or after ``recording.made_at`` (a live tombstone) is not
        listed, whatever ran first (ERASED; its anonymous counters may count it): an erasure that ran
        between :meth:`end_conversation` and this call could not see the listing yet, so the store takes it
        back here, atomically or in an order that leaves no window.
        """

    @abstractmethod
    async def list_conversations(
        self, project: str, page: ListingPage, now_ms: int
    ) -> list[ConversationEntry]:
        """The recorded conversations of ``page`` (see :class:`ListingPage`), at most ``page.limit``; expired
        entries are never returned."""

    @abstractmethod
    async def counters(
        self,
        project: str,
        kind: str,
        first: int,
        last: int,
        now_ms: int,
        *,
        recorded_after: int | None = None,
    ) -> list[Counters]:
        """The non-empty, unexpired counter buckets of ``kind`` (hour, day, week) from ``first`` to ``last``
        (bucket start times, inclusive), in time order; with ``recorded_after``, only buckets whose latest
        conversation was recorded after it (a bucket without that time is judged by its expiry alone)."""

    # Retention ----------------------------------------------------------------------------------------

    @abstractmethod
    async def sweep(
        self, now_ms: int, batch: int, listed_after: Mapping[str, int] | None = None
    ) -> tuple[dict[str, int], bool]:
        """Remove up to about ``batch`` expired items of each kind; safe to repeat and to interrupt.

        ``listed_after`` maps projects to their current retention's cutoff (now - retention): the analytics
        listing entries of such a project recorded at or before it are removed too (reported with the
        expired ones, as ``analytics_entries``).

        Returns counts by kind (``fields``, ``callers`` emptied, and whatever else the backend removes
        itself rather than leaving to the store's own expiry) and whether more expired items remain. Costs
        in proportion to what expired, not to what is stored.
        """

    async def list_projects(self) -> list[str]:
        """Every project id (sweeps read their configurations). The default knows none."""
        return []

    @abstractmethod
    async def acquire_lease(self, name: str, holder: str, now_ms: int, ttl_ms: int) -> bool:
        """Take (or renew, for the same holder) the named lease until ``now_ms + ttl_ms``. False if another
        holder has it."""

    @abstractmethod
    async def release_lease(self, name: str, holder: str) -> None:
        """Give the lease back if ``holder`` has it."""

    @abstractmethod
    async def record_sweep(self, record: bytes) -> None:
        """Keep a sweep report (JSON); only the latest 100 are kept."""

    @abstractmethod
    async def list_sweeps(self, limit: int) -> list[bytes]:
        """The latest sweep reports, newest first."""

    @abstractmethod
    async def append_audit(self, project: str, entry: AuditEntry) -> str:
        """Append an audit record; returns its id (ids increase)."""

    @abstractmethod
    async def list_audit(self, project: str, limit: int, before: str | None) -> list[AuditEntry]:
        """The project's audit records, newest first, older than the id ``before`` if given."""
