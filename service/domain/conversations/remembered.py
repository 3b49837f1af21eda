"""State keys a call's model remembered through MCP's ``remember`` tool (SPEC section 17), persisted by the
call's end, whichever it is.

``remember`` keeps one name and value for the conversation (checked like an end's state: one of the
project's ``state_keys``, a value within the size limit, nothing the call's trust may not write; redacted
like a checkpoint), apart from the checkpoint the SDK replaces with every batch
(:mod:`caller_memory.service.domain.store.remembered`). The ends merge it in:

- an explicit end (the SDK's, the API's) takes its state as the agent's code sent it, with the remembered
  names it does not hold added (:meth:`RememberedState.under`): the code's own value of a name wins;
- a service end (inactivity, supersession) and a platform's end take the checkpoint with each remembered name
  over it when it was remembered at or after the checkpoint was made (:meth:`RememberedState.over`): the later
  word wins, and a platform's extracted data is mapped over that.

Kept at most :data:`KEEP_MS` (the longest ``end_grace`` a platform connection may have, and an hour), dropped
with the transcript by an admin's deletion and with the caller's other data by an erasure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson

from ..clock import Clock
from ..errors import CallerMemoryError, Conflict, Forbidden, InvalidInput
from ..memory import Caller, ErasureCounts, check_field_name, encode_value
from ..projects import Project
from ..store import CallerRef, Store
from ..store.remembered import RememberedValue
from ..store.transcripts import ConversationKey, Header, TranscriptStatus
from ..trust import CallTrust

log = logging.getLogger("caller_memory.conversations")

#: How long a remembered name is kept for its call's end: the longest ``end_grace`` (P2D), and an hour.
KEEP_MS = (48 + 1) * 3_600_000


class RememberedState:
    """Keeps what a call remembered and hands it to the call's end; an erasure and a deletion listener.
    (:meth:`~caller_memory.service.domain.conversations.service.TranscriptService.remember` is the use case:
    it finds the conversation and redacts the value.)"""

    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    @staticmethod
    def check(project: Project, header: Header, name: str, value: Any, call: CallTrust | None) -> bytes:
        """``value`` encoded, once ``name`` = ``value`` may be remembered for the conversation of ``header``:
        raises for a name that is not a state key, a value too large, a name the call's trust may not write,
        or a conversation that has ended."""
        check_field_name(name, where="key")
        if name not in project.ttl_ms:
            raise InvalidInput(
                f"key '{name}' is not one of the project's state_keys ({', '.join(sorted(project.ttl_ms))})"
                if project.ttl_ms
                else "the project has no state_keys: nothing can be remembered",
                field="key",
            )
        encoded = encode_value(name, value)
        if name in project.trust.withheld(call):
            raise Forbidden(
                f"key '{name}' needs more trust in the caller than this call has (the project's trust "
                "settings); it can be written only by a call that qualifies"
            )
        if header.status is not TranscriptStatus.OPEN:
            raise Conflict(
                f"conversation '{header.key.conversation_id}' has ended: nothing more is remembered"
            )
        return encoded

    async def keep(self, header: Header, name: str, encoded: bytes, now: int) -> None:
        """Keep the (checked, redacted) value of ``name`` for the conversation of ``header``."""
        await self._store.remember_state(
            header.key,
            header.subject,
            name,
            RememberedValue(encoded, now),
            keep_until_ms=now + KEEP_MS,
            now_ms=now,
        )

    async def _read(self, project: Project, key: ConversationKey) -> dict[str, RememberedValue]:
        """What the conversation remembered (names no longer state keys left out). Never raises for the
        store: an end is not failed for it (logged as lost)."""
        if not project.ttl_ms:
            return {}  # nothing can have been remembered: no read
        try:
            found = await self._store.remembered_state(key, self._clock.now_ms())
        except CallerMemoryError as exc:
            log.warning("what a call remembered was not read for its end: %s", exc.detail)
            return {}
        return {name: v for name, v in found.items() if name in project.ttl_ms}

    async def under(
        self, project: Project, key: ConversationKey, state: dict[str, Any], caller: Caller, *, merged: bool
    ) -> dict[str, Any]:
        """An explicit end's state: ``state`` with the remembered names it does not hold (``state`` as it is
        for a blacklisted ``caller``, without conversation memory, or when ``merged``: it holds them already,
        as a platform's end's does, :meth:`over`)."""
        if merged or caller.blacklisted or not project.conversation.enabled:
            return state
        found = await self._read(project, key)
        added = {name: orjson.loads(v.value) for name, v in found.items() if name not in state}
        return added | state

    async def over(
        self, project: Project, key: ConversationKey, checkpoint: Mapping[str, Any], checkpoint_at: int
    ) -> dict[str, Any]:
        """A service's or a platform's end's state: the checkpoint (made at ``checkpoint_at``) with each name
        remembered at or after it over it."""
        found = await self._read(project, key)
        merged = dict(checkpoint)
        for name, v in found.items():
            if name not in merged or v.made_at >= checkpoint_at:
                merged[name] = orjson.loads(v.value)
        return merged

    async def conversation_deleted(self, project: Project, header: Header) -> None:
        await self._store.forget_remembered(header.key)

    async def erase_caller(self, caller: CallerRef) -> ErasureCounts:
        await self._store.drop_remembered(caller)
        return ErasureCounts()
