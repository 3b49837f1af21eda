"""A conversation's call trust (SPEC section 15, "Trust"): the attestation of its start and a step-up
passed since, kept with the conversation (service/domain/store/call_trust.py), so that what reads memory for
the call later (the memory proxy, a platform's end) withholds what the call does not qualify for.

:class:`ConversationTrust` raises step-up for the rest of a call (``POST .../conversations/{id}/trust``,
audited); :func:`stored_call_trust` is the trust a reader applies (no record: a call that brought nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..audit import AuditLog
from ..clock import Clock
from ..errors import Conflict, NotFound
from ..projects import Project
from ..store import Store
from ..store.transcripts import ConversationKey, TranscriptStatus
from ..trust import UNKNOWN_CALL, CallTrust
from .ending import check_conversation_id
from .requests import parse_body


class TrustBody(BaseModel):
    """``POST .../conversations/{id}/trust``: a step-up check the call passed (trust never lowers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    step_up: Literal[True] = Field(
        description="Always true: the caller passed the business's own verification (a PIN, a one-time "
        "code); it holds for the rest of the call. Trust is never lowered."
    )


async def stored_call_trust(store: Store, project_id: str, conversation_id: str, now_ms: int) -> CallTrust:
    """The trust kept with the conversation; a conversation without any counts as a call that brought
    nothing (``unknown`` attestation, no step-up)."""
    kept = await store.call_trust(project_id, conversation_id, now_ms)
    if kept is None:
        return UNKNOWN_CALL
    return CallTrust(kept[0], kept[1])


async def keep_start_trust(
    store: Store, project_id: str, conversation_id: str, call: CallTrust, *, expires_at_ms: int, now_ms: int
) -> None:
    """Keep the trust a start brought (nothing to keep for one that brought nothing)."""
    if call.attestation == UNKNOWN_CALL.attestation and not call.step_up:
        return
    await store.keep_call_trust(
        project_id,
        conversation_id,
        call.attestation,
        step_up=call.step_up,
        expires_at_ms=expires_at_ms,
        now_ms=now_ms,
    )


@dataclass(slots=True)
class ConversationTrust:
    store: Store
    clock: Clock
    audit: AuditLog

    async def raise_step_up(
        self, project: Project, conversation_id: str, document: Any, *, actor: str
    ) -> None:
        """Mark the open conversation's call as stepped up (404: no such conversation; 409: it ended)."""
        check_conversation_id(conversation_id)
        parse_body(TrustBody, document, "trust")
        now = self.clock.now_ms()
        header, _ = await self.store.read_conversation(
            ConversationKey(project.project_id, conversation_id), now
        )
        if (
            header is None
            or header.expired(now)
            or header.status in (TranscriptStatus.ERASED, TranscriptStatus.DELETED)
        ):
            raise NotFound(
                f"conversation '{conversation_id}' has no transcript in project '{project.project_id}'"
            )
        if header.ended_by:
            raise Conflict(
                f"conversation '{conversation_id}' has ended: a step-up holds for a call in progress"
            )
        await self.store.raise_step_up(
            project.project_id, conversation_id, expires_at_ms=header.expires_at, now_ms=now
        )
        await self.audit.record(
            project.project_id, actor, "conversation.step_up", {"conversation_id": conversation_id}
        )
