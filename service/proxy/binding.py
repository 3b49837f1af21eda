"""A completion's conversation (the ``X-Caller-Memory-Conversation`` header) and the memory message it brings.

- A request is bound to a conversation of its project that has started (the store has its header, with the
  caller's pseudonym); anything else (no header, an unknown id, a transcript erased or deleted) is unbound:
  it goes upstream without memory. Which caller a conversation is of does not change while the conversation
  is remembered, so a binding is kept per conversation in this process once found, for
  :data:`BINDING_SECONDS` (a transcript deleted or forgotten since is then seen).
- The memory is the caller's live fields, read at every request through the store's memory read, which on
  Redis is the read cache (``CALLER_MEMORY_READ_CACHE_SECONDS``): a write to that caller through any process
  invalidates it there, so the memory a request carries is never staler than the cache's bound, and on
  SQLite it is read from the file. It is framed as the SDK's
  ``render_memory`` frames it: a preamble saying it is data, then one JSON document.
- Which transcript messages were recorded is remembered per conversation too, so that the history a platform
  sends again at every turn is not sent to the store again (the store skips a known id anyway).
"""

from __future__ import annotations

import asyncio
import enum
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
from caller_memory.sdk.render import PREAMBLE

from ..domain.clock import Clock
from ..domain.conversations.call_trust import stored_call_trust
from ..domain.errors import InvalidInput
from ..domain.limits import CONVERSATION_ID_PATTERN
from ..domain.projects import Project
from ..domain.store import CallerRef, Store
from ..domain.store.transcripts import ConversationKey, TranscriptStatus

#: The request header naming the conversation.
BINDING_HEADER = "X-Caller-Memory-Conversation"
#: The answer's header saying what became of the memory.
MEMORY_HEADER = "X-Caller-Memory"
#: Seconds a memory read may take before the completion goes on without it (the SDK's read budget).
READ_BUDGET_S = 0.15
#: Seconds a process keeps a conversation's binding before reading it again.
BINDING_SECONDS = 60.0
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)


class Outcome(enum.Enum):
    """What a completion carried (the ``X-Caller-Memory`` header, and the metric's label)."""

    #: Bound, and the caller's memory is in the request (or the caller has none).
    BOUND = "bound"
    #: No conversation named, or not one that started: forwarded without memory.
    UNBOUND = "unbound"
    #: Bound, but the memory could not be read in time (a store down or slow, a bound met).
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class Binding:
    project: str
    conversation_id: str
    #: The caller's pseudonym (never a number).
    subject: str


def conversation_of(header: str | None) -> str | None:
    """The conversation id the header names (None: no header); a malformed one is refused."""
    if header is None:
        return None
    if not _CONVERSATION_ID.match(header):
        raise InvalidInput(
            f"the {BINDING_HEADER} header must be a conversation id (1-128 of A-Z a-z 0-9 . _ : -)",
            field=BINDING_HEADER,
        )
    return header


def memory_message(fields: dict[str, Any]) -> str:
    """The memory message's text, framed as the SDK's ``render_memory`` frames it: the preamble saying that
    what follows is data, never instructions, then one JSON document (``caller_memory``)."""
    data = orjson.dumps({"caller_memory": fields}, option=orjson.OPT_SORT_KEYS).decode()
    return "\n".join((PREAMBLE, data))


class Binder:
    """Bindings and recorded ids per conversation, in this process (``entries`` conversations at most, the
    least recently used going first)."""

    def __init__(self, store: Store, clock: Clock, *, entries: int = 10_000) -> None:
        self._store = store
        self._clock = clock
        self._entries = entries
        self._bindings: OrderedDict[tuple[str, str], tuple[float, Binding]] = OrderedDict()
        self._recorded: OrderedDict[tuple[str, str], set[str]] = OrderedDict()

    async def bind(self, project: str, conversation_id: str) -> Binding | None:
        """The conversation's binding, or None when it is not a started conversation of ``project``."""
        key = (project, conversation_id)
        found = self._bindings.get(key)
        if found is not None and time.monotonic() - found[0] < BINDING_SECONDS:
            self._bindings.move_to_end(key)
            return found[1]
        header, _ = await self._store.read_conversation(
            ConversationKey(project, conversation_id), self._clock.now_ms()
        )
        if header is None or not header.subject:
            return None
        if header.status in (TranscriptStatus.ERASED, TranscriptStatus.DELETED):
            return None
        binding = Binding(project, conversation_id, header.subject)
        self._bindings[key] = (time.monotonic(), binding)
        self._bindings.move_to_end(key)
        if len(self._bindings) > self._entries:
            self._bindings.popitem(last=False)
        return binding

    async def memory(self, project: Project, binding: Binding) -> str | None:
        """The memory message's text (None: the caller has no memory, or is blacklisted)."""
        if binding.subject in project.blacklist:
            return None
        now = self._clock.now_ms()
        caller = CallerRef(project.project_id, binding.subject)
        withheld: tuple[str, ...] = ()
        if project.trust.levels:  # the call's stored trust (its start's attestation, a step-up since)
            stored, call = await asyncio.gather(
                self._store.read_fields(caller, now),
                stored_call_trust(self._store, project.project_id, binding.conversation_id, now),
            )
            withheld = project.trust.withheld(call)
        else:
            stored = await self._store.read_fields(caller, now)
        fields: dict[str, Any] = {}
        for name in sorted(stored):
            field = stored[name]
            if name in withheld:
                continue
            if now >= min(field.expires_at, field.written_at + project.ttl_ms.get(name, 0)):
                continue
            fields[name] = orjson.loads(field.value)
        if not fields:
            return None
        return memory_message(fields)

    def unrecorded(self, binding: Binding, ids: list[str]) -> list[str]:
        """Of ``ids``, those this process has not recorded for the conversation yet."""
        done = self._recorded.get((binding.project, binding.conversation_id), set())
        return [i for i in ids if i not in done]

    def mark_recorded(self, binding: Binding, ids: list[str]) -> None:
        key = (binding.project, binding.conversation_id)
        done = self._recorded.setdefault(key, set())
        self._recorded.move_to_end(key)
        done.update(ids)
        if len(self._recorded) > self._entries:
            self._recorded.popitem(last=False)
