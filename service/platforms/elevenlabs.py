"""ElevenLabs Agents: the conversation-initiation webhook and the post-call webhooks of a project (SPEC section
15, "ElevenLabs"; docs/elevenlabs.md). Vendor parsing and mapping only: no aiohttp here.

**Initiation** (inbound Twilio or SIP calls): ElevenLabs POSTs ``caller_id``, ``agent_id``, ``called_number`` and
``call_sid`` and sends only the static headers configured with the webhook, so it is authenticated by a platform
token (the route). Each call gets a conversation ``elevenlabs:<random>``; the answer
(:func:`initiation_answer`) is ``{"type": "conversation_initiation_client_data", "dynamic_variables": {...},
"custom_llm_extra_body": {"caller_memory_conversation": <id>}}`` whose ``dynamic_variables`` hold every name of
the connection's ``agent_variables`` (empty when there is no value: ElevenLabs refuses an answer without one of
the agent's variables), the start variables (``caller_memory``, ``memory_<key>``, ``returning_caller``,
``resume``) and :data:`CONVERSATION_VARIABLE`, the conversation id, which ElevenLabs returns at the end in
``conversation_initiation_client_data.dynamic_variables`` and, as ``elevenlabs_extra_body``, in every request
to a custom LLM (the memory proxy binds it).

**Post-call webhooks**, signed: ``ElevenLabs-Signature: t=<unix s>,v0=<hex>``, the HMAC-SHA256 of
``"<t>.<raw body>"`` with the webhook's secret (the connection's), checked before anything is parsed;
``t`` within :data:`WINDOW` (30 minutes past, 5 minutes future: ElevenLabs' own helper accepts any future time,
Caller Memory does not).

- ``post_call_transcription``: the call's end, with its analysis (one event per call). :func:`end_of` maps it:
  the transcript (``agent`` -> assistant, ``user`` -> user, ``message``, an interrupted turn's
  ``original_message``; tool calls and results never), ``analysis.transcript_summary``,
  ``analysis.data_collection_results`` (``{name: {value, ...}}`` -> ``{name: value}``, mapped by
  ``state_map``), the end reason (:func:`end_reason`), the caller (``metadata.phone_call.external_number``).
- ``call_initiation_failure``: a started call that never connected ends ``dropped``, without a transcript.
- ``post_call_audio`` and anything else: acknowledged, nothing stored.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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

PLATFORM = "elevenlabs"
SIGNATURE_HEADER = "ElevenLabs-Signature"
#: The dynamic variable (and the ``custom_llm_extra_body`` member) naming the call's conversation.
CONVERSATION_VARIABLE = "caller_memory_conversation"
#: How far from now a post-call webhook's signed time may be (SPEC 15: 30 minutes past, 5 minutes future).
WINDOW = Window(past_ms=30 * 60_000, future_ms=5 * 60_000)
#: The initiation's answer is due within a second (ElevenLabs names no deadline; SPEC 15's default): the
#: memory read and the start get this much of it.
START_BUDGET_S = 0.7
#: And the connection's read this much (a store that hangs: the last connection seen answers instead).
CONNECTION_BUDGET_S = 0.2
TRANSCRIPTION = "post_call_transcription"
AUDIO = "post_call_audio"
INITIATION_FAILURE = "call_initiation_failure"
#: Transcript roles (``ConversationHistoryTranscriptResponseModel.role``: ``user`` or ``agent``) -> ours.
ROLES: Mapping[str, str] = {"agent": "assistant", "user": "user"}
#: ``metadata.phone_call.call_result`` (``types/call_result.py``) values of a call that did not go through.
UNANSWERED = frozenset({"voicemail", "busy", "no_answer", "failed"})
#: ``metadata.termination_reason`` is free text (``Optional[str]`` in the SDK, no enum): these phrases, found
#: in it case-insensitively, in this order, give the end reason.
TERMINATION_PHRASES: tuple[tuple[str, EndReason], ...] = (
    ("transfer_to_number", "transferred"),
    ("transferred", "transferred"),
    ("silence", "dropped"),
    ("voicemail", "dropped"),
    ("timeout", "dropped"),
    ("timed out", "dropped"),
    ("max duration", "dropped"),
    ("maximum duration", "dropped"),
    ("quota", "dropped"),
    ("error", "dropped"),
    ("failed", "dropped"),
    ("end_call", "completed"),
    ("remote party", "completed"),
    ("hung up", "completed"),
    ("hangup", "completed"),
    ("client disconnected", "completed"),
    ("ended by user", "completed"),
)
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)
_SIGNATURE = re.compile(r"^[0-9a-fA-F]{64}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InitiationRequest(_Model):
    """What ElevenLabs POSTs to the initiation webhook (no SDK type: its docs' Twilio personalisation page)."""

    caller_id: str | None = None
    agent_id: str | None = None
    called_number: str | None = None
    call_sid: str | None = None


class Event(_Model):
    """A post-call webhook's envelope (no SDK type either: ``data`` is ``GetConversationResponseModel``)."""

    type: str
    event_timestamp: int | None = None
    data: dict[str, Any] = {}


class TranscriptTurn(_Model):
    role: str = ""
    message: str | None = None
    interrupted: bool | None = None
    original_message: str | None = None


class Conversation(_Model):
    """The parts of ``GetConversationResponseModel`` Caller Memory reads."""

    conversation_id: str | None = None
    status: str | None = None
    transcript: list[TranscriptTurn] = []
    metadata: dict[str, Any] = {}
    analysis: dict[str, Any] | None = None
    conversation_initiation_client_data: dict[str, Any] | None = None


def _invalid(what: str, exc: ValidationError) -> InvalidInput:
    where = ".".join(str(p) for p in exc.errors(include_input=False)[0]["loc"]) or "body"
    return InvalidInput(f"the {what}'s {where} is missing or malformed", field=where)


def _json(body: bytes, what: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedRequest(f"the {what} is not JSON") from None


# Initiation ---------------------------------------------------------------------------------------------------


def read_initiation(body: bytes) -> InitiationRequest:
    """The initiation request (a body that is not one is refused, naming what is wrong, never echoing it)."""
    document = _json(body, "initiation request")
    if not isinstance(document, dict):
        raise InvalidInput("the initiation request must be a JSON object", field="body")
    try:
        return InitiationRequest.model_validate(document)
    except ValidationError as exc:
        raise _invalid("initiation request", exc) from None


def new_conversation_id() -> str:
    """``elevenlabs:<random>``: the initiation comes before ElevenLabs has a conversation id to name."""
    return f"{PLATFORM}:{secrets.token_hex(16)}"


def initiation_answer(
    conversation_id: str, variables: Mapping[str, str], agent_variables: list[str]
) -> dict[str, Any]:
    """The answer ElevenLabs reads: every agent variable (empty where Caller Memory has no value), the start
    variables, and the conversation id, as dynamic variables; the id also in ``custom_llm_extra_body``."""
    dynamic = dict.fromkeys(agent_variables, "")
    dynamic.update(variables)
    dynamic[CONVERSATION_VARIABLE] = conversation_id
    return {
        "type": "conversation_initiation_client_data",
        "dynamic_variables": dynamic,
        "custom_llm_extra_body": {CONVERSATION_VARIABLE: conversation_id},
    }


# Post-call webhooks ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Signature:
    signed_at_ms: int
    digest: str


def verify(secret: str | None, body: bytes, header: str | None, now_ms: int) -> Signature:
    """Refuse (401) a webhook not signed with ``secret`` as ElevenLabs signs, or signed outside
    :data:`WINDOW`, before it is parsed. The header may carry several ``v0`` (a secret being rotated): one
    must match."""
    if not header:
        raise SignatureRefused(f"the {PLATFORM} webhook is not signed")
    stamp: str | None = None
    digests: list[str] = []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t":
            stamp = value
        elif name == "v0" and _SIGNATURE.match(value):
            digests.append(value.lower())
    if stamp is None or not stamp.isdigit() or len(stamp) > 12 or not digests:
        raise SignatureRefused(f"the {PLATFORM} webhook's signature header is not t=<time>,v0=<hex>")
    signed = stamp.encode() + b"." + body
    matched: str | None = None
    for digest in digests:
        try:
            check_hmac_sha256(secret, signed, digest, platform=PLATFORM)
        except SignatureRefused:
            if not secret:
                raise
            continue
        matched = digest
        break
    if matched is None:
        raise SignatureRefused(f"the {PLATFORM} webhook's signature does not match its body")
    signed_at_ms = int(stamp) * 1000
    check_window(signed_at_ms, now_ms, WINDOW, platform=PLATFORM)
    return Signature(signed_at_ms, matched)


def read_event(body: bytes) -> Event:
    """A verified body's envelope."""
    document = _json(body, "webhook")
    if not isinstance(document, dict):
        raise InvalidInput("the webhook must be a JSON object", field="body")
    try:
        return Event.model_validate(document)
    except ValidationError as exc:
        raise _invalid("webhook", exc) from None


def conversation_of(event: Event) -> Conversation:
    try:
        return Conversation.model_validate(event.data)
    except ValidationError as exc:
        where = ".".join(("data", *(str(p) for p in exc.errors(include_input=False)[0]["loc"])))
        raise InvalidInput(f"the webhook's {where} is malformed", field=where) from None


def event_key(event: Event, signature: Signature) -> str:
    """The id a replay is known by: the event's type and ElevenLabs' conversation id (one event of a kind per
    call), else the signature."""
    conversation = event.data.get("conversation_id")
    if isinstance(conversation, str) and conversation:
        return f"{event.type}:{conversation[:128]}"
    return f"{event.type}:sig:{signature.digest}"


def conversation_id_of(conversation: Conversation) -> str | None:
    """The conversation an end names: the dynamic variable the initiation answered, else
    ``elevenlabs:<conversation_id>`` (a call whose initiation Caller Memory did not answer); None when neither
    is a conversation id."""
    client = conversation.conversation_initiation_client_data or {}
    variables = client.get("dynamic_variables")
    named = variables.get(CONVERSATION_VARIABLE) if isinstance(variables, dict) else None
    if isinstance(named, str) and _CONVERSATION_ID.match(named):
        return named
    extra = client.get("custom_llm_extra_body")
    named = extra.get(CONVERSATION_VARIABLE) if isinstance(extra, dict) else None
    if isinstance(named, str) and _CONVERSATION_ID.match(named):
        return named
    if conversation.conversation_id:
        made = f"{PLATFORM}:{conversation.conversation_id}"
        if _CONVERSATION_ID.match(made):
            return made
    return None


def caller_of(metadata: Mapping[str, Any]) -> str:
    """The caller's number: ``metadata.phone_call.external_number`` (the other party of a Twilio, SIP-trunk
    or Exotel call); "" when there is none (the conversation's own caller then)."""
    phone = metadata.get("phone_call")
    number = phone.get("external_number") if isinstance(phone, dict) else None
    return number if isinstance(number, str) else ""


def end_reason(status: str | None, metadata: Mapping[str, Any], *, failure: bool = False) -> EndReason | None:
    """``end_reason`` from the conversation's ``status``, ``metadata.error``, ``metadata.phone_call.
    call_result`` and ``metadata.termination_reason`` (docs/elevenlabs.md, "The end reason")."""
    if failure or status == "failed" or metadata.get("error"):
        return "dropped"
    phone = metadata.get("phone_call")
    result = phone.get("call_result") if isinstance(phone, dict) else None
    if result in UNANSWERED:
        return "dropped"
    reason = metadata.get("termination_reason")
    if isinstance(reason, str):
        text = reason.lower()
        for phrase, mapped in TERMINATION_PHRASES:
            if phrase in text:
                return mapped
    return None


def messages_of(conversation: Conversation) -> list[SpokenMessage]:
    """The transcript's spoken turns in order: ``agent`` and ``user`` with their ``message`` (an interrupted
    agent turn with its ``original_message``); tool calls, tool results and turns without text never."""
    spoken: list[SpokenMessage] = []
    for turn in conversation.transcript:
        role = ROLES.get(turn.role)
        if role is None or not turn.message:
            continue
        original = turn.original_message if turn.interrupted and turn.original_message else None
        spoken.append(SpokenMessage(role, turn.message, original))
    return spoken


def extracted_of(analysis: Mapping[str, Any] | None) -> dict[str, Any]:
    """``analysis.data_collection_results`` (``{name: {"value": ..., ...}}``) as ``{name: value}``."""
    results = (analysis or {}).get("data_collection_results")
    if not isinstance(results, dict):
        return {}
    return {
        str(name): result.get("value")
        for name, result in results.items()
        if isinstance(result, dict) and "value" in result
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def end_of(event: Event) -> CallEnd | None:
    """The end a ``post_call_transcription`` or ``call_initiation_failure`` brings (None for any other event,
    or one naming no conversation id)."""
    if event.type not in (TRANSCRIPTION, INITIATION_FAILURE):
        return None
    conversation = conversation_of(event)
    conversation_id = conversation_id_of(conversation)
    if conversation_id is None:
        return None
    metadata = conversation.metadata
    if event.type == INITIATION_FAILURE:
        # A call that never connected: only a started conversation is ended (no number, no transcript).
        return CallEnd(
            platform=PLATFORM,
            conversation_id=conversation_id,
            caller="",
            end_reason="dropped",
            ended_at=_number(event.event_timestamp),
        )
    started = _number(metadata.get("start_time_unix_secs"))
    duration = _number(metadata.get("call_duration_secs"))
    analysis = conversation.analysis or {}
    summary = analysis.get("transcript_summary")
    return CallEnd(
        platform=PLATFORM,
        conversation_id=conversation_id,
        caller=caller_of(metadata),
        messages=messages_of(conversation),
        summary=summary if isinstance(summary, str) and summary.strip() else None,
        extracted=extracted_of(analysis),
        ended_at=started + duration if started is not None and duration is not None else None,
        started_at=started,
        end_reason=end_reason(conversation.status, metadata),
    )
