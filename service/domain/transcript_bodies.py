"""The request bodies of conversation memory (one typed definition each: validation, body builders and the
OpenAPI document), who reads a transcript, and the small views and refusals the use cases share
(:mod:`.transcript_service`, :mod:`.lifecycle`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import Conflict, Gone, InvalidInput, NotFound, PayloadTooLarge
from .limits import MAX_STATE_ENTRIES
from .projects import Project, validation_problem
from .transcript_store import AppendStatus, Header, TranscriptStatus
from .transcript_views import EndedBy, Status, SummarySection
from .transcripts import (
    MAX_BATCH,
    MAX_MESSAGES,
    MAX_TRANSCRIPT_BYTES,
    NAME_PATTERN,
    Message,
    MessageIn,
    estimate_tokens,
    may_hold_number,
)

#: Longest summary text, in characters.
MAX_SUMMARY_CHARS = 32_000


class AppendBody(BaseModel):
    """``POST .../conversations/{id}/messages``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    caller: str | None = Field(default=None, max_length=64)
    channel: str | None = Field(default=None, pattern=NAME_PATTERN)
    agent: str | None = Field(default=None, pattern=NAME_PATTERN)
    messages: list[MessageIn] = Field(default_factory=list, max_length=MAX_BATCH)
    state: dict[str, Any] | None = Field(default=None, max_length=MAX_STATE_ENTRIES)
    #: When the client first tried to send this (its outbox keeps it): an erasure after it wins.
    sent_at: int | None = Field(default=None, ge=0, le=2**53 - 1, description="epoch milliseconds")


class StartBody(BaseModel):
    """``POST .../conversations/{id}/start``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    caller: str = Field(max_length=64)
    channel: str = Field(pattern=NAME_PATTERN)
    agent: str | None = Field(default=None, pattern=NAME_PATTERN)


class SummaryBody(BaseModel):
    """``PUT .../conversations/{id}/summary``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    text: str = Field(max_length=MAX_SUMMARY_CHARS)
    through_turn: int = Field(ge=0, le=2**53 - 1)
    tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    #: The conversation's caller, if the client has it: the caller's own number written in their country's
    #: national format is then found in the text too (the SDK sends it).
    caller: str | None = Field(default=None, max_length=64)


def check_agent(given: str | None, writer: str, where: str) -> None:
    if given is not None and given != writer:
        raise InvalidInput(
            f"{where}: this token acts as agent '{writer}', so it cannot write for another agent", field=where
        )


def attributed(body: AppendBody, writer: str) -> AppendBody:
    """The body with its agent's messages attributed to ``writer`` (the token's agent)."""
    check_agent(body.agent, writer, "agent")
    messages = []
    for index, message in enumerate(body.messages):
        if message.role != "user":
            check_agent(message.metadata.agent, writer, f"messages[{index}].metadata.agent")
            if message.metadata.agent is None:
                metadata = message.metadata.model_copy(update={"agent": writer})
                message = message.model_copy(update={"metadata": metadata})
        messages.append(message)
    return body.model_copy(update={"messages": messages, "agent": writer})


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


def summary_of(header: Header) -> dict[str, Any] | None:
    return orjson.loads(header.summary) if header.summary else None


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


def message_may_hold_number(message: MessageIn) -> bool:
    original = message.metadata.original
    return may_hold_number(message.content) or (original is not None and may_hold_number(original))


def token_source(messages: Sequence[Message]) -> Any:
    given = {m.tokens is not None for m in messages}
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
