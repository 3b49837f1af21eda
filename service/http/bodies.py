"""Response bodies: one TypedDict per JSON document the API answers with.

The body builders in the routes are annotated with these, so mypy checks every key and every value's type;
``components.schemas`` of ``/openapi.json`` is generated from them (components.py), so the document cannot
drift from what the routes build. They are plain dicts at run time: nothing is validated on the way out (the
memory read builds its body with ``orjson.Fragment`` values and serialises it in one orjson call), and
tests/http/test_openapi.py checks every answer against the generated schemas instead.

The ``Annotated`` metadata (patterns, bounds, descriptions) is read only when the document is generated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

import orjson
from pydantic import ConfigDict, Field, PlainValidator, WithJsonSchema, with_config
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only on Python 3.12+

from ..domain.limits import (
    CONVERSATION_ID_PATTERN,
    FIELD_NAME_PATTERN,
    MAX_STATE_KEYS,
    PROJECT_ID_PATTERN,
    TOKEN_ID_PATTERN,
)
from ..domain.reports import Count, DateTime, RepeatCallerMetrics
from ..domain.tokens import Role

E164_PATTERN = r"^\+[1-9][0-9]{1,14}$"
#: A caller identifier in canonical form: E.164, ``email:`` and a case-folded address, ``account:`` and an id.
IDENTIFIER_PATTERN = r"^(\+[1-9][0-9]{1,14}|email:[^@\s]+@[^@\s]+|account:[A-Za-z0-9._-]{1,64})$"
_CLOSED = ConfigDict(extra="forbid")


def _enum(*values: str) -> WithJsonSchema:
    """A string the schema lists the values of, which the code types as ``str`` (it comes from a store)."""
    return WithJsonSchema({"type": "string", "enum": list(values)})


#: A stored JSON value, passed through as the bytes the store holds (no parsing on the read path).
JsonFragment = Annotated[orjson.Fragment, PlainValidator(lambda value: value), WithJsonSchema({})]
RoleName = Annotated[str, _enum(*(role.value for role in Role))]
HourDateTime = Annotated[DateTime, Field(description="Rounded down to the hour.")]
Nullable = str | None


# Service ----------------------------------------------------------------------------------------------------


@with_config(_CLOSED)
class Health(TypedDict):
    """Liveness or readiness."""

    status: Literal["ok", "ready", "unready"]
    detail: NotRequired[Annotated[str, Field(description="Why the service is not ready.")]]


@with_config(_CLOSED)
class FieldError(TypedDict):
    """One validation error."""

    field: Annotated[str, Field(description="The member, parameter or header at fault.")]
    message: str


@with_config(ConfigDict(extra="allow"))
class Problem(TypedDict):
    """RFC 9457 problem details."""

    type: Annotated[str, WithJsonSchema({"type": "string", "format": "uri"})]
    title: str
    status: Annotated[int, Field(ge=400, le=599)]
    detail: Annotated[str, Field(description="What went wrong, for people; never a phone number.")]
    errors: NotRequired[
        Annotated[list[FieldError], Field(description="Validation errors, each naming a field.")]
    ]


# Tokens -----------------------------------------------------------------------------------------------------


@with_config(_CLOSED)
class Token(TypedDict):
    """A project token, without its secret."""

    token_id: Annotated[str, Field(pattern=TOKEN_ID_PATTERN)]
    role: RoleName
    label: Annotated[str, Field(description="A note for people.")]
    agent: Annotated[
        Nullable, Field(description="The agent an `agent` token acts as (transcript scope), or null.")
    ]
    created_at: DateTime


@with_config(_CLOSED)
class MintedToken(Token):
    """A new project token, with its secret."""

    token: Annotated[str, Field(pattern=r"^cm_[0-9a-f]{12}_\S+$", description="Shown only here.")]


@with_config(_CLOSED)
class TokenList(TypedDict):
    """The project's tokens."""

    tokens: list[Token]


# Memory -----------------------------------------------------------------------------------------------------


