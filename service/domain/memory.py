"""Caller memory use cases: read, patch, delete a field, erase.

Everything that reaches the store has been validated here first, so that bad input changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from .audit import AuditLog
from .clock import Clock, ceil_hour_ms, floor_hour_ms
from .errors import InvalidInput, PreconditionFailed
from .fields import StoredField, WriteCondition, compute_etag
from .identifiers import Pseudonymizer, kind_of, legacy_spelling, parse_identifier
from .limits import FIELD_NAME_RE, MAX_VALUE_BYTES, RECALL_WINDOW_MS
from .projects import Project
from .store import CallerRef, Store
from .store.links import ProfileMoved
from .trust import CallTrust, withheld_etag

EMPTY_ETAG = compute_etag({})


@dataclass(frozen=True, slots=True)
class MemoryView:
    """A caller's live memory as the API returns it. ``fields`` holds JSON-encoded values."""

    identifier: str
    fields: dict[str, bytes]
    expires_at: int | None  # hour-rounded up; None when the memory is empty
    etag: str
    #: The earliest expiry of a live field, rounded down to the hour (never later than any field's own):
    #: until then a client may serve this memory again, marked stale, after a failed read. None when empty.
    valid_until: int | None = None
    blacklisted: bool = False
    #: State keys the call did not qualify for (:mod:`.trust`): left out of ``fields``, in name order.
    withheld: tuple[str, ...] = ()
    #: The call's attestation as normalised (None: the read was not a call's).
    attestation: str | None = None


@dataclass(frozen=True, slots=True)
class ErasureReceipt:
    receipt_id: str
    project: str
    erased_at: int  # hour-rounded down
    fields_removed: int
    first_interaction_removed: bool
    conversations_unlinked: int
    analytics_entries_removed: int
    blacklisted: bool = False
    #: Transcripts (with their checkpoints and summaries) removed.
    transcripts_removed: int = 0
    #: Webhook deliveries about the caller (queued or failed) removed: none of them is sent.
    deliveries_removed: int = 0
    #: Archived conversations of the caller deleted from the archive.
    archives_removed: int = 0
    #: Links of the profile removed (each linked identifier's own data is erased and counted above).
    links_removed: int = 0

    def removed(self) -> dict[str, int | bool]:
        """What was removed, as the erasure's answer and its audit record name it."""
        return {
            "fields": self.fields_removed,
            "first_interaction": self.first_interaction_removed,
            "conversation_links": self.conversations_unlinked,
            "analytics_conversations": self.analytics_entries_removed,
            "transcripts": self.transcripts_removed,
            "webhook_deliveries": self.deliveries_removed,
            "archived_conversations": self.archives_removed,
            "links": self.links_removed,
        }


@dataclass(frozen=True, slots=True)
class ErasureCounts:
    """What an erasure listener deleted of one erased caller (each counted in the receipt)."""

    #: Webhook deliveries about the caller (queued or failed).
    deliveries_removed: int = 0
    #: Archived conversations of the caller.
    archives_removed: int = 0


class ErasureListener(Protocol):
    """Deletes what else the service keeps about an erased caller (webhook deliveries queued or failed,
    archived conversations), told once the erasure's tombstone is down, so that nothing new can be made for
    them after it; says how many of each it deleted."""

    async def erase_caller(self, caller: CallerRef) -> ErasureCounts: ...


class ErasedEventListener(Protocol):
    """The ``caller.erased`` event (the webhooks)."""

    async def wants_erased(self, project: Project) -> bool:
        """Whether the project has a receiver of ``caller.erased`` (its conversation ids are read only then)."""

    async def caller_erased(self, project: Project, receipt_id: str, conversation_ids: Sequence[str]) -> None:
        """Queue ``caller.erased`` (the receipt id and the erased conversations' ids)."""


@dataclass(frozen=True, slots=True)
class Caller:
    #: The identifier in canonical form (E.164, ``email:...`` or ``account:...``).
    identifier: str
    subject: str
    blacklisted: bool

    @property
    def e164(self) -> str:
        """The phone number, or "" when the caller is known by another kind of identifier."""
        return self.identifier if self.identifier.startswith("+") else ""

    @property
    def kind(self) -> str:
        return kind_of(self.identifier)


def check_field_name(name: str, *, where: str) -> None:
    if not FIELD_NAME_RE.match(name):
        raise InvalidInput(
            f"{where}: field names are a letter or '_' then letters, digits or '_', 64 characters at most",
            field=where,
        )


def encode_value(name: str, value: Any) -> bytes:
    try:
        encoded = orjson.dumps(value)
    except TypeError as exc:  # pragma: no cover - decoded JSON always re-encodes
        raise InvalidInput(f"{name}: value is not JSON", field=name) from exc
    if len(encoded) > MAX_VALUE_BYTES:
        raise InvalidInput(
            f"{name}: value is {len(encoded)} bytes of JSON; the limit is {MAX_VALUE_BYTES}", field=name
        )
    return encoded


