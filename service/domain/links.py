"""Linked identifiers (SPEC sections 13 and 14): one caller profile reached through up to five identifiers.

Linking is opt-in per project (``repeat_caller.identity_linking``) and purpose-bound: the product's rule is
that memory must not build caller profiles, so a link is made deliberately, by an admin, or by an agent in a
call whose caller passed a step-up check. The store's side (aliases, the merge rule, its steps) is
:mod:`caller_memory.service.domain.store.links`; here are the rules a request must meet and what it is told.

What a link is shown as: its kind and a random link id, never the identifier or its pseudonym; times are
rounded to the hour like every time about a caller. A link lives ``retention`` from when it was made (making
it again renews it); erasure through any identifier removes the profile, every link, and every linked
identifier's own data.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .audit import AuditLog
from .clock import Clock, ceil_hour_ms, floor_hour_ms
from .errors import Conflict, Forbidden, InvalidIdentifier, InvalidInput, NotFound
from .limits import MAX_ANY_IDENTIFIER_CHARS
from .memory import Caller, MemoryService
from .projects import Project, validation_problem
from .store import CallerRef, Store
from .store.links import Link, LinkResult, LinkStatus, ProfileMoved
from .trust import STEP_UP_HELP

#: Identifiers per profile, its first one included (SPEC section 14).
MAX_IDENTIFIERS = 5
LINK_ID_PREFIX = "lnk_"
#: Link ids are letters only: a run of digits in one would be masked in logs as if it were a phone number.
_LINK_ID_ALPHABET = string.ascii_lowercase
_LINK_ID_CHARS = 20  # 94 bits


class LinkBody(BaseModel):
    """``POST /v1/projects/{project}/callers/{identifier}/links``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    identifier: str = Field(
        max_length=MAX_ANY_IDENTIFIER_CHARS,
        description="the identifier to link: a phone number, `email:ada@example.com` or `account:A-1234`",
    )
    merge: bool = Field(
        default=False,
        description="the identifier has memory of its own: merge it into this caller's (per field the later "
        "write wins; the first interaction is the earlier one). Without it such a link is refused (409)",
    )
    step_up: bool = Field(
        default=False, description=f"{STEP_UP_HELP}: an agent may link only with it (an admin needs none)"
    )


def new_link_id() -> str:
    return LINK_ID_PREFIX + "".join(secrets.choice(_LINK_ID_ALPHABET) for _ in range(_LINK_ID_CHARS))


def is_link_id(text: str) -> bool:
    tail = text[len(LINK_ID_PREFIX) :]
    return (
        text.startswith(LINK_ID_PREFIX)
        and len(tail) == _LINK_ID_CHARS
        and all(c in _LINK_ID_ALPHABET for c in tail)
    )


@dataclass(frozen=True, slots=True)
class Linked:
    """What a link request did."""

    link: Link
    created: bool
    fields_merged: int
    first_interaction_merged: bool


def link_body(link: Link) -> dict[str, Any]:
    return {
        "link_id": link.link_id,
        "kind": link.kind,
        "linked_at": floor_hour_ms(link.linked_at),
        "expires_at": ceil_hour_ms(link.expires_at),
        "merging": link.merging,
    }


_REFUSALS = {
    LinkStatus.SAME: (InvalidInput, "identifier: it is the caller's own identifier"),
    LinkStatus.ELSEWHERE: (
        Conflict,
        "identifier: it is linked to another caller already; unlink it there first",
    ),
    LinkStatus.HAS_LINKS: (
        Conflict,
        "identifier: other identifiers are linked to it; unlink them first (or link each of them here)",
    ),
    LinkStatus.NEEDS_MERGE: (
        Conflict,
        'identifier: it has memory of its own; send "merge": true to merge it into this caller\'s '
        "(per field the later write wins, the first interaction is the earlier one)",
    ),
    LinkStatus.TOO_MANY: (
        Conflict,
        f"identifier: a caller has at most {MAX_IDENTIFIERS} identifiers (its own and "
        f"{MAX_IDENTIFIERS - 1} links); unlink one first",
    ),
}


