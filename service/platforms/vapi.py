"""Vapi's server messages to a project (SPEC section 15, "Vapi"; the route: service/http/vapi_routes.py).

Vapi posts every server message of an assistant to one Server URL as ``{"message": {"type": ..., ...}}``. The
fields read here are those of ``vapi-server-sdk`` 3.0.0 (``vapi/types/server_message_assistant_request.py``,
``server_message_status_update.py``, ``server_message_end_of_call_report.py``, ``artifact.py``,
``analysis.py``, ``call.py``, ``create_customer_dto.py``); unknown fields are ignored and nothing sent is
echoed in an error.

Authentication, by the connection's ``auth`` option (``VapiOptions``):

- ``hmac`` (Vapi's HMAC credential with its defaults, ``HmacAuthenticationPlan``): ``x-signature`` is the hex
  HMAC-SHA256, with the connection's secret, of ``"{x-timestamp}.{raw body}"``; checked before anything is
  parsed, ``x-timestamp`` within :data:`WINDOW_MS` of now (its unit is not documented: an integer above
  10^12 is read as milliseconds, below as seconds, and an ISO 8601 time is read too). Vapi sends no event id,
  so the replay key is the signature itself (one per timestamp and body), kept as long as the window.
- ``bearer``: ``Authorization: Bearer <platform token>`` of the project (a fixed credential: replayable, as Vapi
  documents it).

Messages:

- ``assistant-request``: the call starts (conversation ``vapi:<call.id>``, caller ``call.customer.number``
  or ``customer.number``); the answer names the connection's assistant with the variables
  (:func:`assistant_answer`), within :data:`START_BUDGET_S`.
- ``status-update`` with ``status: ended``: the end without the analysis (held for it).
- ``end-of-call-report``: the end with the analysis: ``artifact.messages`` (:func:`spoken`),
  ``analysis.summary``, ``analysis.structuredData`` (extracted, mapped by ``state_map``), ``endedReason``
  (:func:`end_reason`), ``destination`` (its ``name`` as the handoff label), ``startedAt`` and ``endedAt``.
- Anything else (``conversation-update``, ``speech-update``, ``transcript``, ``hang``, ``tool-calls``, ...):
  acknowledged, nothing read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from ..domain.errors import InvalidInput, MalformedRequest
from ..domain.limits import CONVERSATION_ID_PATTERN
from ..domain.platforms.records import CallEnd, CallStart, EndReason, SpokenMessage
from ..domain.platforms.verification import Window, check_hmac_sha256

PLATFORM = "vapi"
SIGNATURE_HEADER = "x-signature"
TIMESTAMP_HEADER = "x-timestamp"
PREFIX = "vapi:"
#: How far from now ``x-timestamp`` may be (past and future).
WINDOW_MS = 5 * 60_000
WINDOW = Window(past_ms=WINDOW_MS, future_ms=WINDOW_MS)
#: How long the start may take: Vapi's deadline for the answer to ``assistant-request`` is 7.5 s end to end
#: (fixed; VapiAI/docs fern/server-url/events.mdx), and the telephony leg waits meanwhile.
START_BUDGET_S = 1.0
#: An integer ``x-timestamp`` above this is in milliseconds, else in seconds (10^12 ms is 2001; 10^12 s is
#: beyond the year 30000).
_MS_ABOVE = 10**12
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)
#: An ``x-timestamp`` that is a number (integer or decimal).
_NUMBER = re.compile(r"[0-9]{1,16}(\.[0-9]{1,6})?", re.ASCII)

# --- endedReason -> end_reason ----------------------------------------------------------------------------
# Vapi's ``endedReason`` is an enum of about 600 values (``ServerMessageEndOfCallReportEndedReason``, the same
# in ``ServerMessageStatusUpdateEndedReason`` and ``CallEndedReason``), most of them one per provider error.
# They are classified by rules, the first that matches wins; a value no rule matches has no end_reason.
#: (how the rule matches, the text, the class) in order. ``prefix``: the value starts with it; ``part``: it
#: holds it; ``exact``: it is it.
END_RULES: tuple[tuple[Literal["prefix", "part", "exact"], str, EndReason], ...] = (
    # A forward that did not connect (operator busy, no answer): the call ended without the transfer.
    ("prefix", "call.forwarding.", "dropped"),
    # Every provider, pipeline and start error, warm-transfer errors included.
    ("part", "error", "dropped"),
    ("part", "failed", "dropped"),
    # The caller hung up (before, during or after a transfer attempt too).
    ("prefix", "customer-ended-call", "completed"),
    # Forwarded or transferred: by the assistant, by a hook, or by the assistant-request's answer.
    ("part", "forward", "transferred"),
    ("part", "transfer", "transferred"),
    # The assistant ended the call, or the provider reports the call completed.
    ("prefix", "assistant-ended-call", "completed"),
    ("exact", "assistant-said-end-call-phrase", "completed"),
    ("part", "completed", "completed"),
    ("part", "hook-executed-say", "completed"),
    # Cut: silence, a time limit, the line or the worker gone, the assistant not joining or not usable.
    ("part", "timed-out", "dropped"),
    ("exact", "exceeded-max-duration", "dropped"),
    ("part", "disconnected", "dropped"),
    ("part", "closed-websocket", "dropped"),
    ("part", "released-call", "dropped"),
    ("part", "hungup-before-call-connect", "dropped"),
    ("exact", "worker-shutdown", "dropped"),
    ("exact", "customer-did-not-give-microphone-permission", "dropped"),
    ("prefix", "assistant-request-returned-", "dropped"),
    ("prefix", "assistant-not-", "dropped"),
)
# Not matched (no end_reason): calls that never reached a conversation (customer-busy, customer-did-not-answer,
# voicemail, vonage-rejected, twilio-reported-customer-misdialed, sip-outbound-unallocated-number,
# phone-call-provider-bypass-enabled-but-no-call-received, manually-canceled, call-deleted,
# scheduled-call-deleted), and any value Vapi adds (its docs' example "hangup" is not in the enum).


def end_reason(ended_reason: str | None) -> EndReason | None:
    """``endedReason`` classified by :data:`END_RULES` (None when no rule matches)."""
    if not ended_reason:
        return None
    for how, text, reason in END_RULES:
        if (
            (how == "prefix" and ended_reason.startswith(text))
            or (how == "part" and text in ended_reason)
            or (how == "exact" and ended_reason == text)
        ):
            return reason
    return None


# --- roles ------------------------------------------------------------------------------------------------
#: ``artifact.messages[].role`` -> the transcript's role. Vapi's ``role`` is a free string (``UserMessage``,
#: ``BotMessage``, ``SystemMessage``, ``ToolCallMessage``, ``ToolCallResultMessage`` in
#: vapi/types/artifact_messages_item.py): ``bot`` in the artifact, ``assistant`` in its docs' examples.
#: ``system`` and the tool calls (``tool_calls``: their arguments) are never stored.
ROLES: Mapping[str, str] = {
    "user": "user",
    "bot": "assistant",
    "assistant": "assistant",
    "tool_call_result": "tool",
    "tool": "tool",
}


# --- the models of what is read -----------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Customer(_Model):
    number: str | None = None


class Call(_Model):
    id: str | None = None
    customer: Customer | None = None
    startedAt: str | None = None
    endedAt: str | None = None


class Item(_Model):
    """One of ``artifact.messages``: text in ``message`` (a tool result's in ``result``)."""

    role: str = ""
    message: str | None = None
    result: str | None = None
    toolCallId: str | None = None


class Artifact(_Model):
    messages: list[Item] = []


class Analysis(_Model):
    summary: str | None = None
    structuredData: dict[str, Any] | None = None


class Destination(_Model):
    type: str | None = None
    name: str | None = None
    assistantName: str | None = None


class Message(_Model):
    """The server message: the parts of ``assistant-request``, ``status-update`` and ``end-of-call-report``
    Caller Memory reads."""

    type: str
    timestamp: float | None = None
    call: Call | None = None
    customer: Customer | None = None
    status: str | None = None
    endedReason: str | None = None
    artifact: Artifact | None = None
    messages: list[Item] | None = None
    analysis: Analysis | None = None
    destination: Destination | None = None
    startedAt: str | None = None
    endedAt: str | None = None


class Envelope(_Model):
    message: Message


# --- verification -----------------------------------------------------------------------------------------


def verify(secret: str | None, body: bytes, signature: str | None, timestamp: str | None) -> None:
    """Refuse (401) a message not signed as Vapi's HMAC credential signs by default, before it is parsed."""
    signed = (timestamp or "").encode("utf-8", "surrogateescape") + b"." + body
    check_hmac_sha256(secret, signed, signature, platform=PLATFORM)


def signed_time_ms(timestamp: str | None) -> int | None:
    """``x-timestamp`` in milliseconds: an integer in milliseconds or seconds, or an ISO 8601 time (None when
    it is none of them). A decimal number is read the same way."""
    if not timestamp:
        return None
    text = timestamp.strip()
    if _NUMBER.fullmatch(text):
        value = float(text)
        return int(value if value > _MS_ABOVE else value * 1000)
    return _iso_ms(text)


def replay_key(signature: str) -> str:
    """The event id of a signed message (Vapi sends none): its signature, one per timestamp and body."""
    return "sig:" + signature.strip().lower()[:128]


def _iso_ms(text: str | None) -> int | None:
    if not text or len(text) > 40:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return int(parsed.timestamp() * 1000)


# --- parsing ----------------------------------------------------------------------------------------------


def read_message(body: bytes) -> Message:
    """The verified body's message; a body that is not one is refused naming what is wrong, never echoing it."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedRequest("the server message is not JSON") from None
    try:
        return Envelope.model_validate(document).message
    except ValidationError as exc:
        where = ".".join(str(p) for p in exc.errors()[0]["loc"]) or "body"
        raise InvalidInput(f"the server message's {where} is missing or malformed", field=where) from None


def conversation_of(message: Message) -> str:
    """``vapi:<call.id>`` (422 naming ``message.call.id`` when it is missing or not an id)."""
    call_id = message.call.id if message.call is not None else None
    conversation = PREFIX + call_id if call_id else ""
    if not call_id or not _CONVERSATION_ID.match(conversation):
        raise InvalidInput(
            "the server message's message.call.id is missing or not a call id", field="message.call.id"
        )
    return conversation


def caller_of(message: Message) -> str:
    """The caller's number: ``call.customer.number``, else ``customer.number`` ("" for a web call)."""
    for customer in (message.call.customer if message.call else None, message.customer):
        if customer is not None and customer.number:
            return customer.number
    return ""


def call_start(message: Message) -> CallStart:
    """An ``assistant-request``'s call start (Vapi sends no attestation)."""
    return CallStart(PLATFORM, conversation_of(message), caller_of(message), budget_s=START_BUDGET_S)


def assistant_answer(assistant_id: str, variables: Mapping[str, str]) -> dict[str, Any]:
    """The answer to ``assistant-request`` (``ServerMessageResponseAssistantRequest``, unwrapped as Vapi's docs
    show it): the connection's assistant with the variables as ``assistantOverrides.variableValues``."""
    return {"assistantId": assistant_id, "assistantOverrides": {"variableValues": dict(variables)}}


def spoken(items: Sequence[Item]) -> list[SpokenMessage]:
    """The transcript's messages, in Vapi's list order: user, assistant (``bot``) and tool results (their
    ``result``); system messages and tool calls never."""
    kept: list[SpokenMessage] = []
    for item in items:
        role = ROLES.get(item.role)
        if role is None and item.toolCallId is not None and item.result is not None:
            role = "tool"
        if role is None:
            continue
        text = item.result if role == "tool" and item.result is not None else item.message
        if text:
            kept.append(SpokenMessage(role, text))
    return kept


def _transfer_label(destination: Destination | None) -> str | None:
    if destination is None:
        return None
    return destination.name or destination.assistantName


EndKind = Literal["status", "report"]


@dataclass(frozen=True, slots=True)
class EndEvent:
    end: CallEnd
    kind: EndKind


def call_end(message: Message) -> EndEvent | None:
    """The end a ``status-update`` (``ended``) or an ``end-of-call-report`` brings; None for any other
    message (nothing to do)."""
    if message.type == "end-of-call-report":
        kind: EndKind = "report"
    elif message.type == "status-update" and message.status == "ended":
        kind = "status"
    else:
        return None
    call = message.call
    items = (message.artifact.messages if message.artifact else None) or message.messages or []
    analysis = message.analysis if kind == "report" else None
    started = _iso_ms(message.startedAt) or _iso_ms(call.startedAt if call else None)
    ended = _iso_ms(message.endedAt) or _iso_ms(call.endedAt if call else None)
    if ended is None and kind == "status" and message.timestamp is not None:
        ended = int(message.timestamp)
    end = CallEnd(
        platform=PLATFORM,
        conversation_id=conversation_of(message),
        caller=caller_of(message),
        messages=spoken(items),
        summary=(analysis.summary or None) if analysis else None,
        extracted=dict(analysis.structuredData or {}) if analysis else {},
        ended_at=ended,
        started_at=started,
        end_reason=end_reason(message.endedReason),
        transfer_label=_transfer_label(message.destination),
        carries_analysis=kind == "report",
    )
    return EndEvent(end, kind)
