"""What the SDK accepts from a server: bounded, decoded by the SDK itself, and of the documented shape only.

Nothing here trusts the server. A body is read up to :data:`MAX_BODY_BYTES` (before and after decoding:
``gzip``/``deflate`` are decoded here with that bound, aiohttp's own decompression is turned off), parsed as
JSON, and checked against the documented shape of the answer with strict pydantic models (no coercion:
``"true"`` is not a boolean). Unknown extra members are ignored, so that a newer service stays readable.
"""

from __future__ import annotations

import logging
import re
import zlib
from typing import Annotated, Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: Largest answer body accepted, in bytes, both as received and once decoded. The largest memory the
#: service can hold (64 fields of at most 2048 bytes each) is well below it.
MAX_BODY_BYTES = 1024 * 1024

#: What a number looks like in text: 7 or more digits, with separators (spaces, dots, dashes, slashes,
#: underscores, brackets) between them. Digits of any script count (``\d`` is Unicode-aware).
_NUMBER = re.compile(r"[+\uff0b]?\d(?:[\s\-./_()\u2010-\u2015\u00a0]{0,3}\d){6,}")
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
#: A project-defined account identifier (``account:A-1234``, any case), up to what delimits it in a URL or JSON.
_ACCOUNT = re.compile(r"(?i)(?<![^\W_])account:[^\s/?#&=\"'`|<>,;()\[\]{}]+")


class AnswerTooLarge(ValueError):
    """A body (as received or decoded) is larger than :data:`MAX_BODY_BYTES`."""


def mask(text: str) -> str:
    """``text`` with anything shaped like a phone number, an e-mail address or an ``account:`` identifier
    replaced.

    Percent-encoding is undone first (repeatedly: ``%252B`` is ``%2B`` is ``+``), so that an error page
    echoing the request path (``/callers/%2B1%20415%20555%200100/memory``) shows no number in any form.
    """
    decoded = text
    for _ in range(4):
        again = unquote(decoded, errors="replace")
        if again == decoded:
            break
        decoded = again
    # Identifiers first: an address or an account id may hold a run of digits.
    masked = (
        _ACCOUNT.sub("account:[id]", _EMAIL.sub("[email]", decoded))
        if ":" in decoded or "@" in decoded
        else decoded
    )
    return _NUMBER.sub("[number]", masked)


class MaskingFilter(logging.Filter):
    """Masks every record of the SDK's logger (its formatted message), whatever a caller of it passed."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask(message)
        if masked != message or record.args:
            record.msg = masked
            record.args = None
        return True


# Decoding ---------------------------------------------------------------------------------------------


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    out = bytearray()
    while data:
        inflater = zlib.decompressobj(wbits)
        out += inflater.decompress(data, limit + 1 - len(out))
        if len(out) > limit or inflater.unconsumed_tail:
            raise AnswerTooLarge("the decoded answer is too large")
        if not inflater.eof:
            raise ValueError("the compressed answer is truncated")
        data = inflater.unused_data if wbits == 31 else b""  # gzip may hold several members
    return bytes(out)


def decode(raw: bytes, content_encoding: str, limit: int = MAX_BODY_BYTES) -> bytes:
    """``raw`` decoded as ``Content-Encoding`` says (identity, gzip, deflate; in the order applied), at most
    ``limit`` bytes. Raises ValueError (AnswerTooLarge, zlib errors as ValueError) for anything else."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    body = raw
    for coding in reversed(codings):
        try:
            if coding in ("gzip", "x-gzip"):
                body = _inflate(body, 31, limit)
            elif coding == "deflate":  # zlib-wrapped as the RFC says, or raw deflate as some servers send
                try:
                    body = _inflate(body, 15, limit)
                except zlib.error:
                    body = _inflate(body, -15, limit)
            elif coding != "identity":
                raise ValueError(f"unsupported Content-Encoding {coding[:20]!r}")
        except zlib.error as exc:
            raise ValueError("the compressed answer is corrupt") from exc
    if len(body) > limit:
        raise AnswerTooLarge("the answer is too large")
    return body


# Documented shapes --------------------------------------------------------------------------------------


