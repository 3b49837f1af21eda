"""What a chat completion request becomes on its way upstream, and what of it goes into the transcript.

- Platform metadata goes: Vapi's ``call``, ``customer``, ``phoneNumber`` and ``metadata``; Agora's ``context``
  and its extensions (``turn_id``, ``timestamp``, ``interruptable`` at the top, and on each message anything
  but OpenAI's own members: its ``turn_id``, ``timestamp`` and ``metadata``); ElevenLabs'
  ``elevenlabs_extra_body`` and ``user_id``; and ``user``, which is never set. What is left is the request as
  the platform sent it.
- The memory message is one ``system`` message named :data:`MEMORY_NAME`, placed after the leading system
  (and developer) messages; any message of that name in the request is removed first, so that it is never
  accumulated however the platform keeps its history.
- The transcript takes the request's ``user``, ``assistant`` and ``tool`` messages (their text content only),
  each with a derived id: a hash of its role, its position among the request's messages and its content, so
  that a turn sent again names the same ids and the store keeps it once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from ..domain.errors import InvalidInput, MalformedRequest

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
#: Roles the transcript keeps.
RECORDED_ROLES = frozenset({"user", "assistant", "tool"})
LEADING_ROLES = frozenset({"system", "developer"})
MAX_MESSAGES = 10_000
#: Largest completion request read: platforms send a call's whole history at every turn (the API's other
#: bodies are bounded far lower, ``domain.limits.MAX_BODY_BYTES``).
MAX_COMPLETION_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Recorded:
    """One message for the transcript (the append use case's platform layout)."""

    message_id: str
    role: str
    content: str
    turn_id: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "role": self.role,
            "content": self.content,
            "turn_id": self.turn_id,
        }


@dataclass(slots=True)
class Completion:
    """A request read: its document (stripped), its messages (without any earlier memory message), whether
    it streams."""

    document: dict[str, Any]
    messages: list[dict[str, Any]]
    stream: bool

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

    def recorded(self) -> list[Recorded]:
        """The messages the transcript takes, with derived ids and turn ids (the user messages counted so
        far: an assistant's answer shares its question's turn)."""
        found: list[Recorded] = []
        turn = 0
        for position, message in enumerate(self.messages):
            role = message.get("role")
            if role == "user":
                turn += 1
            if role not in RECORDED_ROLES:
                continue
            content = text_of(message.get("content"))
            if not content:
                continue  # an assistant message of tool calls only: nothing said
            found.append(Recorded(message_id(str(role), position, content), str(role), content, turn))
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
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInput(
                f"messages[{index}] must be an object with a string role", field=f"messages[{index}]"
            )
        if message.get("name") == MEMORY_NAME:
            continue  # an earlier memory message: replaced, never accumulated
        kept.append({k: v for k, v in message.items() if k in MESSAGE_MEMBERS})
    stripped = {k: v for k, v in document.items() if k not in STRIPPED and k != "messages"}
    stream = document.get("stream") is True
    return Completion(stripped, kept, stream)


def text_of(content: Any) -> str:
    """A message's text: its string content, or the text parts of a content array joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def message_id(role: str, position: int, content: str) -> str:
    """The derived id of a message: the same role, position and content always name the same id."""
    digest = hashlib.sha256(f"{role}\x00{position}\x00{content}".encode()).hexdigest()
    return f"px-{digest[:32]}"
