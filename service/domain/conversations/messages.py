"""Transcript messages (SPEC section 10): the message schema, its rules, phone-number redaction, the stored
encoding, token estimates, and the layouts history is read in.

A message is validated once, here, redacted, and encoded in a compact form (a JSON array) that is what the
store keeps: the store never parses it. Reading decodes it back to the platform layout (an OpenAI chat
message with ``turn_id``, ``timestamp``, ``tokens`` and ``metadata``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Literal, NamedTuple

import orjson
import phonenumbers
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..limits import CONVERSATION_ID_PATTERN, NAME_PATTERN
from ..redaction import PHONE_MASK as PHONE_MASK
from ..redaction import Masked, redact_text
from .views import ChatMessage, MessageMetadataOut, PlatformMessage

#: Messages per conversation; bytes of one message's stored form; bytes of one transcript. An hour-long call
#: has a few hundred to about a thousand messages of some 200 bytes each.
MAX_MESSAGES = 10_000
MAX_MESSAGE_BYTES = 16 * 1024
MAX_TRANSCRIPT_BYTES = 8 * 1024 * 1024
#: Most messages in one append.
MAX_BATCH = 100
#: Longest agent name, channel name and message id.
MAX_NAME_CHARS = 64
#: Largest turn id and timestamp (ms) accepted: JSON's exact integers.
MAX_INT = 2**53 - 1
EMAIL_MASK = "[email]"
ACCOUNT_MASK = "[account]"
#: An email address as people write it in text: a local part, '@', a domain with a dot. Loose on purpose
#: (what it masks that is not an address is no loss); linear (no nested repetition).
_EMAIL_IN_TEXT = re.compile(r"[\w.!#$%&'*+/=?^`{|}~-]+@[\w-]+(?:\.[\w-]+)+")

SOURCES: dict[str, frozenset[str]] = {
    "user": frozenset({"asr", "message", "command"}),
    "assistant": frozenset({"command", "llm", "greeting", "llm_failure", "silence"}),
    "tool": frozenset({"tool"}),
}
#: The source of a message that names none.
DEFAULT_SOURCE = {"user": "message", "assistant": "llm", "tool": "tool"}
_ROLE_CODE = {"user": 0, "assistant": 1, "tool": 2}
_ROLES = ("user", "assistant", "tool")

MESSAGE_ID_PATTERN = CONVERSATION_ID_PATTERN


class MessageMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    source: str | None = Field(default=None, description="how the message was made (see SOURCES)")
    interrupted: bool = False
    interrupt_timestamp: int | None = Field(default=None, ge=0, le=MAX_INT)
    original: str | None = None
    agent: str | None = Field(default=None, pattern=NAME_PATTERN)


class MessageIn(BaseModel):
    """One message as a client sends it (the platform layout)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    message_id: str | None = Field(default=None, pattern=MESSAGE_ID_PATTERN)
    role: Literal["user", "assistant", "tool"]
    content: str
    turn_id: int = Field(ge=0, le=MAX_INT)
    timestamp: int | None = Field(default=None, ge=0, le=MAX_INT, description="milliseconds since the epoch")
    tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    metadata: MessageMetadata = Field(default_factory=MessageMetadata)

    @model_validator(mode="after")
    def _rules(self) -> MessageIn:
        meta = self.metadata
        source = meta.source or DEFAULT_SOURCE[self.role]
        if source not in SOURCES[self.role]:
            allowed = ", ".join(sorted(SOURCES[self.role]))
            raise ValueError(
                f"metadata.source '{source[:32]}' does not fit role '{self.role}' (allowed: {allowed})"
            )
        if self.role != "assistant" and meta.interrupted:
            raise ValueError("metadata.interrupted: only an assistant message can be interrupted")
        if not meta.interrupted and (meta.interrupt_timestamp is not None or meta.original is not None):
            raise ValueError(
                "metadata.interrupt_timestamp and metadata.original exist only on interrupted messages "
                "(metadata.interrupted: true)"
            )
        return self


class Incoming(NamedTuple):
    """One validated message as the append path uses it (either reading of the body gives these: the fast
    one of :func:`fast_messages` or pydantic's, converted by :func:`incoming`). ``source`` is the one in
    force (the role's default when none was given)."""

    message_id: str | None
    role: str
    content: str
    turn_id: int
    timestamp: int | None
    tokens: int | None
    source: str
    interrupted: bool
    interrupt_timestamp: int | None
    original: str | None
    agent: str | None


