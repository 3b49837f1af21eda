"""Ending a conversation: persist the allowed ``state`` keys of a call, exactly once per conversation id."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from .analytics import AnalyticsService, metrics
from .clock import Clock
from .errors import Conflict, InvalidIdentifier, InvalidInput
from .fields import StoredField
from .limits import CONVERSATION_ID_RE, RECALL_WINDOW_MS
from .memory import MemoryService, check_field_name, encode_value
from .projects import Project
from .reports import RepeatCallerMetrics
from .store import CallerRef, EndStatus, EndWrite, Store
from .store import Outcome as Outcome  # part of this module's API: the HTTP layer builds one for end()


@dataclass(frozen=True, slots=True)
class ConversationEnd:
    """What the end of a conversation reports. The same request always gets the same report."""

    conversation_id: str
    persisted: list[str]
    ignored: list[str]
    blacklisted: bool
    repeat_caller: RepeatCallerMetrics
    replayed: bool
    #: The caller was erased after this conversation's write was made: nothing was stored.
    erased: bool = False


class ConversationService:
    def __init__(
        self, store: Store, memory: MemoryService, analytics: AnalyticsService, clock: Clock
    ) -> None:
        self._store = store
        self._memory = memory
        self._analytics = analytics
        self._clock = clock

    async def end(
        self,
        project: Project,
        conversation_id: str,
        caller: str,
        state: dict[str, Any],
        outcome: Outcome,
        channel: str | None,
        *,
        received_at: int | None = None,
        ended_at: int | None = None,
    ) -> ConversationEnd:
        """``received_at`` is when the request arrived (default: now); ``ended_at`` when the client says the
        conversation ended (its first attempt to send this). The write counts as made at the earlier of the
        two, so that an erasure in between wins over a late delivery."""
        if not CONVERSATION_ID_RE.match(conversation_id):
            raise InvalidInput(
                "conversation id must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
                field="conversation_id",
            )
        try:
            who = self._memory.caller(project, caller)
        except InvalidIdentifier as exc:
            raise InvalidInput(exc.detail.replace("identifier", "caller", 1), field="caller") from None
        sets: dict[str, bytes] = {}
        deletes: list[str] = []
        ignored: list[str] = []
        for name, value in state.items():
            check_field_name(name, where=f"state.{name}")
            if name not in project.ttl_ms:
                ignored.append(name)
            elif value is None:
                deletes.append(name)
            else:
                sets[name] = encode_value(f"state.{name}", value)
        persisted = sorted([*sets, *deletes])
        if who.blacklisted:
            # Nothing is read, written or counted for a blacklisted caller; a retry is as harmless.
            return ConversationEnd(conversation_id, [], sorted(state), True, {}, False)
        now = self._clock.now_ms()
        fingerprint = hashlib.sha256(
            orjson.dumps(
                [who.subject, state, [outcome.qa, outcome.handoff_reason, outcome.handoff_to], channel],
                option=orjson.OPT_SORT_KEYS,
            )
        ).hexdigest()
        stored = {
            name: StoredField(value=value, expires_at=now + project.ttl_ms[name], written_at=now)
            for name, value in sets.items()
        }
        analytics = AnalyticsService.input_for(project, now, outcome) if project.analytics_enabled else None
        made_at = min(now if received_at is None else received_at, now if ended_at is None else ended_at)
        ref = CallerRef(project.project_id, who.subject)
        end = EndWrite(
            caller=ref,
            conversation_id=conversation_id,
            fingerprint=fingerprint,
            expires_at=now + min(RECALL_WINDOW_MS, project.retention_ms),
            made_at=made_at,
            sets=stored,
            deletes=deletes,
            analytics=analytics,
        )
        result = await self._store.end_conversation(end, now)
        if result.status is EndStatus.ERASED:
            return ConversationEnd(conversation_id, [], sorted(state), False, {}, False, erased=True)
        if result.status is EndStatus.CONFLICT:
            raise Conflict(
                f"conversation '{conversation_id}' was already ended with a different request; "
                "a retry must send the same caller, state, outcome and channel"
            )
        repeat_caller: RepeatCallerMetrics = {}
        if result.analytics is not None:  # analytics were on when the conversation was first applied
            entry = await self._analytics.record(
                project, ref, conversation_id, channel, outcome, result.analytics, made_at=made_at, now=now
            )
            repeat_caller = metrics(entry.first)
        return ConversationEnd(
            conversation_id=conversation_id,
            persisted=persisted,
            ignored=sorted(ignored),
            blacklisted=False,
            repeat_caller=repeat_caller,
            replayed=result.status is EndStatus.REPLAYED,
        )
