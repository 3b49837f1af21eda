"""Conversation memory as the SDK shows it (SPEC section 10): the messages of a transcript, what
``conv.history()``, ``conv.context()`` and ``conv.set_summary()`` answer, the ``resume`` offer of a dropped
call, and the record of a message batch the service refused.

Every object here is immutable and built from an answer the SDK has already checked against its documented
shape (:mod:`caller_memory.sdk._wire`); this module also holds the checks ``conv.add_message()`` makes on
its arguments, so that a batch the SDK sends is one the service accepts.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import orjson

from . import _wire

Role = Literal["user", "assistant", "tool"]
#: Which ``metadata.source`` fits which role (a source that does not fit is refused).
SOURCES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "user": frozenset({"asr", "message", "command"}),
        "assistant": frozenset({"command", "llm", "greeting", "llm_failure", "silence"}),
        "tool": frozenset({"tool"}),
    }
)
#: How a call ended (``conv.end(end_reason=...)``).
END_REASONS = ("completed", "dropped", "transferred")
#: The largest message, as the JSON the SDK sends (the service's limit, on its smaller stored form, is the
#: same number: a message that passes here is never too large there).
MAX_MESSAGE_BYTES = 16 * 1024
#: Largest turn id, timestamp and token count the service takes.
MAX_INT = 2**53 - 1
MAX_TOKENS = 1_000_000
#: Longest summary, in characters; most messages in one history page.
MAX_SUMMARY_CHARS = 32_000
MAX_PAGE = 1000
#: Channel and agent names: 1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}", re.ASCII)
#: Message ids, as conversation ids.
MESSAGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", re.ASCII)


def check_name(value: object, what: str) -> str:
    """``value`` if it is a channel or agent name the service takes, else ValueError."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(
            f"{what} must be 1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
        )
    return value


def check_integer(value: object, what: str, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) from ``low`` to ``high``, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer from {low} to {high:,}")
    return value


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} holds a lone surrogate, which JSON cannot carry") from None
    return value


def build_message(
    role: object,
    content: object,
    *,
    turn_id: int,
    message_id: str,
    timestamp: int,
    source: object = None,
    interrupted: object = False,
    original: object = None,
    interrupt_timestamp: object = None,
    agent: object = None,
    tokens: object = None,
) -> bytes:
    """The platform layout of one message (SPEC section 10) as JSON, or ValueError naming what the service would
    refuse: a role or source it does not know, a source that does not fit the role, interruption details on
    a message that was not interrupted, a number out of range, a message over :data:`MAX_MESSAGE_BYTES`."""
    if role not in SOURCES:
        raise ValueError(f"role must be 'user', 'assistant' or 'tool', not {role!r:.40}")
    message: dict[str, Any] = {
        "message_id": message_id,
        "role": role,
        "content": _text(content, "content"),
        "turn_id": turn_id,
        "timestamp": check_integer(timestamp, "timestamp", 0, MAX_INT),
    }
    if tokens is not None:
        message["tokens"] = check_integer(tokens, "tokens", 0, MAX_TOKENS)
    metadata = _metadata(
        str(role),
        source=source,
        interrupted=interrupted,
        original=original,
        interrupt_timestamp=interrupt_timestamp,
        agent=agent,
    )
    if metadata:
        message["metadata"] = metadata
    encoded = orjson.dumps(message)
    if len(encoded) > MAX_MESSAGE_BYTES:
        raise ValueError(f"the message is {len(encoded):,} bytes as JSON; the limit is {MAX_MESSAGE_BYTES:,}")
    return encoded


