"""Retell AI's webhooks to a project (SPEC section 15, the Retell rows; the routes:
service/http/retell_routes.py; the guide: docs/retell.md).

Retell signs every webhook with the account's API key (the connection's secret): ``x-retell-signature`` is
``v=<unix ms>,d=<hex>``, the lowercase hex HMAC-SHA256 of the raw body followed by the decimal ``v``, with no
separator (retell-sdk 6.2.13 ``retell/lib/webhook_auth.py``: ``symmetric`` and ``verify``). It is checked
before anything of the body is parsed, in constant time; ``v`` must lie within :data:`WINDOW_MS` of now, past
or future, as the SDK's own ``verify`` has it.

- The inbound call webhook (``call_inbound``, set per phone number): no call yet, so the conversation is
  ``retell:<random>``; the caller is ``call_inbound.from_number``. The answer sets the prompt's dynamic
  variables and puts the conversation's id in the call's ``metadata`` (``caller_memory_conversation``),
  which Retell copies into every later event of the call.
- The call events (the agent's or the account's webhook URL): ``call_ended`` (the transcript, no analysis:
  held for the analysis) and ``call_analyzed`` (the call with ``call_analysis``: the end); ``call_started``
  and the others are acknowledged and change nothing. The conversation is ``call.metadata
  .caller_memory_conversation``, else ``retell:<call.call_id>``; each event's id for replays is
  ``<call_id>:<event>``.

What a call event's ``call`` holds is retell-sdk's ``retell.types.PhoneCallResponse`` (or
``WebCallResponse``), read here by a lenient model of its own: Retell's enumerations are strict ``Literal``s in
its SDK, and a value Retell adds later must not make a webhook fail.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from ..domain.errors import InvalidInput, MalformedRequest
from ..domain.limits import CONVERSATION_ID_PATTERN
from ..domain.platforms.records import CallEnd, EndReason, SpokenMessage
from ..domain.platforms.verification import (
    SignatureRefused,
    Window,
    check_hmac_sha256,
    check_window,
)

PLATFORM = "retell"
SIGNATURE_HEADER = "x-retell-signature"
#: How far from now a signature's ``v`` may be, past or future (retell-sdk ``FIVE_MINUTES``).
WINDOW_MS = 5 * 60_000
WINDOW = Window(past_ms=WINDOW_MS, future_ms=WINDOW_MS)
#: How long an event's id is kept: a redelivery of the same event (Retell retries each up to 3 times, each
#: signed anew) inside it is answered as a duplicate.
EVENT_KEEP_MS = 24 * 3_600_000
#: How long a call start may take before Retell is answered (Retell waits 10 s, then retries).
START_BUDGET_S = 1.0
#: Longest utterance kept, in UTF-8 bytes: a stored message is at most 16 KiB (its JSON form, escapes
#: included), and one longer would refuse the whole end; no one speaks 8,000 bytes without a pause.
MAX_UTTERANCE_BYTES = 8_000
#: The metadata member naming the conversation (set in the inbound answer; Retell copies it into the call).
METADATA_KEY = "caller_memory_conversation"

INBOUND = "call_inbound"
STARTED = "call_started"
ENDED = "call_ended"
ANALYZED = "call_analyzed"

#: ``v=<ms>,d=<64 lowercase hex>``, as retell-sdk's ``verify`` reads it (an uppercase digest fails there too).
_SIGNATURE = re.compile(r"v=(\d{1,16}),d=([0-9a-f]{64})", re.ASCII)
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)

#: ``transcript_object[].role`` -> the stored role (retell-sdk ``types/phone_call_response.py``
#: ``TranscriptObject.role``: ``agent``, ``user``, ``transfer_target``). ``transfer_target`` (the person a
#: transfer reached, neither the caller nor the agent) is not kept; ``transcript_with_tool_calls`` (tool
#: invocations and results, node transitions, DTMF) is never read.
ROLES: Mapping[str, str] = {"agent": "assistant", "user": "user"}

#: ``call.disconnection_reason`` -> ``end_reason`` (retell-sdk ``types/phone_call_response.py``
#: ``PhoneCallResponse.disconnection_reason``, 39 values, the same in ``web_call_response.py``).
#: ``completed``: the call ended as a party chose, or the dial's outcome left nothing to pick up;
#: ``dropped``: cut off by an error, a timeout or a limit (a callback is offered to resume it);
#: ``transferred``: handed to another destination or a person. A value not in the table: no ``end_reason``.
END_REASONS: Mapping[str, EndReason] = {
    # A party ended the call.
    "user_hangup": "completed",
    "agent_hangup": "completed",
    "user_requested_dnc": "completed",
    "user_requested_callback": "completed",
    "manual_stopped": "completed",
    "scam_detected": "completed",
    # Nobody to talk to: a machine answered, or the dial did not connect (nothing was said).
    "voicemail_reached": "completed",
    "ivr_reached": "completed",
    "dial_busy": "completed",
    "dial_no_answer": "completed",
    "user_declined": "completed",
    "marked_as_spam": "completed",
    "network_blocked": "completed",
    # Handed on.
    "call_transfer": "transferred",
    "transfer_bridged": "transferred",
    "call_take_over": "transferred",
    # Cut off: timeouts and limits.
    "inactivity": "dropped",
    "max_duration_reached": "dropped",
    "registered_call_timeout": "dropped",
    "transfer_cancelled": "dropped",
    # Cut off: errors (Retell's, the custom LLM's, the telephony's).
    "error_llm_websocket_open": "dropped",
    "error_llm_websocket_lost_connection": "dropped",
    "error_llm_websocket_runtime": "dropped",
    "error_llm_websocket_corrupt_payload": "dropped",
    "error_no_audio_received": "dropped",
    "error_asr": "dropped",
    "error_retell": "dropped",
    "error_unknown": "dropped",
    "error_user_not_joined": "dropped",
    "dial_failed": "dropped",
    "invalid_destination": "dropped",
    "telephony_provider_permission_denied": "dropped",
    "telephony_provider_unavailable": "dropped",
    "sip_routing_error": "dropped",
    # Cut off: the account's limits and billing.
    "concurrency_limit_reached": "dropped",
    "no_concurrency_fallback": "dropped",
    "no_valid_payment": "dropped",
    "credit_exhausted": "dropped",
    "budget_reached": "dropped",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Envelope(_Model):
    """Every Retell webhook: ``{"event": ..., ...}``."""

    event: str


class Inbound(_Model):
    """``call_inbound`` of the inbound webhook (``from_number`` and ``to_number`` always; ``agent_id``,
    ``agent_version`` when set on the number; ``call_id`` in newer deliveries, not used)."""

    from_number: str | None = None
    to_number: str | None = None
    call_id: str | None = None


class InboundEnvelope(_Model):
    event: Literal["call_inbound"]
    call_inbound: Inbound


class Utterance(_Model):
    """``TranscriptObject``: what was said; ``words`` and ``metadata`` are never read."""

    role: str
    content: str = ""


class Analysis(_Model):
    """``CallAnalysis``."""

    call_summary: str | None = None
    call_successful: bool | None = None
    user_sentiment: str | None = None
    in_voicemail: bool | None = None
    custom_analysis_data: Any = None


class Call(_Model):
    """What Caller Memory reads of ``PhoneCallResponse`` / ``WebCallResponse`` (a web call has no numbers
    and no direction)."""

    call_id: str
    direction: str | None = None
    from_number: str | None = None
    to_number: str | None = None
    start_timestamp: float | None = None
    end_timestamp: float | None = None
    disconnection_reason: str | None = None
    transfer_destination: str | None = None
    metadata: Any = None
    transcript_object: list[Utterance] | None = None
    call_analysis: Analysis | None = None
    collected_dynamic_variables: Any = None


class CallEvent(_Model):
    event: str
    call: Call


# Verification -------------------------------------------------------------------------------------------------


def verify(secret: str | None, body: bytes, signature: str | None, now_ms: int) -> int:
    """Refuse (401) a webhook not signed with ``secret`` as Retell signs, or signed more than
    :data:`WINDOW_MS` from ``now_ms``, before anything of it is parsed. Returns the signed time."""
    if not signature:
        raise SignatureRefused(f"the {PLATFORM} webhook is not signed")
    match = _SIGNATURE.fullmatch(signature.strip())
    if match is None:
        raise SignatureRefused(
            f"the {PLATFORM} webhook's signature is not of the form v=<unix ms>,d=<64 lowercase hex>"
        )
    signed_at, digest = match.group(1), match.group(2)
    check_hmac_sha256(secret, body + signed_at.encode("ascii"), digest, platform=PLATFORM)
    check_window(int(signed_at), now_ms, WINDOW, platform=PLATFORM)
    return int(signed_at)


# Parsing ------------------------------------------------------------------------------------------------------


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedRequest("the webhook's body is not JSON") from None


def _invalid(exc: ValidationError, what: str) -> InvalidInput:
    where = ".".join(str(p) for p in exc.errors()[0]["loc"]) or "body"
    return InvalidInput(f"the {what}'s {where} is missing or malformed", field=where)


def read_inbound(body: bytes) -> Inbound:
    """The verified inbound webhook's ``call_inbound``; a body that is not one is refused naming what is
    wrong, never echoing it."""
    try:
        return InboundEnvelope.model_validate(_json(body)).call_inbound
    except ValidationError as exc:
        raise _invalid(exc, "inbound webhook") from None


def read_event(body: bytes) -> tuple[str, Call | None]:
    """The verified event's name, and its call for the three call events Caller Memory reads (None for any
    other event: acknowledged, nothing read)."""
    document = _json(body)
    try:
        event = Envelope.model_validate(document).event
        if event not in (STARTED, ENDED, ANALYZED):
            return event, None
        return event, CallEvent.model_validate(document).call
    except ValidationError as exc:
        raise _invalid(exc, "webhook") from None


def event_id(event: str, call: Call) -> str:
    """The id an event is remembered by: a call sends each event once (its retries are the same event)."""
    return f"{call.call_id}:{event}"


def new_conversation_id() -> str:
    """A call start's conversation: random (Retell's inbound webhook comes before the call has an id), never
    the number."""
    return f"{PLATFORM}:{secrets.token_hex(12)}"


def conversation_of(call: Call) -> str:
    """The conversation an event is about: the one the inbound answer put in the call's metadata (or that the
    business's code put there for an outbound call), else ``retell:<call_id>``."""
    named = call.metadata.get(METADATA_KEY) if isinstance(call.metadata, Mapping) else None
    if isinstance(named, str) and _CONVERSATION_ID.match(named):
        return named
    conversation = f"{PLATFORM}:{call.call_id}"
    if not _CONVERSATION_ID.match(conversation):
        raise InvalidInput("the webhook's call.call_id is malformed", field="call.call_id")
    return conversation


