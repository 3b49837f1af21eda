"""The request bodies of conversation memory (one typed definition each: validation, body builders and the
OpenAPI document), who reads a transcript, and the small views and refusals the use cases share
(:mod:`caller_memory.service.domain.conversations.service`, :mod:`caller_memory.service.domain.conversations.lifecycle`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..attestation import MAX_ATTESTATION_CHARS
from ..documents import NOT_READ, load, no_member_lost, parse_document, plain_members
from ..errors import Conflict, Gone, InvalidInput, NotFound, PayloadTooLarge
from ..limits import MAX_ANY_IDENTIFIER_CHARS, MAX_STATE_ENTRIES, NAME_PATTERN
from ..projects import Project, validation_problem
from ..store.transcripts import AppendStatus, Header, TranscriptStatus
from ..trust import ATTESTATION_HELP, STEP_UP_HELP
from .messages import (
    MAX_BATCH,
    MAX_INT,
    MAX_MESSAGES,
    MAX_TRANSCRIPT_BYTES,
    Incoming,
    MessageIn,
    estimate_tokens,
    fast_messages,
    incoming,
    may_hold_number,
)
from .views import EndedBy, Status, SummarySection

#: Longest summary text, in characters.
MAX_SUMMARY_CHARS = 32_000


class AppendBody(BaseModel):
    """``POST .../conversations/{id}/messages``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    caller: str | None = Field(default=None, max_length=MAX_ANY_IDENTIFIER_CHARS)
    channel: str | None = Field(default=None, pattern=NAME_PATTERN)
    agent: str | None = Field(default=None, pattern=NAME_PATTERN)
    messages: list[MessageIn] = Field(default_factory=list, max_length=MAX_BATCH)
    state: dict[str, Any] | None = Field(default=None, max_length=MAX_STATE_ENTRIES)
    #: The call's trust: the checkpoint in ``state`` keeps only what the call may write.
    attestation: str | None = Field(
        default=None, max_length=MAX_ATTESTATION_CHARS, description=ATTESTATION_HELP
    )
    step_up: bool | None = Field(default=None, description=STEP_UP_HELP)
    #: When the client first tried to send this (its outbox keeps it): an erasure after it wins.
    sent_at: int | None = Field(default=None, ge=0, le=2**53 - 1, description="epoch milliseconds")


class StartBody(BaseModel):
    """``POST .../conversations/{id}/start``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    caller: str = Field(max_length=MAX_ANY_IDENTIFIER_CHARS)
    channel: str = Field(pattern=NAME_PATTERN)
    agent: str | None = Field(default=None, pattern=NAME_PATTERN)
    attestation: str | None = Field(
        default=None, max_length=MAX_ATTESTATION_CHARS, description=ATTESTATION_HELP
    )
    step_up: bool = Field(default=False, description=STEP_UP_HELP)


class SummaryBody(BaseModel):
    """``PUT .../conversations/{id}/summary``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    text: str = Field(max_length=MAX_SUMMARY_CHARS)
    through_turn: int = Field(ge=0, le=2**53 - 1)
    tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    #: The conversation's caller, if the client has it: the caller's own number written in their country's
    #: national format is then found in the text too (the SDK sends it).
    caller: str | None = Field(default=None, max_length=MAX_ANY_IDENTIFIER_CHARS)


@dataclass(frozen=True, slots=True)
class Batch:
    """An append body, validated (what :func:`parse_append` returns)."""

    caller: str | None
    channel: str | None
    agent: str | None
    messages: list[Incoming]
    state: dict[str, Any] | None
    sent_at: int | None
    attestation: str | None = None
    step_up: bool | None = None


_APPEND_MEMBERS = frozenset(AppendBody.model_fields)
_NAME = re.compile(NAME_PATTERN).fullmatch


def _fast_batch(document: Any) -> Batch | None:
    """:func:`parse_append` without pydantic, for a valid body (None for anything else)."""
    if type(document) is not dict or not _APPEND_MEMBERS.issuperset(document):
        return None
    get = document.get
    caller, channel, agent, state, sent_at = (
        get("caller"),
        get("channel"),
        get("agent"),
        get("state"),
        get("sent_at"),
    )
    attestation, step_up = get("attestation"), get("step_up")
    if (
        (caller is not None and (type(caller) is not str or len(caller) > MAX_ANY_IDENTIFIER_CHARS))
        or (
            attestation is not None
            and (type(attestation) is not str or len(attestation) > MAX_ATTESTATION_CHARS)
        )
        or (step_up is not None and type(step_up) is not bool)
        or (channel is not None and (type(channel) is not str or not _NAME(channel)))
        or (agent is not None and (type(agent) is not str or not _NAME(agent)))
        or (state is not None and (type(state) is not dict or len(state) > MAX_STATE_ENTRIES))
        or (sent_at is not None and (type(sent_at) is not int or not 0 <= sent_at <= MAX_INT))
    ):
        return None
    messages = fast_messages(document.get("messages", []))
    if messages is None:
        return None
    return Batch(caller, channel, agent, messages, state, sent_at, attestation, step_up)


def read_append(body: bytes) -> Batch | Any:
    """An append's body read in one pass when it is valid and provably exact: orjson's reading checked by
    the fast reading (every value of a message is a string, a bool, null or an integer within JSON's exact
    range), the state by documents.plain_members, and no member name given twice (documents.no_member_lost);
    so neither the document's generic walk nor pydantic runs. Anything else is parsed as every body is
    (documents.parse_document: its errors) and returned as a document for :func:`parse_append`."""
    document = load(body)
    if document is not NOT_READ:
        batch = _fast_batch(document)
        if batch is not None:
            members = len(document)
            for message in document.get("messages", ()):
                members += len(message) + len(message.get("metadata", ()))
            state = document.get("state")
            counted = plain_members(state, 2) if state is not None else 0
            if counted is not None and no_member_lost(document, body, members + counted):
                return batch
    return parse_document(body, loaded=document)


