"""The assistant's answer read out of the upstream's reply as it passes through the proxy, and kept as the
call's last answer (SPEC section 16, "The transcript": the streamed answer is recorded only for the call's
last turn, at its end; an earlier turn's is recorded from the next request, which holds what was spoken).

:class:`AnswerReader` reads a stream of server-sent events (each ``data:`` a ``chat.completion.chunk``: the
text of choice 0's ``delta.content``) or a whole ``chat.completion`` (choice 0's ``message.content``), a
chunk at a time, holding at most :data:`MAX_ANSWER_BYTES` of text (an answer longer than a transcript message
may be is not kept) and, for a whole completion, at most :data:`MAX_BODY_BYTES` of body. An answer that
did not end (no ``[DONE]``, a cut body) or that says nothing (tool calls only) gives no text.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..domain.clock import Clock
from ..domain.conversations.appends import TranscriptAppends
from ..domain.conversations.messages import MAX_MESSAGE_BYTES
from ..domain.conversations.pending import PendingAnswer, PendingAnswers
from ..domain.projects import Project
from ..domain.store.transcripts import ConversationKey
from .binding import Binding
from .requests import Completion

#: The most text an answer may have to be kept (a transcript message's limit).
MAX_ANSWER_BYTES = MAX_MESSAGE_BYTES
#: The most body a whole (not streamed) completion may have for its answer to be read.
MAX_BODY_BYTES = 1024 * 1024


class AnswerReader:
    """Reads an answer's text from the reply's body chunks (:meth:`feed`), then :meth:`text`."""

    __slots__ = ("_body", "_done", "_over", "_parts", "_size", "_stream")

    def __init__(self, *, stream: bool) -> None:
        self._stream = stream
        self._body = bytearray()  # a whole completion's body, or a stream's last partial line
        self._parts: list[str] = []
        self._size = 0
        self._done = False
        self._over = False

    def feed(self, chunk: bytes) -> None:
        if self._over:
            return
        self._body += chunk
        if not self._stream:
            if len(self._body) > MAX_BODY_BYTES:
                self._over = True
                self._body.clear()
            return
        if b"\n" not in chunk:
            if len(self._body) > MAX_BODY_BYTES:  # one line that long is no chunk of an answer
                self._over = True
                self._body.clear()
            return
        lines = bytes(self._body).split(b"\n")
        self._body = bytearray(lines.pop())  # an unfinished line waits for the next chunk
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return  # a comment, an event name, an id, a blank line between events
        data = line[5:].strip()
        if data == b"[DONE]":
            self._done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        delta = _first_choice(event, "delta")
        content = delta.get("content") if delta is not None else None
        if isinstance(content, str) and content:
            self._add(content)

    def _add(self, text: str) -> None:
        self._size += len(text.encode())
        if self._size > MAX_ANSWER_BYTES:
            self._over = True
            self._parts.clear()
            return
        self._parts.append(text)

    def text(self) -> str | None:
        """The answer's text once the reply ended whole; None when it did not, said nothing, or was too long."""
        if self._over:
            return None
        if not self._stream:
            try:
                document = orjson.loads(bytes(self._body))
            except orjson.JSONDecodeError:
                return None
            message = _first_choice(document, "message")
            content = message.get("content") if message is not None else None
            if not isinstance(content, str) or not content:
                return None
            if len(content.encode()) > MAX_ANSWER_BYTES:
                return None
            return content
        if not self._done:
            return None
        return "".join(self._parts) or None


def _first_choice(document: Any, member: str) -> dict[str, Any] | None:
    """``choices[i].<member>`` of the choice with index 0 (the answer a platform speaks), when it is an
    object."""
    if not isinstance(document, dict):
        return None
    choices = document.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            found = choice.get(member)
            return found if isinstance(found, dict) else None
    return None


async def keep_answer(
    appends: TranscriptAppends,
    pending: PendingAnswers,
    clock: Clock,
    *,
    project: Project,
    binding: Binding,
    completion: Completion,
    text: str,
) -> bool:
    """Keep ``text``, the answer to ``completion``, as its call's last answer (redacted and encoded as the
    transcript would take it), for the call's end to record unless a later request does; whether kept."""
    found = completion.answer(text)
    if found is None:
        return False
    recorded, before = found
    key = ConversationKey(project.project_id, binding.conversation_id)
    message = await appends.encode_answer(project, key, recorded.as_dict())
    if message is None:
        return False
    await pending.keep(key, binding.subject, PendingAnswer(message, before, clock.now_ms()))
    return True