@with_config(_CLOSED)
class Memory(TypedDict):
    """A caller's live memory."""

    identifier: Annotated[
        str,
        Field(
            pattern=IDENTIFIER_PATTERN,
            description="The identifier read through, in canonical form (E.164, `email:...`, `account:...`).",
        ),
    ]
    fields: Annotated[
        dict[str, JsonFragment],
        Field(
            max_length=MAX_STATE_KEYS,
            description="Live fields, name to JSON value. Expired fields are never returned.",
            json_schema_extra={"propertyNames": {"pattern": FIELD_NAME_PATTERN}},
        ),
    ]
    expires_at: Annotated[
        DateTime | None, Field(description="When the last field expires, rounded up to the hour.")
    ]
    valid_until: Annotated[
        DateTime | None,
        Field(
            description=(
                "When the first field expires, rounded down to the hour (never later than any field's own "
                "expiry): a client may serve this memory again, marked stale, after a failed read until then."
            )
        ),
    ]
    blacklisted: Annotated[bool, Field(description="Blacklisted: memory is empty, writes are dropped.")]
    withheld: Annotated[
        list[str],
        Field(
            description="State keys the call does not qualify for (caller-ID trust): never in `fields`, "
            "whether or not the caller has them."
        ),
    ]
    attestation: Annotated[
        Literal["A", "B", "C", "failed", "unknown"] | None,
        Field(description="The call's attestation as normalised; null for a read that is no call's (admin)."),
    ]


@with_config(_CLOSED)
class ErasureRemoved(TypedDict):
    """What an erasure removed."""

    fields: Count
    first_interaction: bool
    conversation_links: Count
    analytics_conversations: Count
    transcripts: Annotated[
        Count, Field(description="Transcripts, with their summaries and state checkpoints.")
    ]
    webhook_deliveries: Annotated[
        Count, Field(description="Webhook deliveries about the caller, queued or failed, never sent now.")
    ]
    archived_conversations: Annotated[Count, Field(description="The caller's conversations in the archive.")]
    links: Annotated[
        Count,
        Field(description="Links of the caller's profile (each linked identifier's data is counted above)."),
    ]


@with_config(_CLOSED)
class ErasureReceipt(TypedDict):
    """The receipt of an erasure; it holds no phone number."""

    receipt_id: Annotated[str, Field(pattern="^[0-9a-f]{32}$")]
    project: Annotated[str, Field(pattern=PROJECT_ID_PATTERN)]
    erased_at: HourDateTime
    removed: ErasureRemoved
    blacklisted: bool


# Conversations and analytics --------------------------------------------------------------------------------


@with_config(_CLOSED)
class ConversationEnded(TypedDict):
    """What the end of a conversation persisted and ignored; a retry gets the same answer."""

    conversation_id: Annotated[str, Field(pattern=CONVERSATION_ID_PATTERN)]
    persisted: Annotated[
        list[str], Field(description="State keys written (or deleted, for null) in the caller's memory.")
    ]
    ignored: Annotated[
        list[str], Field(description="State keys not in the project's state_keys: not stored.")
    ]
    blacklisted: Annotated[bool, Field(description="The caller is blacklisted: nothing was stored.")]
    erased: Annotated[
        bool,
        Field(
            description="The caller was erased after this write was made (`ended_at`, or when the request "
            "arrived): nothing was stored."
        ),
    ]
    repeat_caller: RepeatCallerMetrics
    late: Annotated[
        bool,
        Field(
            description="The service had already ended this conversation (by inactivity or supersession): the "
            "state was applied as a merge patch written at the end's time (a field written later stays), "
            "analytics stay as recorded. A retry is a replay; a different late end is a 409."
        ),
    ]
    withheld: Annotated[
        list[str],
        Field(
            description="State keys of `state` this call may not write or delete (caller-ID trust): not stored."
        ),
    ]


@with_config(_CLOSED)
class ConversationRow(TypedDict):
    """An ended conversation with its repeat-caller metrics (the columns of the CSV form, in order)."""

    conversation_id: str
    ended_at: HourDateTime
    channel: Nullable
    qa: Nullable
    handoff_reason: Nullable
    handoff_to: Nullable
    repeat: Annotated[
        bool, Field(description="The caller had a first interaction inside the retention window.")
    ]
    REPEAT_CALLER_CONV_ID: Annotated[
        Nullable, Field(description="Conversation id of the caller's first interaction.")
    ]
    REPEAT_CALLER_DATETIME: Annotated[
        DateTime | None, Field(description="When it happened, rounded down to the hour.")
    ]
    REPEAT_CALLER_QA: Nullable
    REPEAT_CALLER_HANDOFF_REASON: Nullable
    REPEAT_CALLER_HANDOFF_TO: Nullable
    time_to_callback_hours: Annotated[
        int | None, Field(ge=0, description="Hours from the first interaction's hour to this one's.")
    ]
    ended_by: Annotated[
        str,
        _enum("explicit", "inactivity", "superseded"),
        Field(
            description="explicit (the end call), or by the service: inactivity (nobody ended it within "
            "end_after_inactivity) or superseded (the caller called again on the same channel)."
        ),
    ]
    end_reason: Annotated[
        Nullable,
        WithJsonSchema(
            {"anyOf": [{"type": "string", "enum": ["completed", "dropped", "transferred"]}, {"type": "null"}]}
        ),
        Field(description="The end's end_reason, when it gave one."),
    ]
    attestation: Annotated[
        Nullable,
        WithJsonSchema(
            {"anyOf": [{"type": "string", "enum": ["A", "B", "C", "failed", "unknown"]}, {"type": "null"}]}
        ),
        Field(
            description="The call's caller-ID attestation, normalised; null when the end carried no call's."
        ),
    ]