def caller_of(call: Call) -> str:
    """The person's number: ``from_number`` of an inbound call, ``to_number`` of an outbound one; "" for a web
    call (none: the conversation's own caller, if it started)."""
    number = call.to_number if call.direction == "outbound" else call.from_number
    return (number or "").strip()


def _bounded(text: str) -> str:
    encoded = text.encode("utf-8")
    if len(encoded) <= MAX_UTTERANCE_BYTES:
        return text
    return encoded[:MAX_UTTERANCE_BYTES].decode("utf-8", errors="ignore")


def messages_of(call: Call) -> list[SpokenMessage]:
    """``transcript_object`` in order, ``agent`` as the assistant and ``user`` as the user (:data:`ROLES`);
    other roles and empty utterances are left out; an utterance past :data:`MAX_UTTERANCE_BYTES` is cut
    there."""
    return [
        SpokenMessage(ROLES[u.role], _bounded(u.content))
        for u in call.transcript_object or []
        if u.role in ROLES and u.content.strip()
    ]


def extracted_of(call: Call) -> dict[str, Any]:
    """What ``state_map`` and ``analysis_qa_key`` name: the agent's post-call analysis fields
    (``call_analysis.custom_analysis_data``) by their names, Retell's own analysis under ``call_analysis``
    (``call_successful``, ``user_sentiment``, ``in_voicemail``) and the variables the call collected under
    ``collected_dynamic_variables``; a custom field of either name wins."""
    analysis = call.call_analysis
    extracted: dict[str, Any] = {}
    if isinstance(call.collected_dynamic_variables, Mapping) and call.collected_dynamic_variables:
        extracted["collected_dynamic_variables"] = dict(call.collected_dynamic_variables)
    if analysis is not None:
        extracted["call_analysis"] = {
            name: value
            for name, value in (
                ("call_successful", analysis.call_successful),
                ("user_sentiment", analysis.user_sentiment),
                ("in_voicemail", analysis.in_voicemail),
            )
            if value is not None
        }
        if isinstance(analysis.custom_analysis_data, Mapping):
            extracted.update(analysis.custom_analysis_data)
    return extracted