def _metadata(
    role: str,
    *,
    source: object,
    interrupted: object,
    original: object,
    interrupt_timestamp: object,
    agent: object,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    if source is not None:
        if source not in SOURCES[role]:
            allowed = ", ".join(sorted(SOURCES[role]))
            raise ValueError(f"source {source!r:.40} does not fit role {role!r} (allowed: {allowed})")
        metadata["source"] = source
    if not isinstance(interrupted, bool):
        raise ValueError("interrupted must be True or False")
    if interrupted:
        if role != "assistant":
            raise ValueError("only an assistant message can be interrupted")
        metadata["interrupted"] = True
        if interrupt_timestamp is not None:
            metadata["interrupt_timestamp"] = check_integer(
                interrupt_timestamp, "interrupt_timestamp", 0, MAX_INT
            )
        if original is not None:
            metadata["original"] = _text(original, "original")
    elif interrupt_timestamp is not None or original is not None:
        raise ValueError(
            "original and interrupt_timestamp exist only on interrupted messages (interrupted=True)"
        )
    if agent is not None:
        metadata["agent"] = check_name(agent, "agent")
    return metadata


@dataclass(frozen=True, slots=True)
class TranscriptMessage:
    """One message of a transcript, as the service returns it (the platform layout).

    ``timestamp`` (and ``interrupt_timestamp``) are epoch milliseconds while the conversation is open, and
    milliseconds from its start once it ended (see :attr:`History.times`)."""

    role: str
    content: str
    turn_id: int
    timestamp: int
    source: str
    message_id: str | None = None
    tokens: int | None = None
    interrupted: bool = False
    interrupt_timestamp: int | None = None
    #: What the model generated, of an interrupted message (``content`` is what was actually spoken).
    original: str | None = None
    agent: str | None = None

    @classmethod
    def _of(cls, answer: _wire.MessageAnswer) -> TranscriptMessage:
        meta = answer.metadata
        return cls(
            role=answer.role,
            content=answer.content,
            turn_id=answer.turn_id,
            timestamp=answer.timestamp,
            source=meta.source,
            message_id=answer.message_id,
            tokens=answer.tokens,
            interrupted=meta.interrupted,
            interrupt_timestamp=meta.interrupt_timestamp,
            original=meta.original,
            agent=meta.agent,
        )

    def to_dict(self) -> dict[str, Any]:
        """The platform layout (a new dict): what the service sent, ``interrupted`` only when true."""
        metadata: dict[str, Any] = {"source": self.source}
        if self.interrupted:
            metadata["interrupted"] = True
            for name in ("interrupt_timestamp", "original"):
                if getattr(self, name) is not None:
                    metadata[name] = getattr(self, name)
        if self.agent is not None:
            metadata["agent"] = self.agent
        out: dict[str, Any] = {"role": self.role, "content": self.content, "turn_id": self.turn_id}
        out["timestamp"] = self.timestamp
        if self.message_id is not None:
            out["message_id"] = self.message_id
        if self.tokens is not None:
            out["tokens"] = self.tokens
        out["metadata"] = metadata
        return out

    def to_openai(self) -> dict[str, str]:
        """``{"role", "content"}``: what an OpenAI-style chat client takes (what was actually spoken)."""
        return {"role": self.role, "content": self.content}


def _messages(answers: list[_wire.MessageAnswer]) -> tuple[TranscriptMessage, ...]:
    return tuple(TranscriptMessage._of(m) for m in answers)


def _chat(answers: list[_wire.ChatAnswer]) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(m.role, m.content) for m in answers)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """``{"role", "content"}`` of a user or assistant message (tool results are left out)."""

    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class History:
    """``await conv.history()``: one page of the transcript, in order."""

    conversation_id: str
    #: ``active``, ``idle``, ``ending`` or ``ended``.
    status: str
    #: The latest turn id of the conversation (-1 before the first message).
    turn_id: int
    started_at: str
    #: ``epoch_ms`` while the conversation is open; ``offset_ms`` (from its start) once it ended.
    times: str
    messages: tuple[TranscriptMessage, ...]
    #: Pass as ``after_turn`` for the next page; None on the last one.
    next_after_turn: int | None
    #: Messages this conversation added that the service did not have when it answered (still being sent,
    #: or kept in the outbox).
    unsent: int = 0

    def to_openai(self) -> list[dict[str, str]]:
        """The user and assistant messages as ``{"role", "content"}`` dicts (new ones)."""
        return [m.to_openai() for m in self.messages if m.role != "tool"]