def parse_append(document: Any) -> Batch:
    """The append body in ``document`` (or already read: :func:`read_append`), or :class:`InvalidInput`
    naming what is wrong (pydantic's reading of :class:`AppendBody`, which only a body the fast reading does
    not accept takes)."""
    if isinstance(document, Batch):
        return document
    batch = _fast_batch(document)
    if batch is not None:
        return batch
    body: AppendBody = parse_body(AppendBody, document, "messages")
    return Batch(
        body.caller,
        body.channel,
        body.agent,
        [incoming(message) for message in body.messages],
        body.state,
        body.sent_at,
        body.attestation,
        body.step_up,
    )


def check_agent(given: str | None, writer: str, where: str) -> None:
    if given is not None and given != writer:
        raise InvalidInput(
            f"{where}: this token acts as agent '{writer}', so it cannot write for another agent", field=where
        )


def attributed(body: Batch, writer: str) -> Batch:
    """The body with its agent's messages attributed to ``writer`` (the token's agent)."""
    check_agent(body.agent, writer, "agent")
    messages = []
    for index, message in enumerate(body.messages):
        if message.role != "user":
            check_agent(message.agent, writer, f"messages[{index}].metadata.agent")
            if message.agent is None:
                message = message._replace(agent=writer)
        messages.append(message)
    return replace(body, messages=messages, agent=writer)


def parse_body(model: type[BaseModel], document: Any, what: str) -> Any:
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise validation_problem(exc, what=what, error=InvalidInput) from None


@dataclass(frozen=True, slots=True)
class Reader:
    """Who reads a transcript: under ``transcript_scope: "agent"``, an agent token sees the user's messages
    and its own agent's only (``agent``); None sees everything."""

    agent: str | None = None


EVERYONE = Reader()


def status_of(header: Header, project: Project, now: int) -> Status:
    if header.status is TranscriptStatus.OPEN:
        idle = now - header.last_activity >= project.conversation.idle_after_ms
        return "idle" if idle else "active"
    return "ending" if header.status is TranscriptStatus.ENDING else "ended"


def summary_of(header: Header, reader: Reader | None = None) -> dict[str, Any] | None:
    """The conversation's summary, as ``reader`` may see it: under ``transcript_scope: "agent"`` (a reader
    with an ``agent``), only a summary that agent wrote (written before summaries kept their author, or by
    an admin: no agent's, so none)."""
    summary: dict[str, Any] | None = orjson.loads(header.summary) if header.summary else None
    if (
        summary is not None
        and reader is not None
        and reader.agent is not None
        and summary.get("agent") != reader.agent
    ):
        return None
    return summary


def summary_section(summary: dict[str, Any] | None) -> SummarySection | None:
    if summary is None:
        return None
    given = summary.get("tokens")
    return {
        "provenance": "agent_summary",
        "tokens": given if given is not None else estimate_tokens(summary["text"]),
        "token_source": "client" if given is not None else "estimate",
        "through_turn": summary["through_turn"],
        "text": summary["text"],
    }


def ended_by_of(header: Header) -> EndedBy | None:
    return cast("EndedBy", header.ended_by) if header.ended_by else None


def message_may_hold_number(message: Incoming) -> bool:
    original = message.original
    return may_hold_number(message.content) or (original is not None and may_hold_number(original))


def token_source(tokens: Iterable[int | None]) -> Any:
    """``client``, ``estimate`` or ``mixed``: whether the messages whose ``tokens`` these are had their
    counts from the client (a count) or estimated (None)."""
    given = {t is not None for t in tokens}
    return "mixed" if len(given) > 1 else "client" if given == {True} else "estimate"


def refuse(status: AppendStatus, conversation_id: str, detail: str) -> None:
    """Raise the error an append refused with ``status`` gets (nothing for APPENDED)."""
    if status is AppendStatus.APPENDED:
        return
    if status is AppendStatus.NOT_FOUND:
        raise NotFound(
            f"conversation '{conversation_id}' has not started: send caller and channel with its first "
            "messages, or start it"
        )
    if status is AppendStatus.EXPIRED:
        raise Gone(f"the transcript of conversation '{conversation_id}' expired")
    if status is AppendStatus.ENDED:
        raise Conflict(f"conversation '{conversation_id}' has ended: nothing can be appended to it")
    if status is AppendStatus.OTHER_CALLER:
        raise Conflict(f"conversation '{conversation_id}' belongs to another caller")
    if status is AppendStatus.ID_CONFLICT:
        raise Conflict(
            f"message id '{detail}' is already in conversation '{conversation_id}' with another body; "
            "a retry must send the same message"
        )
    if status is AppendStatus.TURN_ORDER:
        raise InvalidInput(
            "a turn_id is lower than the conversation's latest turn; turn ids never decrease",
            field="messages",
        )
    if status is AppendStatus.TOO_MANY_MESSAGES:
        raise InvalidInput(
            f"the transcript would pass its limit of {MAX_MESSAGES:,} messages", field="messages"
        )
    raise PayloadTooLarge(
        f"the transcript would pass its limit of {MAX_TRANSCRIPT_BYTES:,} bytes", field="messages"
    )
