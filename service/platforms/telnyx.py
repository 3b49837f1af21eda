"""Telnyx's webhooks to a project (SPEC section 15, the Telnyx rows; the routes: service/http/telnyx_routes.py;
the guide: docs/telnyx.md).

Telnyx signs every webhook with the account's Ed25519 key: ``telnyx-signature-ed25519`` is the base64 signature
of ``<telnyx-timestamp>|<raw body>``, the timestamp in unix seconds (telnyx 4.189.0
``telnyx/resources/webhooks.py``, ``unwrap``). It is checked before anything of the body is parsed, against
the connection's ``options.public_key``; the timestamp must lie within :data:`WINDOW` of now, past or future
(the SDK refuses more than 300 s either way).

- The AI Assistant's dynamic-variables webhook (``assistant.initialization``, the assistant's
  ``dynamic_variables_webhook_url``): ``data.payload`` names the end user (``telnyx_end_user_target``), whether
  Telnyx verified their number at attestation A (``telnyx_end_user_target_verified``), the call
  (``call_control_id``; ``call_session_id`` where sent). The answer is ``{"dynamic_variables": {...}}``
  (telnyx ``types/ai/assistant_create_params.py``, ``dynamic_variables_webhook_url``: a flat object is
  ignored), within ``dynamic_variables_webhook_timeout_ms`` (default 1500).
- The call events (the Call Control or TeXML application's webhook URL), each ``{"data": {"id",
  "event_type", "occurred_at", "payload"}}``: ``call.initiated`` (``shaken_stir_attestation`` and
  ``shaken_stir_validated``: the call's attestation), ``call.hangup`` (``hangup_cause``; an end without the
  analysis), ``call.conversation.ended`` (the transcript; an end without the analysis) and
  ``call.conversation_insights.generated`` (the insights: the end). Others are acknowledged and change
  nothing. An event's id for replays is ``data.id``.

The conversation of a call is ``telnyx:<call_session_id>``. The dynamic-variables webhook as Telnyx documents
it names only ``call_control_id``: without ``call_session_id`` its conversation is ``telnyx:leg:<digest of
call_control_id>`` (a control id may hold characters a conversation id may not), and every event, which names
both, finds whichever of the two started.

What each payload holds is read by lenient models of Caller Memory's own (telnyx's types are ``Literal``s where
Telnyx may add values later: such a value must not make a webhook fail).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..domain.errors import InvalidInput, MalformedRequest
from ..domain.limits import CONVERSATION_ID_PATTERN
from ..domain.platforms.records import CallEnd, EndReason, SpokenMessage, cut
from ..domain.platforms.verification import SignatureRefused, Window, check_ed25519, check_window

PLATFORM = "telnyx"
SIGNATURE_HEADER = "telnyx-signature-ed25519"
TIMESTAMP_HEADER = "telnyx-timestamp"
#: How far from now a webhook's ``telnyx-timestamp`` may be, past or future (the SDK's 300 s).
WINDOW_MS = 5 * 60_000
WINDOW = Window(past_ms=WINDOW_MS, future_ms=WINDOW_MS)
#: How long an event's id is kept: a redelivery of the same event inside it is answered as a duplicate.
EVENT_KEEP_MS = 24 * 3_600_000
#: How long the dynamic-variables webhook may take before it is answered (Telnyx waits 1.5 s by default,
#: then goes on with the variables' defaults).
START_BUDGET_S = 1.2
#: How long the dynamic-variables answer waits for the call's ``call.initiated`` (its attestation), which
#: Telnyx sends to another URL at about the same time, in no set order.
ATTESTATION_WAIT_S = 0.2

INITIALIZATION = "assistant.initialization"
INITIATED = "call.initiated"
HANGUP = "call.hangup"
CONVERSATION_ENDED = "call.conversation.ended"
INSIGHTS = "call.conversation_insights.generated"

_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)
_TIMESTAMP = re.compile(r"\d{1,12}", re.ASCII)

#: ``messages[].role`` of ``call.conversation.ended`` -> the stored role (telnyx
#: ``types/call_conversation_ended.py`` ``PayloadMessage.role``: ``user``, ``assistant``, ``tool``, ``system``,
#: ``developer``). ``system`` and ``developer`` entries (idle check-ins, notices) are not kept, nor are
#: ``tool_calls`` (the tools' arguments).
ROLES: Mapping[str, str] = {"user": "user", "assistant": "assistant", "tool": "tool"}

#: ``call.hangup`` ``hangup_cause`` -> ``end_reason`` (telnyx ``types/call_hangup.py``, 9 values).
#: ``completed``: a party hung up, or the dial's outcome left nothing to talk to; ``dropped``: cut off by a
#: timeout or a limit. ``unspecified`` and a value not in the table: no ``end_reason``.
END_REASONS: Mapping[str, EndReason] = {
    "normal_clearing": "completed",
    "originator_cancel": "completed",
    "call_rejected": "completed",
    "user_busy": "completed",
    "no_answer": "completed",
    "not_found": "completed",
    "timeout": "dropped",
    "time_limit": "dropped",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Message(_Model):
    """``PayloadMessage``: what was said; ``tool_calls`` and ``timestamp`` are never read."""

    role: str | None = None
    content: str | None = None


class Insight(_Model):
    """``PayloadResult`` of the insights event."""

    insight_id: str | None = None
    result: Any = None


class Payload(_Model):
    """What Caller Memory reads of the payloads it takes (every member optional, as in telnyx's types)."""

    call_control_id: str | None = None
    call_session_id: str | None = None
    # assistant.initialization
    telnyx_end_user_target: str | None = None
    telnyx_end_user_target_verified: bool | None = None
    # call.initiated
    direction: str | None = None
    shaken_stir_attestation: str | None = None
    shaken_stir_validated: bool | None = None
    # call.initiated, call.hangup, call.conversation.ended
    from_: str | None = Field(default=None, alias="from")
    start_time: str | None = None
    # call.hangup
    hangup_cause: str | None = None
    # call.conversation.ended
    messages: list[Message] | None = None
    # call.conversation_insights.generated
    results: list[Insight] | None = None


class Data(_Model):
    id: str | None = None
    event_type: str
    occurred_at: str | None = None
    payload: Payload = Field(default_factory=Payload)


class Envelope(_Model):
    data: Data


# Verification -------------------------------------------------------------------------------------------------


def verify(
    public_key: str | None, body: bytes, signature: str | None, timestamp: str | None, now_ms: int
) -> int:
    """Refuse (401) a webhook not signed by ``public_key`` as Telnyx signs, or signed more than
    :data:`WINDOW_MS` from ``now_ms``, before anything of it is parsed. Returns the signed time (ms)."""
    if not signature:
        raise SignatureRefused(f"the {PLATFORM} webhook is not signed")
    stamp = (timestamp or "").strip()
    if not _TIMESTAMP.fullmatch(stamp):
        raise SignatureRefused(f"the {PLATFORM} webhook's {TIMESTAMP_HEADER} is missing or not unix seconds")
    check_ed25519(public_key, stamp.encode("ascii") + b"|" + body, signature, platform=PLATFORM)
    signed_at = int(stamp) * 1000
    check_window(signed_at, now_ms, WINDOW, platform=PLATFORM)
    return signed_at


# Parsing ------------------------------------------------------------------------------------------------------


def read(body: bytes) -> Data:
    """The verified webhook's ``data``; a body that is not one is refused naming what is wrong, never
    echoing it."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedRequest("the webhook's body is not JSON") from None
    try:
        return Envelope.model_validate(document).data
    except ValidationError as exc:
        where = ".".join(str(p) for p in exc.errors()[0]["loc"]) or "body"
        raise InvalidInput(f"the webhook's {where} is missing or malformed", field=where) from None


def _checked(conversation: str, where: str) -> str:
    if not _CONVERSATION_ID.match(conversation):
        raise InvalidInput(f"the webhook's {where} is malformed", field=where)
    return conversation


def conversations_of(payload: Payload) -> tuple[str | None, str | None]:
    """The call's two possible conversations: ``telnyx:<call_session_id>`` and ``telnyx:leg:<digest of
    call_control_id>`` (None for the id the payload does not name)."""
    session = (payload.call_session_id or "").strip()
    leg = (payload.call_control_id or "").strip()
    by_session = _checked(f"{PLATFORM}:{session}", "data.payload.call_session_id") if session else None
    by_leg = None
    if leg:
        by_leg = f"{PLATFORM}:leg:{hashlib.sha256(leg.encode()).hexdigest()[:32]}"
    return by_session, by_leg


def start_conversation(payload: Payload) -> str:
    """The conversation a dynamic-variables webhook starts: by session where it names one, else by leg."""
    by_session, by_leg = conversations_of(payload)
    chosen = by_session or by_leg
    if chosen is None:
        raise InvalidInput(
            "the webhook's data.payload names neither call_session_id nor call_control_id",
            field="data.payload.call_control_id",
        )
    return chosen


def attestation_of(payload: Payload) -> str | None:
    """``call.initiated``'s attestation: the level (``A``, ``B``, ``C``) when Telnyx validated it, ``failed``
    when it did not; None (unknown) without a level, or with one whose validation is not said (an unverified
    level is only what the originating carrier claims)."""
    level = (payload.shaken_stir_attestation or "").strip().upper()
    if level not in ("A", "B", "C"):
        return None
    if payload.shaken_stir_validated is True:
        return level
    return "failed" if payload.shaken_stir_validated is False else None


def initialization_attestation(payload: Payload) -> str | None:
    """The dynamic-variables webhook's own word: ``telnyx_end_user_target_verified`` is true only for a call
    with full (A) attestation whose PASSporT Telnyx verified; false says nothing more (B, C, none)."""
    return "A" if payload.telnyx_end_user_target_verified is True else None


def _ms(text: str | None) -> float | None:
    """An ISO 8601 time as unix milliseconds (None when absent or not a time)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000.0
    except ValueError:
        return None


def messages_of(payload: Payload) -> list[SpokenMessage]:
    """``messages`` in order, user, assistant and tool (:data:`ROLES`); other roles and empty messages are
    left out; a message past the stored size is cut."""
    kept: list[SpokenMessage] = []
    for message in payload.messages or []:
        role = ROLES.get(message.role or "")
        if role is not None and message.content and message.content.strip():
            kept.append(SpokenMessage(role, cut(message.content)))
    return kept


def extracted_of(payload: Payload) -> dict[str, Any]:
    """What ``state_map`` and ``analysis_qa_key`` name: each insight's result under its ``insight_id``, and
    the members of a result that is an object by their own names (an insight's instructions choose them)."""
    extracted: dict[str, Any] = {}
    by_id: dict[str, Any] = {}
    for insight in payload.results or []:
        if isinstance(insight.result, Mapping):
            extracted.update(insight.result)
        if insight.insight_id and insight.result not in (None, ""):
            by_id[insight.insight_id] = insight.result
    return {**extracted, **by_id}


def end_of(data: Data, conversation_id: str, caller: str) -> CallEnd:
    """An end event: ``call.hangup`` and ``call.conversation.ended`` without the analysis (held for it),
    ``call.conversation_insights.generated`` with it (the end)."""
    payload = data.payload
    return CallEnd(
        platform=PLATFORM,
        conversation_id=conversation_id,
        caller=caller,
        messages=messages_of(payload) if data.event_type == CONVERSATION_ENDED else (),
        extracted=extracted_of(payload) if data.event_type == INSIGHTS else {},
        ended_at=_ms(data.occurred_at) if data.event_type != INSIGHTS else None,
        started_at=_ms(payload.start_time),
        end_reason=END_REASONS.get(payload.hangup_cause or "") if data.event_type == HANGUP else None,
        carries_analysis=data.event_type == INSIGHTS,
    )


def caller_of(payload: Payload) -> str:
    """The number an event names as the caller (``from``; the insights event names none)."""
    return (payload.from_ or "").strip()


# The answer ---------------------------------------------------------------------------------------------------


def variables_answer(variables: dict[str, str]) -> dict[str, Any]:
    """The body of the dynamic-variables answer."""
    return {"dynamic_variables": variables}