@dataclass(frozen=True, slots=True)
class ContextSummary:
    """The agent's own summary of older turns (``provenance: agent_summary``)."""

    text: str
    through_turn: int
    tokens: int
    #: ``client`` (the tokens given with the summary) or ``estimate``.
    token_source: str


@dataclass(frozen=True, slots=True)
class ContextProfile:
    """The caller's memory (``provenance: caller_memory``), within a quarter of the budget."""

    fields: Mapping[str, Any]
    tokens: int
    #: Fields left out to keep the profile within its cap.
    omitted: tuple[str, ...]
    #: State keys this call does not qualify for (caller-ID trust): left out whether or not the caller has
    #: them.
    withheld: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RecentTurns:
    """The most recent whole turns after the summary that fit (``provenance: transcript``)."""

    messages: tuple[ChatMessage, ...]
    tokens: int
    #: ``client``, ``estimate`` or ``mixed``.
    token_source: str
    from_turn: int | None
    to_turn: int | None
    #: Unsummarised turns that did not fit, oldest first.
    dropped_turns: int


@dataclass(frozen=True, slots=True)
class Context:
    """``await conv.context(max_tokens=...)``: the context of one inference, each section with its
    provenance and token count."""

    conversation_id: str
    status: str
    max_tokens: int
    #: The sum of the sections' tokens (at most ``max_tokens``).
    tokens: int
    #: Tokens of every turn after the summary.
    unsummarized_tokens: int
    #: True once the unsummarised turns pass 75% of ``max_tokens``: time for ``set_summary()``.
    needs_summary: bool
    profile: ContextProfile
    summary: ContextSummary | None
    recent_turns: RecentTurns
    #: Messages this conversation added that the service did not have when it answered.
    unsent: int = 0

    def to_openai(self) -> list[dict[str, str]]:
        """The recent turns as ``{"role", "content"}`` dicts (new ones), oldest first."""
        return [m.to_dict() for m in self.recent_turns.messages]


@dataclass(frozen=True, slots=True)
class TranscriptInfo:
    """A conversation's transcript status and counters (the answer to ``await conv.set_summary()``)."""

    conversation_id: str
    status: str
    channel: str
    agent: str | None
    started_at: str
    last_activity_at: str
    turn_id: int
    messages: int
    tokens: int
    bytes: int
    #: The last turn the summary covers, and its tokens (None without a summary).
    summary_through_turn: int | None
    summary_tokens: int | None
    #: ``explicit``, ``inactivity`` or ``superseded`` once it ended.
    ended_by: str | None
    end_reason: str | None
    #: The end's memory write and analytics are done.
    end_processed: bool
    expires_at: str

    @classmethod
    def _of(cls, answer: _wire.StatusAnswer) -> TranscriptInfo:
        return cls(
            conversation_id=answer.conversation_id,
            status=answer.status,
            channel=answer.channel,
            agent=answer.agent,
            started_at=answer.started_at,
            last_activity_at=answer.last_activity_at,
            turn_id=answer.turn_id,
            messages=answer.messages,
            tokens=answer.tokens,
            bytes=answer.bytes,
            summary_through_turn=answer.summary.through_turn if answer.summary else None,
            summary_tokens=answer.summary.tokens if answer.summary else None,
            ended_by=answer.ended_by,
            end_reason=answer.end_reason,
            end_processed=answer.end_processed,
            expires_at=answer.expires_at,
        )


