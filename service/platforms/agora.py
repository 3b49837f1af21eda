"""Agora ConvoAI's notifications (NCS, product 17) to a project (SPEC section 15, "Agora ConvoAI").

Agora signs each notification with the project's webhook secret: ``Agora-Signature-V2`` is the hex HMAC-SHA256
of the raw body (checked before anything of it is parsed, in constant time). Nothing signed says when, so the
envelope's ``notifyMs`` (rewritten on each retry) must lie within :data:`WINDOW_MS` of now, and each
``noticeId`` is kept :data:`NOTICE_KEEP_MS`: a retry of a notice is answered as a duplicate and applied once.

The conversation is the one ``labels.caller_memory_conversation`` names (the join helper,
``caller_memory.sdk.agora``, sets it; Agora returns the labels in its notifications). Agora's notifications
carry no caller number: the end is the conversation's own caller's, and a conversation that never started
(a pipeline not started with the helper) is left alone.

- 102 (agent left): the call's end. Held :data:`LEFT_WAIT_MS` for the history; ended at once when the history
  came first. Its ``message`` (and a ``FAILED`` status) gives ``end_reason`` (:data:`END_REASONS`).
- 103 (agent history): the transcript, its ``contents`` in order (``user`` and ``assistant``), which fills
  what the memory proxy did not record (the ingestion's rule: the ``n``-th message of a role only past the
  ``n - 1`` held). Held :data:`HISTORY_WAIT_MS` for the agent-left when it comes first.
- 101 (agent joined), 104, 110 (agent error), 111 (metrics), 112 (turns finished), 201 and 202 (call state):
  acknowledged, nothing stored.

Agora extracts nothing after a call: the state is the conversation's checkpoint (the business's code, MCP
``remember``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from ..domain.errors import InvalidInput, MalformedRequest
from ..domain.limits import CONVERSATION_ID_PATTERN
from ..domain.platforms.records import CallEnd, EndReason, SpokenMessage
from ..domain.platforms.verification import Window, check_hmac_sha256, check_window

PLATFORM = "agora"
SIGNATURE_HEADER = "Agora-Signature-V2"
#: The label naming the conversation (set by the join helper).
LABEL = "caller_memory_conversation"
#: How far from now a notice's ``notifyMs`` may be.
WINDOW_MS = 10 * 60_000
WINDOW = Window(past_ms=WINDOW_MS, future_ms=WINDOW_MS)
#: How long a ``noticeId`` is kept (a retry inside it is a duplicate).
NOTICE_KEEP_MS = 24 * 3_600_000
#: An agent-left waits this long for the history before the call ends without it.
LEFT_WAIT_MS = 30_000
#: A history that came first waits this long for the agent-left (Agora sends both; ten minutes if not).
HISTORY_WAIT_MS = 600_000
AGENT_LEFT = 102
AGENT_HISTORY = 103
#: 102's ``message`` -> ``end_reason``: the agent stopped as asked (the call hung up or stopped by the
#: business) is ``completed``; stopped by a timeout or a connection failure, ``dropped``.
END_REASONS: Mapping[str, EndReason] = {
    "OK": "completed",
    "Idle for too long": "dropped",
    "Connecting for too long": "dropped",
    "RTC connection error": "dropped",
    "Task lifetime limit exceeded": "dropped",
}
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Notice(_Model):
    """The NCS envelope."""

    noticeId: str
    eventType: int
    notifyMs: int
    payload: dict[str, Any] = {}


class HistoryItem(_Model):
    role: str
    content: str = ""


class AgentPayload(_Model):
    """What 102 and 103 carry that Caller Memory reads (the channel and agent ids are never kept)."""

    start_ts: float | None = None
    stop_ts: float | None = None
    status: str | None = None
    message: str | None = None
    labels: dict[str, Any] | None = None
    contents: list[HistoryItem] = []


def verify(secret: str | None, body: bytes, signature: str | None) -> None:
    """Refuse (401) a notification not signed with ``secret`` as Agora signs, before it is parsed."""
    check_hmac_sha256(secret, body, signature, platform=PLATFORM)


def read_notice(body: bytes, now_ms: int) -> Notice:
    """The verified body's envelope, its ``notifyMs`` within the window (401 outside it); a body that is not
    one is refused naming what is wrong, never echoing it."""
    try:
        notice = Notice.model_validate(orjson.loads(body))
    except orjson.JSONDecodeError:
        raise MalformedRequest("the notification is not JSON") from None
    except ValidationError as exc:
        where = ".".join(str(p) for p in exc.errors()[0]["loc"]) or "body"
        raise InvalidInput(f"the notification's {where} is missing or malformed", field=where) from None
    check_window(notice.notifyMs, now_ms, WINDOW, platform=PLATFORM)
    return notice


@dataclass(frozen=True, slots=True)
class Part:
    """An end part a notice brings: the end event, and how long it waits for the other part."""

    end: CallEnd
    wait_ms: int
    kind: Literal["left", "history"]


def part_of(notice: Notice) -> Part | None:
    """The end part of a 102 or 103 naming a conversation (None for any other notice, or one without the
    label: nothing to do)."""
    if notice.eventType not in (AGENT_LEFT, AGENT_HISTORY):
        return None
    try:
        payload = AgentPayload.model_validate(notice.payload)
    except ValidationError:
        raise InvalidInput("the notification's payload is malformed", field="payload") from None
    conversation = (payload.labels or {}).get(LABEL)
    if not isinstance(conversation, str) or not _CONVERSATION_ID.match(conversation):
        return None
    if notice.eventType == AGENT_LEFT:
        reason = "dropped" if payload.status == "FAILED" else END_REASONS.get(payload.message or "")
        end = CallEnd(
            platform=PLATFORM,
            conversation_id=conversation,
            caller="",
            ended_at=payload.stop_ts,
            started_at=payload.start_ts,
            end_reason=reason,
            carries_analysis=False,
        )
        return Part(end, LEFT_WAIT_MS, "left")
    messages = [SpokenMessage(m.role, m.content) for m in payload.contents if m.content]
    end = CallEnd(
        platform=PLATFORM,
        conversation_id=conversation,
        caller="",
        messages=messages,
        ended_at=payload.stop_ts,
        started_at=payload.start_ts,
        carries_analysis=False,
    )
    return Part(end, HISTORY_WAIT_MS, "history")