def incoming(message: MessageIn) -> Incoming:
    meta = message.metadata
    return Incoming(
        message.message_id,
        message.role,
        message.content,
        message.turn_id,
        message.timestamp,
        message.tokens,
        meta.source or DEFAULT_SOURCE[message.role],
        meta.interrupted,
        meta.interrupt_timestamp,
        meta.original,
        meta.agent,
    )


_MESSAGE_MEMBERS = frozenset(MessageIn.model_fields)
_METADATA_MEMBERS = frozenset(MessageMetadata.model_fields)
_NAME = re.compile(NAME_PATTERN).fullmatch
_MESSAGE_ID = re.compile(MESSAGE_ID_PATTERN).fullmatch


def _bounded(value: Any, high: int) -> bool:
    """An optional JSON integer (never a bool) in 0..high."""
    return value is None or (type(value) is int and 0 <= value <= high)


def fast_messages(raw: Any) -> list[Incoming] | None:
    """The messages of an append body when every one of them is valid, read without pydantic (this runs on
    every append, and pydantic costs some 3 us a message); None when anything is not, and then
    :class:`MessageIn` reads the body again and says what is wrong. Accepts exactly what :class:`MessageIn`
    does, with the same result (tests/domain/test_fast_messages.py checks both on generated bodies)."""
    if type(raw) is not list or len(raw) > MAX_BATCH:
        return None
    out: list[Incoming] = []
    message: dict[str, Any]
    for message in raw:
        if type(message) is not dict or not _MESSAGE_MEMBERS.issuperset(message):
            return None
        get: Callable[[str], Any] = message.get
        role, content, turn_id = get("role"), get("content"), get("turn_id")
        message_id, timestamp, tokens = get("message_id"), get("timestamp"), get("tokens")
        allowed = SOURCES.get(role) if type(role) is str else None
        if (
            allowed is None
            or type(content) is not str
            or turn_id is None
            or not _bounded(turn_id, MAX_INT)
            or not _bounded(timestamp, MAX_INT)
            or not _bounded(tokens, 1_000_000)
            or (message_id is not None and (type(message_id) is not str or not _MESSAGE_ID(message_id)))
        ):
            return None
        meta = message.get("metadata", _NO_EXTRAS)
        if type(meta) is not dict:
            return None
        if meta:
            if not _METADATA_MEMBERS.issuperset(meta):
                return None
            source, agent = meta.get("source"), meta.get("agent")
            interrupted = meta.get("interrupted", False)
            at, original = meta.get("interrupt_timestamp"), meta.get("original")
            if (
                (source is not None and type(source) is not str)
                or type(interrupted) is not bool
                or not _bounded(at, MAX_INT)
                or (original is not None and type(original) is not str)
                or (agent is not None and (type(agent) is not str or not _NAME(agent)))
                or (interrupted and role != "assistant")
                or (not interrupted and (at is not None or original is not None))
            ):
                return None
            source = source or DEFAULT_SOURCE[role]
            if source not in allowed:
                return None
        else:
            source, interrupted, at, original, agent = DEFAULT_SOURCE[role], False, None, None, None
        out.append(
            Incoming(
                message_id,
                role,
                content,
                turn_id,
                timestamp,
                tokens,
                source,
                interrupted,
                at,
                original,
                agent,
            )
        )
    return out


def check_batch_order(messages: Sequence[Incoming | MessageIn]) -> str | None:
    """Why a batch's turn ids go backwards (a message's turn below the one before it), or None."""
    for index in range(1, len(messages)):
        if messages[index].turn_id < messages[index - 1].turn_id:
            return (
                f"messages[{index}].turn_id is lower than the previous message's turn_id; turn ids never "
                "decrease"
            )
    return None


# Redaction -------------------------------------------------------------------------------------------------

#: No phone number has fewer digits: text with fewer is left alone without running the matcher. Matched in C,
#: any script's digits (the matcher reads them all).
_ENOUGH_DIGITS = re.compile(r"(?:\D*\d){5}")


_ASCII_DIGITS = b"0123456789"


