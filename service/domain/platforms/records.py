"""The platform-neutral records an adapter hands the ingestion use case (service/domain/platforms/
ingestion.py), and the rules of SPEC 15 that need no store: extracted data mapped through ``state_map`` onto
the checkpoint (a null, empty or missing value never deletes), a platform's time in its unit and clamped, the
transfer label kept only when it is not a phone number, messages kept to their text.

An adapter parses its vendor's payload (after verification) into :class:`CallStart` and :class:`CallEnd`;
nothing vendor-shaped reaches the domain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..id_rules import holds_phone_number
from ..redaction import enough_digits

#: The roles whose messages a platform's transcript gives (others, such as tool calls' arguments, never).
KEPT_ROLES = ("user", "assistant", "tool")
#: The most of one message's text (and of its ``original``) an end keeps: a stored message holds at most
#: 16 KiB (conversations/messages.py MAX_MESSAGE_BYTES), and one long utterance must not refuse the whole end.
MAX_SPOKEN_BYTES = 7_000


def cut(text: str) -> str:
    """``text`` within :data:`MAX_SPOKEN_BYTES` of UTF-8, cut at a character's boundary."""
    encoded = text.encode()
    if len(encoded) <= MAX_SPOKEN_BYTES:
        return text
    return encoded[:MAX_SPOKEN_BYTES].decode("utf-8", errors="ignore")


EndReason = Literal["completed", "dropped", "transferred"]


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call starting on a platform: the conversation id the adapter made (``<platform>:<id>``), the
    caller's number as the platform sent it, and the attestation when the platform sends one."""

    platform: str
    conversation_id: str
    caller: str
    attestation: str | None = None
    #: How long the adapter may take before answering its platform (below the platform's deadline).
    budget_s: float = 1.0


@dataclass(frozen=True, slots=True)
class SpokenMessage:
    """One message of a platform's transcript, in the platform's list order. ``original``: what was said
    before an interruption cut ``content``; ``turn_id`` when the platform numbers turns."""

    role: str
    content: str
    original: str | None = None
    turn_id: int | None = None


@dataclass(frozen=True, slots=True)
class CallEnd:
    """An end event: a platform sends one or two per call (``carries_analysis``: this one has the summary
    and the extracted data, and ends the call at once; an event without it waits ``analysis_grace`` for
    one that has). ``ended_at`` and ``started_at`` as the platform sent them (seconds, milliseconds or
    microseconds: checked against the conversation's start); ``end_reason`` mapped by the adapter. ``caller``
    "" when the platform's events carry no number (Agora): the conversation's own caller, and an end for a
    conversation that never started is ignored."""

    platform: str
    conversation_id: str
    caller: str
    messages: Sequence[SpokenMessage] = ()
    summary: str | None = None
    extracted: Mapping[str, Any] = field(default_factory=dict)
    ended_at: float | None = None
    started_at: float | None = None
    end_reason: EndReason | None = None
    transfer_label: str | None = None
    carries_analysis: bool = True
    attestation: str | None = None


def kept_messages(
    platform: str, messages: Sequence[SpokenMessage], first_turn: int = 0
) -> list[dict[str, Any]]:
    """The messages an end stores, as an append's body has them: user, assistant and tool only, their text
    alone (an interrupted assistant message's ``original`` too), each within :data:`MAX_SPOKEN_BYTES`, in list
    order; ``turn_id`` the platform's,
    else one more at each user message from ``first_turn``. Each has an id derived from its place in the
    list (``<platform>-end-<n>``), so that an end run again stores nothing twice."""
    kept: list[dict[str, Any]] = []
    turn = first_turn - 1
    for index, message in enumerate(messages):
        if message.role not in KEPT_ROLES or not message.content:
            continue
        if message.turn_id is not None:
            turn = max(turn, message.turn_id, first_turn)
        elif message.role == "user" or turn < first_turn:
            turn += 1
        body: dict[str, Any] = {
            "message_id": f"{platform}-end-{index}",
            "role": message.role,
            "content": cut(message.content),
            "turn_id": turn,
        }
        if message.role == "assistant" and message.original and message.original != message.content:
            body["metadata"] = {"interrupted": True, "original": cut(message.original)}
        kept.append(body)
    return kept


def dotted(document: Mapping[str, Any], path: str) -> Any:
    """The value at ``path`` (``a.b.c``) of ``document``, or None where it stops."""
    value: Any = document
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def mapped_state(
    checkpoint: Mapping[str, Any] | None, extracted: Mapping[str, Any], state_map: Mapping[str, str]
) -> dict[str, Any]:
    """The end's state: the checkpoint, then each extracted value ``state_map`` names over it (extracted
    wins); a null, empty or missing value leaves the checkpoint's (it never deletes)."""
    state = dict(checkpoint or {})
    for path, key in state_map.items():
        value = dotted(extracted, path)
        if value is None or value == "" or value == [] or value == {}:
            continue
        state[key] = value
    return state


def qa_value(extracted: Mapping[str, Any], key: str | None) -> str | None:
    """``outcome.qa``: the ``analysis_qa_key`` value as a string (None when absent)."""
    if key is None:
        return None
    value = dotted(extracted, key)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else str(value)


def handoff_label(label: str | None, regions: Sequence[str | None]) -> str | None:
    """A transfer's label, dropped when it is, or holds, a phone number (a number is never ``handoff_to``)."""
    if not label or not label.strip():
        return None
    # A label with digits enough for a number is dropped whether or not it parses as one in ``regions``:
    # a transfer's destination is a number more often than not, and a label is worth less than a leak.
    if enough_digits(label) or holds_phone_number(label, regions):
        return None
    return label.strip()


def in_ms(value: float, reference_ms: int) -> int:
    """A platform's time in milliseconds: seconds, milliseconds or microseconds, whichever lands nearest
    ``reference_ms`` (the conversation's start: a call lasts minutes, the units differ by 1000x)."""
    candidates = (value * 1000.0, float(value), value / 1000.0)
    return int(min(candidates, key=lambda c: abs(c - reference_ms)))


def clamped(value_ms: int, start_ms: int, received_ms: int) -> tuple[int, bool]:
    """``value_ms`` within [start, received]; True when it was outside."""
    if value_ms < start_ms:
        return start_ms, True
    if value_ms > received_ms:
        return max(start_ms, received_ms), True
    return value_ms, False