@with_config(_CLOSED)
class ConversationList(TypedDict):
    """A page of conversations."""

    conversations: list[ConversationRow]
    next_cursor: Annotated[Nullable, Field(description="Pass as `cursor` for the next page.")]


# Operator and audit -----------------------------------------------------------------------------------------


@with_config(_CLOSED)
class SweepReport(TypedDict):
    """What one expiry sweep removed and how long it took."""

    sweep_id: str
    holder: Annotated[str, Field(description="The replica that ran it.")]
    started_at: DateTime
    duration_ms: Annotated[float, Field(ge=0)]
    rounds: Count
    complete: Annotated[bool, Field(description="False: it stopped at its time budget with work left.")]
    removed: Annotated[dict[str, Count], Field(description="Removed items by kind.")]


@with_config(_CLOSED)
class SweepRun(SweepReport):
    """A sweep run now, and the inactivity ends that were due."""

    inactivity_ends: Annotated[
        Count, Field(description="Conversations nobody ended that this run ended (end_after_inactivity).")
    ]


@with_config(_CLOSED)
class SweepList(TypedDict):
    """The latest sweeps, newest first."""

    sweeps: list[SweepReport]


@with_config(_CLOSED)
class AuditRecord(TypedDict):
    """Who did what, when."""

    id: str
    at: Annotated[DateTime, Field(description="Rounded down to the hour for erasures.")]
    actor: Annotated[str, Field(description="`operator` or `token:<token_id>`.")]
    action: Annotated[
        str,
        _enum(
            "project.created",
            "project.configured",
            "token.created",
            "token.revoked",
            "caller.erased",
            "transcript.read",
            "transcript.deleted",
            "webhook.created",
            "webhook.rotated",
            "webhook.deleted",
            "webhook.redelivered",
            "link.created",
            "link.renewed",
            "link.removed",
            "platform.connected",
            "platform.updated",
            "platform.disconnected",
            "llm.set",
            "llm.deleted",
            "conversation.step_up",
        ),
    ]
    details: Annotated[
        dict[str, Any], Field(description="Counts and ids; never a phone number or a stored value.")
    ]
    receipt_id: Nullable


@with_config(_CLOSED)
class AuditList(TypedDict):
    """A page of audit records, newest first."""

    records: list[AuditRecord]
    next_cursor: Annotated[Nullable, Field(description="Pass as `before` for the next page.")]


# Linked identifiers -----------------------------------------------------------------------------------------


@with_config(_CLOSED)
class LinkView(TypedDict):
    """One identifier linked to a caller: its kind and a random id, never the identifier."""

    link_id: Annotated[str, Field(pattern="^lnk_[a-z]{20}$")]
    kind: Literal["phone", "email", "account"]
    linked_at: HourDateTime
    expires_at: Annotated[
        DateTime, Field(description="Rounded up to the hour: `retention` after it was made (or made again).")
    ]
    merging: Annotated[
        bool,
        Field(
            description="A merge was begun and not finished (a crash); making the same link again ends it."
        ),
    ]


@with_config(_CLOSED)
class LinkMerged(TypedDict):
    fields: Annotated[
        Count, Field(description="Fields of the identifier's own memory moved (the later write won).")
    ]
    first_interaction: Annotated[
        bool,
        Field(description="The identifier's first interaction was the earlier one and is the caller's now."),
    ]


@with_config(_CLOSED)
class LinkCreated(TypedDict):
    """What a link request did."""

    link: LinkView
    created: Annotated[bool, Field(description="False: it was linked already, and is renewed.")]
    merged: LinkMerged


@with_config(_CLOSED)
class LinkList(TypedDict):
    """A caller's linked identifiers, oldest first (the caller's own first identifier is not one)."""

    links: list[LinkView]


@with_config(_CLOSED)
class LinkRemoved(TypedDict):
    unlinked: LinkView