def may_hold_number(text: str) -> bool:
    """Whether ``text`` has digits enough for a phone number (else :func:`redact` leaves it as it is)."""
    if text.isascii():
        # All in C and without backtracking: 0.2 us for 100 characters, the regular expression 1.5.
        ascii_text = text.encode()
        return len(ascii_text) - len(ascii_text.translate(None, _ASCII_DIGITS)) >= 5
    return _ENOUGH_DIGITS.match(text) is not None


#: A word that may be an account id (``account:`` ids are 1-64 of these characters).
_ACCOUNT_WORD = re.compile(r"(?<![\w.-])[A-Za-z0-9._-]{1,64}(?![\w.-])")


def redact_identifiers(
    text: str,
    *,
    every_email: bool,
    own: Callable[[str], bool] | None = None,
    accounts: bool = False,
) -> str:
    """``text`` without email addresses (every one with ``every_email``, else those ``own`` says are the
    caller's: it is given the canonical ``email:...``) and, with ``accounts``, without the words ``own``
    says are one of the caller's account ids (given ``account:...``)."""
    if "@" in text and (every_email or own is not None):

        def address(match: re.Match[str]) -> str:
            found = match.group()
            mine = every_email or (own is not None and own("email:" + found.casefold()))
            return EMAIL_MASK if mine else found

        text = _EMAIL_IN_TEXT.sub(address, text)
    if accounts and own is not None:
        text = _ACCOUNT_WORD.sub(lambda m: ACCOUNT_MASK if own("account:" + m.group()) else m.group(), text)
    return text


def redact(text: str, regions: Sequence[str | None], masked: Masked = None) -> str:
    """``text`` with the phone numbers found (reading them in each of ``regions``) replaced by ``[phone]``:
    every one, or where ``masked(e164)`` says so (:mod:`.redaction` finds them at a cost bounded per byte)."""
    return redact_text(text, regions, masked)


@lru_cache(maxsize=65536)
def region_of(e164: str) -> str | None:
    """The region a caller's number belongs to: the one whose numbering plan it is valid in, else (a number
    that is possible but not valid: a test range, a range newer than the metadata) the main region of its
    country calling code, so that its national form is still read the caller's way."""
    try:
        number = phonenumbers.parse(e164, None)
    except phonenumbers.NumberParseException:  # pragma: no cover - e164 comes from normalize()
        return None
    region = phonenumbers.region_code_for_number(number)
    if region is None or region == phonenumbers.UNKNOWN_REGION:
        region = phonenumbers.region_code_for_country_code(number.country_code or 0)
    return None if region == phonenumbers.UNKNOWN_REGION else region


def regions_to_try(default_region: str | None, caller_region: str | None = None) -> list[str | None]:
    """The regions redaction reads national numbers in: the project's ``default_region``, then the caller's
    region (:func:`region_of` of their number, or the one kept with the conversation) when known."""
    return [default_region, caller_region]


# The stored form -----------------------------------------------------------------------------------------
# [role code, content, turn_id, timestamp, tokens or null, source, message_id or null, extras?] where extras
# is {"i": interrupt_timestamp, "o": original, "a": agent} with only what is present (absent when empty).