@dataclass(frozen=True, slots=True)
class Resume:
    """``conv.resume``: the caller's previous conversation on this channel, which dropped (it ended by
    inactivity, was superseded by this one, or ended with ``end_reason="dropped"``) within the project's
    ``resume_window``. Read-only: ``state`` is a read-only mapping of a copy."""

    conversation_id: str
    channel: str
    ended_by: str | None
    end_reason: str | None
    #: Its last activity, rounded down to the hour.
    last_activity_at: str
    #: The agent's summary of it, if one was stored, and the last turn it covers.
    summary: str | None
    summary_through_turn: int | None
    #: Its last turns (times in milliseconds from that conversation's start).
    last_turns: tuple[TranscriptMessage, ...]
    #: Its last state checkpoint (``conv.state`` as last sent), or None.
    state: Mapping[str, Any] | None = field(default=None, hash=False)
    #: State keys left out of ``state`` because this call does not qualify for them (caller-ID trust); the
    #: summary and the last turns are left out too when it does not qualify for the ``sensitive`` class.
    withheld: tuple[str, ...] = ()

    @classmethod
    def _of(cls, answer: _wire.ResumeAnswer) -> Resume:
        summary = answer.summary
        return cls(
            conversation_id=answer.conversation_id,
            channel=answer.channel,
            ended_by=answer.ended_by,
            end_reason=answer.end_reason,
            last_activity_at=answer.last_activity_at,
            summary=summary.text if summary else None,
            summary_through_turn=summary.through_turn if summary else None,
            last_turns=_messages(answer.last_turns),
            state=None if answer.state is None else MappingProxyType(copy.deepcopy(answer.state)),
            withheld=tuple(answer.withheld),
        )

    def to_openai(self) -> list[dict[str, str]]:
        """The last turns' user and assistant messages as ``{"role", "content"}`` dicts (new ones)."""
        return [m.to_openai() for m in self.last_turns if m.role != "tool"]


@dataclass(frozen=True, slots=True)
class TranscriptError:
    """A batch of messages (or its state checkpoint) the service refused for good: it was the caller's
    error (an invalid value, a limit passed, a message id reused with another body), or the conversation is
    over (ended, expired, deleted). It is dropped, logged and recorded in ``conv.transcript_errors``; it is
    never retried and never counts as an outage."""

    conversation_id: str
    #: The HTTP status of the refusal (None when the SDK refused it itself, e.g. a checkpoint too large).
    status: int | None
    #: Why, as the service said it (masked like every log line).
    reason: str
    #: The ids of the messages dropped (empty when only the checkpoint was).
    message_ids: tuple[str, ...] = ()
    #: True when the state checkpoint was dropped (the messages may have been sent without it).
    state: bool = False


def history_of(answer: _wire.HistoryAnswer, unsent: int) -> History:
    return History(
        conversation_id=answer.conversation_id,
        status=answer.status,
        turn_id=answer.turn_id,
        started_at=answer.started_at,
        times=answer.times,
        messages=_messages(answer.contents),
        next_after_turn=answer.next_after_turn,
        unsent=unsent,
    )


def context_of(answer: _wire.ContextAnswer, unsent: int) -> Context:
    sections = answer.sections
    summary = sections.summary
    recent = sections.recent_turns
    return Context(
        conversation_id=answer.conversation_id,
        status=answer.status,
        max_tokens=answer.max_tokens,
        tokens=answer.tokens,
        unsummarized_tokens=answer.unsummarized_tokens,
        needs_summary=answer.needs_summary,
        profile=ContextProfile(
            fields=MappingProxyType(copy.deepcopy(sections.profile.fields)),
            tokens=sections.profile.tokens,
            omitted=tuple(sections.profile.omitted),
            withheld=tuple(sections.profile.withheld),
        ),
        summary=None
        if summary is None
        else ContextSummary(summary.text, summary.through_turn, summary.tokens, summary.token_source),
        recent_turns=RecentTurns(
            messages=_chat(recent.messages),
            tokens=recent.tokens,
            token_source=recent.token_source,
            from_turn=recent.from_turn,
            to_turn=recent.to_turn,
            dropped_turns=recent.dropped_turns,
        ),
        unsent=unsent,
    )