class _Answer(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


#: A call's caller-ID attestation as the service normalised it (SPEC section 13).
Attestation = Literal["A", "B", "C", "failed", "unknown"]


class MemoryAnswer(_Answer):
    """``GET .../callers/{identifier}/memory`` 200 (the ``Memory`` schema of the OpenAPI document)."""

    identifier: str
    fields: dict[str, Any]
    expires_at: str | None
    #: Absent from services before it (nothing is then served stale).
    valid_until: str | None = None
    blacklisted: bool
    #: Caller-ID trust (absent from services before it: nothing withheld, no attestation).
    withheld: list[str] = Field(default_factory=list)
    attestation: Attestation | None = None


class EndAnswer(_Answer):
    """``POST .../conversations/{id}/end`` 200 (the ``ConversationEnded`` schema)."""

    conversation_id: str
    persisted: list[str]
    ignored: list[str]
    blacklisted: bool
    erased: bool
    repeat_caller: dict[str, Any]
    #: Added with conversation memory; a service from before it does not send it.
    late: bool = False
    #: State keys the call could not write or delete (caller-ID trust); absent before it.
    withheld: list[str] = Field(default_factory=list)


class FieldError(_Answer):
    field: str
    message: str


class ProblemAnswer(_Answer):
    """An RFC 9457 problem document as the service sends it."""

    title: str
    status: int
    detail: str | None = None
    type: str | None = None
    errors: list[FieldError] | None = None


# Conversation memory (SPEC section 10) -------------------------------------------------------------------

#: JSON's exact integers: a count or turn id beyond them is no answer of the service.
Count = Annotated[int, Field(ge=0, le=2**53 - 1)]
Turn = Annotated[int, Field(ge=-1, le=2**53 - 1)]
Status = Literal["active", "idle", "ending", "ended"]
EndedBy = Literal["explicit", "inactivity", "superseded"]
TokenSource = Literal["client", "estimate", "mixed"]


class MessageMetadataAnswer(_Answer):
    source: str
    interrupted: bool = False
    interrupt_timestamp: int | None = None
    original: str | None = None
    agent: str | None = None


class MessageAnswer(_Answer):
    """One message in the platform layout (``PlatformMessage``)."""

    message_id: str | None = None
    role: Literal["user", "assistant", "tool"]
    content: str
    turn_id: Annotated[int, Field(ge=0, le=2**53 - 1)]
    timestamp: int
    tokens: Count | None = None
    metadata: MessageMetadataAnswer


class ChatAnswer(_Answer):
    role: Literal["user", "assistant"]
    content: str


class CoverageAnswer(_Answer):
    through_turn: Turn
    tokens: Count


class StatusAnswer(_Answer):
    """``GET .../conversations/{id}`` 200 and ``PUT .../summary`` 200 (``ConversationStatus``)."""

    conversation_id: str
    status: Status
    channel: str
    agent: str | None
    started_at: str
    last_activity_at: str
    turn_id: Turn
    messages: Count
    tokens: Count
    bytes: Count
    summary: CoverageAnswer | None
    ended_by: EndedBy | None
    end_reason: str | None
    end_processed: bool
    expires_at: str


class AppendedAnswer(_Answer):
    """``POST .../conversations/{id}/messages`` 200 (``Appended``)."""

    conversation_id: str
    stored: bool
    reason: str | None = None
    status: Status | None
    turn_id: Turn
    added: Count
    messages: Count
    bytes: Count
    tokens: Count


class SummarySectionAnswer(_Answer):
    tokens: Count
    token_source: TokenSource
    through_turn: Turn
    text: str


class ResumeAnswer(_Answer):
    conversation_id: str
    channel: str
    ended_by: EndedBy | None
    end_reason: str | None
    last_activity_at: str
    summary: SummarySectionAnswer | None
    last_turns: list[MessageAnswer]
    state: dict[str, Any] | None
    #: State keys left out of ``state`` (caller-ID trust); absent before it.
    withheld: list[str] = Field(default_factory=list)


class StartedAnswer(_Answer):
    """``POST .../conversations/{id}/start`` 200 (``Started``)."""

    conversation: StatusAnswer | None
    stored: bool
    reason: str | None = None
    resume: ResumeAnswer | None
    superseded: list[str]


class HistoryAnswer(_Answer):
    """``GET .../conversations/{id}/history`` 200 (``History``)."""

    conversation_id: str
    status: Status
    turn_id: Turn
    started_at: str
    times: Literal["epoch_ms", "offset_ms"]
    contents: list[MessageAnswer]
    next_after_turn: Annotated[int, Field(ge=0, le=2**53 - 1)] | None


class OpenAIHistoryAnswer(_Answer):
    """``GET .../conversations/{id}/history?format=openai`` 200."""

    messages: list[ChatAnswer]


class ProfileSectionAnswer(_Answer):
    tokens: Count
    fields: dict[str, Any]
    omitted: list[str]
    #: State keys left out for caller-ID trust; absent before it.
    withheld: list[str] = Field(default_factory=list)


class RecentTurnsAnswer(_Answer):
    tokens: Count
    token_source: TokenSource
    from_turn: Turn | None
    to_turn: Turn | None
    dropped_turns: Count
    messages: list[ChatAnswer]


class SectionsAnswer(_Answer):
    profile: ProfileSectionAnswer
    summary: SummarySectionAnswer | None
    recent_turns: RecentTurnsAnswer


class ContextAnswer(_Answer):
    """``GET .../conversations/{id}/context`` 200 (``Context``)."""

    conversation_id: str
    status: Status
    max_tokens: Annotated[int, Field(ge=1)]
    tokens: Count
    unsummarized_tokens: Count
    needs_summary: bool
    sections: SectionsAnswer


def parse(model: type[_Answer], body: Any) -> Any:
    """``body`` as ``model``, or None if it is not of that shape."""
    try:
        return model.model_validate(body)
    except ValidationError:
        return None


def problem(status: int, body: Any) -> dict[str, Any] | None:
    """``body`` if it is the service's problem document for ``status``, else None."""
    parsed = parse(ProblemAnswer, body)
    if parsed is None or parsed.status != status:
        return None
    document: dict[str, Any] = parsed.model_dump(exclude_none=True)
    return document