def transfer_label(call: Call) -> str | None:
    """``transfer_destination`` without its SIP parameters (``;transport=tls``); the ingestion drops it when
    it is, or holds, a phone number."""
    destination = (call.transfer_destination or "").split(";", 1)[0].strip()
    return destination or None


def end_of(event: str, call: Call) -> CallEnd:
    """The end event ``call_ended`` (without the analysis: held for it) or ``call_analyzed`` (the end)."""
    analysis = call.call_analysis if event == ANALYZED else None
    return CallEnd(
        platform=PLATFORM,
        conversation_id=conversation_of(call),
        caller=caller_of(call),
        messages=messages_of(call),
        summary=(analysis.call_summary or None) if analysis is not None else None,
        extracted=extracted_of(call) if event == ANALYZED else {},
        ended_at=call.end_timestamp,
        started_at=call.start_timestamp,
        end_reason=END_REASONS.get(call.disconnection_reason or ""),
        transfer_label=transfer_label(call),
        carries_analysis=event == ANALYZED,
    )


# The inbound answer -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InboundAnswer:
    """The body of the answer to the inbound webhook."""

    variables: dict[str, str]
    conversation_id: str | None

    def body(self) -> dict[str, Any]:
        inbound: dict[str, Any] = {"dynamic_variables": self.variables}
        if self.conversation_id is not None:
            inbound["metadata"] = {METADATA_KEY: self.conversation_id}
        return {"call_inbound": inbound}