class LinkService:
    def __init__(self, store: Store, memory: MemoryService, audit: AuditLog, clock: Clock) -> None:
        self._store = store
        self._memory = memory
        self._audit = audit
        self._clock = clock

    def _caller(self, project: Project, raw: str, where: str) -> Caller:
        try:
            return self._memory.caller(project, raw)
        except InvalidIdentifier as exc:
            if where == "identifier":  # the path's: reported as every path identifier is
                raise
            raise InvalidInput(f"{where}: {exc.detail}", field=where) from None

    async def _profile(self, project: Project, caller: Caller, now: int) -> CallerRef:
        ref = CallerRef(project.project_id, caller.subject)
        return CallerRef(project.project_id, await self._store.resolve_profile(ref, now))

    async def link(
        self, project: Project, raw_identifier: str, document: Any, *, actor: str, agent: bool
    ) -> Linked:
        """Link the body's identifier to the caller of ``raw_identifier`` (through any of their identifiers).
        ``agent``: the request is an agent's, which may link only in a call that passed a step-up check."""
        caller = self._caller(project, raw_identifier, "identifier")
        if not isinstance(document, dict):
            raise InvalidInput("the body must be a JSON object with an `identifier`", field="body")
        try:
            body = LinkBody.model_validate(document)
        except ValidationError as exc:
            raise validation_problem(exc, what="link", error=InvalidInput) from None
        other = self._caller(project, body.identifier, "body.identifier")
        if not project.identity_linking:
            raise Forbidden(
                "this project does not link identifiers (memory.repeat_caller.identity_linking is false)"
            )
        if agent and not body.step_up:
            raise Forbidden(
                "an agent may link identifiers only in a call whose caller passed a step-up check"
            )
        if caller.blacklisted or other.blacklisted:
            raise InvalidInput("identifier: a blacklisted identifier is never linked", field="identifier")
        now = self._clock.now_ms()
        profile = await self._profile(project, caller, now)
        link = Link(
            link_id=new_link_id(),
            kind=other.kind,
            subject=other.subject,
            linked_at=now,
            expires_at=now + project.retention_ms,
        )
        try:
            result = await self._link(profile, link, body.merge, now)
        except ProfileMoved as moved:  # the profile became an alias in between: link to where it points
            result = await self._link(CallerRef(project.project_id, moved.profile), link, body.merge, now)
        refusal = _REFUSALS.get(result.status)
        if refusal is not None:
            error, message = refusal
            raise InvalidInput(message, field="identifier") if error is InvalidInput else error(message)
        assert result.link is not None
        created = result.status is LinkStatus.LINKED
        await self._audit.record(
            project.project_id,
            actor,
            "link.created" if created else "link.renewed",
            {
                "link_id": result.link.link_id,
                "kind": result.link.kind,
                "merged_fields": result.fields_merged,
                "first_interaction_merged": result.first_interaction_merged,
                "by_agent_after_step_up": agent,
            },
            at=floor_hour_ms(now),
        )
        return Linked(result.link, created, result.fields_merged, result.first_interaction_merged)

    async def _link(self, profile: CallerRef, link: Link, merge: bool, now: int) -> LinkResult:
        return await self._store.link_identifier(
            profile, link, merge=merge, max_links=MAX_IDENTIFIERS - 1, now_ms=now
        )

    async def links(self, project: Project, raw_identifier: str) -> list[Link]:
        caller = self._caller(project, raw_identifier, "identifier")
        now = self._clock.now_ms()
        return await self._store.list_links(await self._profile(project, caller, now), now)

    async def unlink(self, project: Project, raw_identifier: str, other: str, *, actor: str) -> Link:
        """Unlink ``other`` (an identifier, or a link id as the list shows it) from the caller's profile."""
        caller = self._caller(project, raw_identifier, "identifier")
        now = self._clock.now_ms()
        profile = await self._profile(project, caller, now)
        if is_link_id(other):
            removed = await self._store.unlink_identifier(profile, now, link_id=other)
        else:
            subject = self._caller(project, other, "other").subject
            removed = await self._store.unlink_identifier(profile, now, subject=subject)
        if removed is None:
            raise NotFound("the caller has no such linked identifier")
        await self._audit.record(
            project.project_id,
            actor,
            "link.removed",
            {"link_id": removed.link_id, "kind": removed.kind},
            at=floor_hour_ms(now),
        )
        return removed
