"""What a chat completion request becomes on its way upstream, and what of it goes into the transcript.

- Platform metadata goes: Vapi's ``call``, ``customer``, ``phoneNumber`` and ``metadata``; Agora's ``context``
  and its extensions (``turn_id``, ``timestamp``, ``interruptable`` at the top, and on each message anything
  but OpenAI's own members: its ``turn_id``, ``timestamp`` and ``metadata``); ElevenLabs'
  ``elevenlabs_extra_body`` and ``user_id``; and ``user``, which is never set. What is left is the request as
  the platform sent it.
- The platforms' own binding fields are read before they go: Vapi's ``call.id`` names the conversation
  ``vapi:<call.id>`` (the one its ``assistant-request`` started), and ElevenLabs' ``elevenlabs_extra_body``
  (the ``custom_llm_extra_body`` the initiation answered) names it in ``caller_memory_conversation``. A value
  that is not a conversation id binds nothing (the request goes on without memory, counted unbound): a call
  never fails for a platform's field.
- The memory message is one ``system`` message named :data:`MEMORY_NAME`, placed after the leading system
  (and developer) messages; any message of that name in the request is removed first, so that it is never
  accumulated however the platform keeps its history.
- The transcript takes the request's ``user``, ``assistant`` and ``tool`` messages (their text content only),
  each with a derived id: a hash of its role, its position among the request's messages and its content, so
  that a turn sent again names the same ids and the store keeps it once. A message that carries Agora's turn
  metadata (its ``turn_id``, and ``metadata`` with ``source``, ``interrupted``, ``original``...) keeps them,
  and its id is derived from its turn, its role and its index among that turn's messages of that role: an
  assistant message interrupted in turn N is recorded from turn N+1's request, which knows what was spoken.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from ..domain.conversations.messages import MAX_INT, SOURCES, MessageIn
from ..domain.errors import InvalidInput, MalformedRequest
from ..domain.limits import CONVERSATION_ID_PATTERN

#: The ``name`` of the memory message: how it is found (and removed) in a later request.
MEMORY_NAME = "caller_memory"
#: Top-level members that never go upstream (platform metadata, and ``user``).
STRIPPED = frozenset(
    {
        "call",
        "customer",
        "phoneNumber",
        "metadata",
        "context",
        "turn_id",
        "timestamp",
        "interruptable",
        "elevenlabs_extra_body",
        "user_id",
        "user",
    }
)
#: The members of a message OpenAI defines: anything else on a message (a platform's extension) goes.
MESSAGE_MEMBERS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"}
)
#: The member of ElevenLabs' ``elevenlabs_extra_body`` that names the conversation.
EXTRA_BODY_MEMBER = "caller_memory_conversation"
#: The prefix of a Vapi call's conversation id (SPEC 15: ``vapi:<call.id>``).
VAPI_PREFIX = "vapi:"
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)
#: Roles the transcript keeps.
RECORDED_ROLES = frozenset({"user", "assistant", "tool"})
LEADING_ROLES = frozenset({"system", "developer"})
MAX_MESSAGES = 10_000


@dataclass(frozen=True, slots=True)
class Recorded:
    """One message for the transcript (the append use case's platform layout)."""

    message_id: str
    role: str
    content: str
    turn_id: int
    #: What of the platform's message metadata the transcript keeps (Agora's), already checked.
    metadata: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {
            "message_id": self.message_id,
            "role": self.role,
            "content": self.content,
            "turn_id": self.turn_id,
        }
        if self.metadata:
            found["metadata"] = self.metadata
        return found


@dataclass(slots=True)
class Completion:
    """A request read: its document (stripped), its messages (without any earlier memory message), whether
    it streams."""

    document: dict[str, Any]
    messages: list[dict[str, Any]]
    stream: bool
    #: The messages as the platform sent them (with their extensions), beside ``messages``.
    originals: list[dict[str, Any]]
    #: The conversation the platform's own fields name (Vapi, ElevenLabs), if any.
    conversation: str | None = None
    #: The request's turn when the platform numbers turns (Agora's top-level ``turn_id``).
    turn: int | None = None

    def upstream_body(self, memory: str | None, model: str | None) -> bytes:
        """The body that goes upstream: the messages with ``memory`` (when there is one) after the leading
        system messages, and ``model`` when the upstream names one."""
        messages = list(self.messages)
        if memory is not None:
            at = 0
            while at < len(messages) and messages[at].get("role") in LEADING_ROLES:
                at += 1
            messages.insert(at, {"role": "system", "name": MEMORY_NAME, "content": memory})
        document = dict(self.document)
        document["messages"] = messages
        if model is not None:
            document["model"] = model
        return orjson.dumps(document)

    def answer(self, text: str) -> tuple[Recorded, int] | None:
        """The streamed answer ``text`` as the next request would hold it (the same id, if spoken whole), and
        how many assistant messages the transcript takes from this request (the answer is the next one);
        None when the transcript would not take it."""
        recorded = self.recorded()
        before = sum(1 for m in recorded if m.role == "assistant")
        if self.turn is not None:
            index = sum(1 for m in recorded if m.role == "assistant" and m.turn_id == self.turn)
            ident = turn_message_id("assistant", self.turn, index)
            answer = Recorded(ident, "assistant", text, self.turn)
        else:
            turn = sum(1 for m in self.messages if m.get("role") == "user")
            answer = Recorded(message_id("assistant", len(self.messages), text), "assistant", text, turn)
        checked = checked_message(answer)
        return None if checked is None else (checked, before)

    def recorded(self) -> list[Recorded]:
        """The messages the transcript takes, with derived ids and turn ids (the user messages counted so
        far: an assistant's answer shares its question's turn)."""
        found: list[Recorded] = []
        turn = 0
        seen_in_turn: dict[tuple[int, str], int] = {}
        for position, (message, original) in enumerate(zip(self.messages, self.originals, strict=True)):
            role = message.get("role")
            if role == "user":
                turn += 1
            if role not in RECORDED_ROLES:
                continue
            role = str(role)
            content = text_of(message.get("content"))
            if not content:
                continue  # an assistant message of tool calls only: nothing said
            platform_turn = original.get("turn_id")
            if type(platform_turn) is int and 0 <= platform_turn <= MAX_INT:
                index = seen_in_turn.get((platform_turn, role), 0)
                seen_in_turn[(platform_turn, role)] = index + 1
                ident = turn_message_id(role, platform_turn, index)
                recorded = Recorded(ident, role, content, platform_turn, kept_metadata(role, original))
            else:
                recorded = Recorded(message_id(role, position, content), role, content, turn)
            checked = checked_message(recorded)
            if checked is not None:
                found.append(checked)
        return found


def read_completion(body: bytes) -> Completion:
    """The request's body read, checked and stripped (:class:`MalformedRequest` / :class:`InvalidInput`
    naming what is wrong; nothing of the body is echoed)."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedRequest("the body is not JSON; send a Chat Completions request object") from None
    if not isinstance(document, dict):
        raise InvalidInput("the body must be a JSON object (a Chat Completions request)", field="body")
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages must be a non-empty array of message objects", field="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidInput(f"messages holds more than {MAX_MESSAGES} messages", field="messages")
    kept: list[dict[str, Any]] = []
    originals: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInput(
                f"messages[{index}] must be an object with a string role", field=f"messages[{index}]"
            )
        if message.get("name") == MEMORY_NAME:
            continue  # an earlier memory message: replaced, never accumulated
        kept.append({k: v for k, v in message.items() if k in MESSAGE_MEMBERS})
        originals.append(message)
    stripped = {k: v for k, v in document.items() if k not in STRIPPED and k != "messages"}
    stream = document.get("stream") is True
    turn = document.get("turn_id")
    turn = turn if type(turn) is int and 0 <= turn <= MAX_INT else None
    return Completion(stripped, kept, stream, originals, platform_conversation(document), turn)


def platform_conversation(document: dict[str, Any]) -> str | None:
    """The conversation a platform's own fields name: Vapi's ``call.id`` (as ``vapi:<call.id>``), else
    ElevenLabs' ``elevenlabs_extra_body.caller_memory_conversation``; None when neither names a well-formed
    conversation id."""
    found: Any = None
    call = document.get("call")
    extra = document.get("elevenlabs_extra_body")
    if isinstance(call, dict) and isinstance(call.get("id"), str):
        found = VAPI_PREFIX + call["id"]
    elif isinstance(extra, dict):
        found = extra.get(EXTRA_BODY_MEMBER)
    if isinstance(found, str) and _CONVERSATION_ID.match(found):
        return found
    return None


def text_of(content: Any) -> str:
    """A message's text: its string content, or the text parts of a content array joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def kept_metadata(role: str, message: dict[str, Any]) -> dict[str, Any] | None:
    """What the transcript keeps of a message's platform metadata (Agora's): its source when it fits the
    role, and an assistant's interruption (what was meant to be said, and when it was cut)."""
    meta = message.get("metadata")
    if not isinstance(meta, dict):
        return None
    kept: dict[str, Any] = {}
    source = meta.get("source")
    if isinstance(source, str) and source in SOURCES[role]:
        kept["source"] = source
    if role == "assistant" and meta.get("interrupted") is True:
        kept["interrupted"] = True
        if isinstance(meta.get("original"), str):
            kept["original"] = meta["original"]
        stamp = meta.get("interrupt_timestamp")
        if type(stamp) is int and 0 <= stamp <= MAX_INT:
            kept["interrupt_timestamp"] = stamp
    return kept or None


def checked_message(recorded: Recorded) -> Recorded | None:
    """``recorded`` if the transcript takes it (without its metadata if only that is refused); else None, so
    that one odd message never keeps the others of a request out of the transcript."""
    try:
        MessageIn.model_validate(recorded.as_dict())
    except ValidationError:
        if recorded.metadata is None:
            return None
        return checked_message(
            Recorded(recorded.message_id, recorded.role, recorded.content, recorded.turn_id)
        )
    return recorded


def turn_message_id(role: str, turn: int, index: int) -> str:
    """The id of a message with the platform's turn metadata: its turn, role and index in the turn."""
    digest = hashlib.sha256(f"turn\x00{turn}\x00{role}\x00{index}".encode()).hexdigest()
    return f"px-{digest[:32]}"


def message_id(role: str, position: int, content: str) -> str:
    """The derived id of a message: the same role, position and content always name the same id."""
    digest = hashlib.sha256(f"{role}\x00{position}\x00{content}".encode()).hexdigest()
    return f"px-{digest[:32]}"