class MemoryService:
    def __init__(
        self,
        store: Store,
        pseudonymizer: Pseudonymizer,
        clock: Clock,
        *,
        audit: AuditLog,
        erasure_listeners: Sequence[ErasureListener] = (),
        erased_event: ErasedEventListener | None = None,
    ) -> None:
        """``erasure_listeners``: each erased caller's other data (:class:`ErasureListener`), in turn;
        ``erased_event``: queues the ``caller.erased`` event of each erasure."""
        self._store = store
        self._pseudonymizer = pseudonymizer
        self._clock = clock
        self._audit = audit
        self._erasure_listeners = tuple(erasure_listeners)
        self._erased_event = erased_event

    def caller(self, project: Project, raw_identifier: str) -> Caller:
        identifier = parse_identifier(raw_identifier, project.default_region)
        subject = self._pseudonymizer.pseudonym(project.project_id, identifier)
        return Caller(identifier=identifier, subject=subject, blacklisted=subject in project.blacklist)

    def _view(
        self,
        project: Project,
        caller: Caller,
        stored: Mapping[str, StoredField],
        now: int,
        call: CallTrust | None = None,
    ) -> MemoryView:
        # One pass (this runs on every read): the live fields, in name order, the latest and earliest expiry.
        ttl_ms = project.ttl_ms
        withheld = project.trust.withheld(call)
        live: dict[str, StoredField] = {}
        expires = 0
        first = 0
        for name in sorted(stored):
            if withheld and name in withheld:
                continue
            f = stored[name]
            until = min(f.expires_at, f.written_at + ttl_ms.get(name, 0))  # fields.effective_expiry
            if now < until:
                live[name] = f
                expires = max(expires, until)
                first = until if not first else min(first, until)
        return MemoryView(
            identifier=caller.identifier,
            fields={name: f.value for name, f in live.items()},
            expires_at=ceil_hour_ms(expires) if live else None,
            etag=withheld_etag(compute_etag(live), withheld),
            valid_until=floor_hour_ms(first) if live else None,
            withheld=withheld,
            attestation=None if call is None else call.attestation,
        )

    def _empty(self, project: Project, caller: Caller, call: CallTrust | None = None) -> MemoryView:
        withheld = project.trust.withheld(call)
        return MemoryView(
            identifier=caller.identifier,
            fields={},
            expires_at=None,
            etag=withheld_etag(EMPTY_ETAG, withheld),
            blacklisted=True,
            withheld=withheld,
            attestation=None if call is None else call.attestation,
        )

    async def read(self, project: Project, raw_identifier: str, call: CallTrust | None = None) -> MemoryView:
        """The caller's live memory; with ``call`` (an agent's read), without what the call does not qualify
        for. Through a linked identifier, the profile's memory (the store follows the link)."""
        caller = self.caller(project, raw_identifier)
        if caller.blacklisted:
            return self._empty(project, caller, call)
        now = self._clock.now_ms()
        stored = await self._store.read_fields(CallerRef(project.project_id, caller.subject), now)
        return self._view(project, caller, stored, now, call)

    async def read_of(self, project: Project, subject: str, call: CallTrust | None = None) -> MemoryView:
        """The live memory of the caller whose pseudonym is ``subject`` (a conversation's caller, for a tool
        bound to the call), without what ``call`` does not qualify for; ``identifier`` is empty (never the
        number). Through a linked identifier, the profile's memory."""
        caller = Caller("", subject, subject in project.blacklist)
        if caller.blacklisted:
            return self._empty(project, caller, call)
        now = self._clock.now_ms()
        stored = await self._store.read_fields(CallerRef(project.project_id, subject), now)
        return self._view(project, caller, stored, now, call)

    def validate_patch(self, project: Project, patch: Any) -> tuple[dict[str, bytes], list[str]]:
        """Split a merge patch into encoded sets and deletes, refusing anything not allowed."""
        if not isinstance(patch, dict):
            raise InvalidInput("the body must be a JSON object of field names to values", field="body")
        allowed = project.ttl_ms
        sets: dict[str, bytes] = {}
        deletes: list[str] = []
        for name, value in patch.items():
            check_field_name(name, where=name)
            if name not in allowed:
                raise InvalidInput(
                    f"{name}: not in the project's state_keys, so it cannot be stored", field=name
                )
            if value is None:
                deletes.append(name)
            else:
                sets[name] = encode_value(name, value)
        return sets, deletes

    async def patch(
        self, project: Project, raw_identifier: str, patch: Any, if_match: str | None = None
    ) -> MemoryView:
        caller = self.caller(project, raw_identifier)
        sets, deletes = self.validate_patch(project, patch)
        if caller.blacklisted:
            return self._empty(project, caller)
        return await self._write(project, caller, sets, deletes, if_match)

    async def delete_field(
        self, project: Project, raw_identifier: str, name: str, if_match: str | None = None
    ) -> MemoryView:
        caller = self.caller(project, raw_identifier)
        check_field_name(name, where="field")
        if caller.blacklisted:
            return self._empty(project, caller)
        return await self._write(project, caller, {}, [name], if_match)

    async def _write(
        self,
        project: Project,
        caller: Caller,
        sets: Mapping[str, bytes],
        deletes: list[str],
        if_match: str | None,
    ) -> MemoryView:
        now = self._clock.now_ms()
        stored = {
            name: StoredField(value=value, expires_at=now + project.ttl_ms[name], written_at=now)
            for name, value in sets.items()
        }
        condition = WriteCondition.from_header(if_match, project.ttl_ms) if if_match is not None else None
        try:
            result = await self._store.patch_fields(
                CallerRef(project.project_id, caller.subject), stored, deletes, now, condition
            )
        except ProfileMoved as moved:  # a linked identifier: the write goes to its profile
            result = await self._store.patch_fields(
                CallerRef(project.project_id, moved.profile), stored, deletes, now, condition
            )
        view = self._view(project, caller, result.fields, now)
        if not result.applied:
            assert condition is not None  # only a condition refuses a write
            raise PreconditionFailed(
                view.etag,
                wildcard=condition.any_existing,
                weak_only=bool(condition.etags) and all(tag.startswith("W/") for tag in condition.etags),
            )
        return view

    async def erase(self, project: Project, raw_identifier: str, *, actor: str) -> ErasureReceipt:
        """Erase everything about a caller (audited as done by ``actor``, with the receipt's id): through any of their identifiers, the whole profile, every link
        and every linked identifier's own data. A tombstone blocks, for the idempotency window, any
        end-of-call write made before the erasure that arrives after it (an in-flight request, an SDK outbox
        entry).

        The identifier named goes first (its tombstone as early as possible: the sooner it is down, the less
        an in-flight end races it); its erasure says which profile it was linked to, and a profile's which
        identifiers were linked to it, and those are erased next (an identifier unlinked in the meantime is
        somebody's own again, and left alone)."""
        caller = self.caller(project, raw_identifier)
        now = self._clock.now_ms()
        first = CallerRef(project.project_id, caller.subject)
        conversation_ids: list[str] = []
        # The caller.erased event names the erased conversations: read them first, only when it will be sent
        # (the erasure's tombstone then goes down one read later: the sooner it does, the less it races).
        wanted = self._erased_event is not None and await self._erased_event.wants_erased(project)
        totals: dict[str, int] = {}
        todo: list[tuple[CallerRef, str]] = [(first, "")]  # (whom, the profile it must still be linked to)
        legacy = legacy_spelling(raw_identifier)
        legacy_subject = (
            self._pseudonymizer.pseudonym(project.project_id, legacy) if legacy is not None else None
        )
        if legacy_subject is not None:  # what an earlier release stored under this spelling is theirs too
            todo.append((CallerRef(project.project_id, legacy_subject), ""))
        done: set[str] = set()
        erased = 0
        while todo:
            ref, profile = todo.pop(0)
            if ref.subject in done:
                continue
            done.add(ref.subject)
            if profile and await self._store.resolve_profile(ref, now) != profile:
                continue  # unlinked meanwhile: not this profile's any more
            if wanted:
                conversation_ids += [
                    h.key.conversation_id for h in await self._store.caller_conversations(ref, now)
                ]
            removed = await self._store.erase_caller(ref, now, now + RECALL_WINDOW_MS)
            erased += ref.subject != legacy_subject  # the same identifier's earlier spelling is no link
            if removed.alias_of:  # an identifier linked to a profile: the profile, and its links, go too
                todo.append((CallerRef(project.project_id, removed.alias_of), ""))
            todo += [(CallerRef(project.project_id, alias), ref.subject) for alias in removed.aliases]
            for name, count in (
                ("fields", removed.fields),
                ("first_interaction", int(removed.first_interaction)),
                ("conversations", removed.conversations),
                ("listed", removed.listed),
                ("transcripts", removed.transcripts),
            ):
                totals[name] = totals.get(name, 0) + count
            for listener in self._erasure_listeners:
                counts = await listener.erase_caller(ref)
                totals["deliveries"] = totals.get("deliveries", 0) + counts.deliveries_removed
                totals["archives"] = totals.get("archives", 0) + counts.archives_removed
        receipt = ErasureReceipt(
            receipt_id=uuid.uuid4().hex,
            project=project.project_id,
            erased_at=floor_hour_ms(now),
            fields_removed=totals["fields"],
            first_interaction_removed=totals["first_interaction"] > 0,
            conversations_unlinked=totals["conversations"],
            analytics_entries_removed=totals["listed"],
            blacklisted=caller.blacklisted,
            transcripts_removed=totals["transcripts"],
            deliveries_removed=totals.get("deliveries", 0),
            archives_removed=totals.get("archives", 0),
            links_removed=erased - 1,  # every identifier erased but one was linked to the profile
        )
        if self._erased_event is not None:
            await self._erased_event.caller_erased(project, receipt.receipt_id, conversation_ids)
        await self._audit.record(
            project.project_id,
            actor,
            "caller.erased",
            {"removed": receipt.removed(), "blacklisted": receipt.blacklisted},
            receipt_id=receipt.receipt_id,
            at=receipt.erased_at,  # hour-rounded, like every time about a caller
        )
        return receipt
