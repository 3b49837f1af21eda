"""The audit log: who did what, when (erasures, configuration, tokens, links). The use cases record it, so
that every way in (HTTP, the command line, and the tools that follow) audits alike."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .clock import Clock
from .errors import InvalidInput
from .store import AuditEntry, Store

#: Audit record ids as the backends make them (a counter, or a Redis stream id).
AUDIT_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?", re.ASCII)
AUDIT_ID_HELP = "not an audit record id (use next_cursor from the previous page)"


def is_audit_id(text: str) -> bool:
    """An id of either backend's form (``17``, zero-padded to 20 digits, or a Redis stream id
    ``1733046000000-0``), each part at most 2^63 - 1: what every backend can take as a cursor."""
    return bool(AUDIT_ID.fullmatch(text)) and all(int(part) <= 2**63 - 1 for part in text.split("-"))


class AuditLog:
    """Who did what, when: erasures, configuration and token changes. Never a phone number or a value."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    async def record(
        self,
        project: str,
        actor: str,
        action: str,
        details: Mapping[str, Any],
        *,
        receipt_id: str | None = None,
        at: int | None = None,
    ) -> str:
        entry = AuditEntry(
            at=self._clock.now_ms() if at is None else at,
            actor=actor,
            action=action,
            details=dict(details),
            receipt_id=receipt_id,
        )
        return await self._store.append_audit(project, entry)

    async def list(self, project: str, limit: int, before: str | None) -> list[AuditEntry]:
        """Records newest first, those older than ``before`` (see :func:`is_audit_id`)."""
        if before is not None:
            if not is_audit_id(before):
                raise InvalidInput(f"before: {AUDIT_ID_HELP}", field="before")
            if not any(int(part) for part in before.split("-")):
                return []  # nothing comes before the first possible id
        return await self._store.list_audit(project, limit, before)