def estimate_tokens(text: str) -> int:
    """About four characters per token (OpenAI's rule of thumb for English): an estimate, said to be one."""
    return -(-len(text) // 4)


def encode_message(message: Incoming, content: str, original: str | None, timestamp: int) -> bytes:
    row: list[Any] = [
        _ROLE_CODE[message.role],
        content,
        message.turn_id,
        timestamp,
        message.tokens,
        message.source,
        message.message_id,
    ]
    if message.interrupted or message.agent is not None:
        extras: dict[str, Any] = {}
        if message.interrupted:
            extras["x"] = 1
            if message.interrupt_timestamp is not None:
                extras["i"] = message.interrupt_timestamp
            if original is not None:
                extras["o"] = original
        if message.agent is not None:
            extras["a"] = message.agent
        row.append(extras)
    return orjson.dumps(row)


#: The extras of a message without any (shared: never written to).
_NO_EXTRAS: dict[str, Any] = {}


def stored_rows(bodies: Sequence[bytes]) -> list[list[Any]]:
    """Stored messages as their rows (``encode_message``'s list: role code, content, turn_id, timestamp,
    tokens, source, message_id, then extras if any), in one orjson call for all of them."""
    return orjson.loads(b"[" + b",".join(bodies) + b"]") if bodies else []


def turns_of_rows(
    rows: Sequence[list[Any]], after_turn: int, agent: str | None
) -> tuple[dict[int, list[list[Any]]], dict[int, int]]:
    """The turns after ``after_turn`` that a context may show, from stored rows without building a
    :class:`Message` for each (a context read looks at every message of its window and shows two fields of
    those it keeps): each turn's rows in order and its token cost (:attr:`Message.token_count`). Tool
    messages are left out; under ``agent`` (``transcript_scope: "agent"``), so is what
    :meth:`Message.visible_to` hides."""
    turns: dict[int, list[list[Any]]] = {}
    costs: dict[int, int] = {}
    tool, user = _ROLE_CODE["tool"], _ROLE_CODE["user"]
    for row in rows:
        turn, role = row[2], row[0]
        if turn <= after_turn or role == tool:
            continue
        if agent is not None and role != user and (row[7] if len(row) > 7 else _NO_EXTRAS).get("a") != agent:
            continue
        tokens = row[4]
        cost = tokens if tokens is not None else estimate_tokens(row[1])
        group = turns.get(turn)
        if group is None:
            turns[turn] = [row]
            costs[turn] = cost
        else:
            group.append(row)
            costs[turn] += cost
    return turns, costs


def role_of(body: bytes) -> str:
    """The role of a stored message's body."""
    return _ROLES[orjson.loads(body)[0]]


def chat_of_row(row: list[Any]) -> ChatMessage:
    """:meth:`Message.openai` of a stored row."""
    return {"role": _ROLES[row[0]], "content": row[1]}  # type: ignore[typeddict-item]


class Message:
    """A stored message decoded (what history, context and resume read)."""

    __slots__ = (
        "agent",
        "content",
        "extras",
        "message_id",
        "role",
        "source",
        "timestamp",
        "tokens",
        "turn_id",
    )

    def __init__(self, body: bytes) -> None:
        self._fill(orjson.loads(body))

    @classmethod
    def decode_all(cls, bodies: Sequence[bytes]) -> list[Message]:
        """Many stored messages at once: one orjson call for all of them (a call per message costs more
        than the decoding)."""
        out = []
        new = object.__new__
        for row in stored_rows(bodies):
            message = new(cls)
            message._fill(row)
            out.append(message)
        return out

    def _fill(self, row: list[Any]) -> None:
        self.role: str = _ROLES[row[0]]
        self.content: str = row[1]
        self.turn_id: int = row[2]
        self.timestamp: int = row[3]
        self.tokens: int | None = row[4]
        self.source: str = row[5]
        self.message_id: str | None = row[6]
        self.extras: dict[str, Any] = row[7] if len(row) > 7 else _NO_EXTRAS
        self.agent: str | None = self.extras.get("a")

    @property
    def token_count(self) -> int:
        return self.tokens if self.tokens is not None else estimate_tokens(self.content)

    def platform(self, offset_from: int | None = None) -> PlatformMessage:
        """The platform layout. With ``offset_from`` (a conversation that ended), times are milliseconds
        from that start instead of epoch times (SPEC section 14)."""

        shift = 0 if offset_from is None else offset_from
        metadata: MessageMetadataOut = {"source": self.source}
        extras = self.extras
        if extras and extras.get("x"):
            metadata["interrupted"] = True
            if "i" in extras:
                metadata["interrupt_timestamp"] = extras["i"] - shift
            if "o" in extras:
                metadata["original"] = extras["o"]
        if self.agent is not None:
            metadata["agent"] = self.agent
        out: PlatformMessage = {
            "role": self.role,  # type: ignore[typeddict-item]
            "content": self.content,
            "turn_id": self.turn_id,
            "timestamp": self.timestamp - shift,
            "metadata": metadata,
        }
        if self.message_id is not None:
            out["message_id"] = self.message_id
        if self.tokens is not None:
            out["tokens"] = self.tokens
        return out

    def openai(self) -> ChatMessage:
        """``{role, content}``: what was actually spoken (an interrupted message's ``content``)."""
        return {"role": self.role, "content": self.content}  # type: ignore[typeddict-item]

    def visible_to(self, agent: str | None) -> bool:
        """Under ``transcript_scope: "agent"``: the user's messages and the agent's own (None: all)."""
        return agent is None or self.role == "user" or self.agent == agent
