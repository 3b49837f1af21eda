"""The linked-identifier part of the Store interface (SPEC sections 13 and 14): one caller profile reachable
through several identifiers. :class:`~caller_memory.service.domain.store.core.Store` inherits it; every backend implements it with identical
semantics (tests/storage/test_links.py).

Terms. A *profile* is named by the pseudonym of its first identifier (its ``subject``: nothing stored before
linking existed moves). A *link* makes another identifier's pseudonym an *alias* of the profile: every read of
the alias reads the profile, and every write to the alias is refused with :class:`ProfileMoved` (naming the
profile) so that the domain writes to the profile instead. An alias points to a profile, never to another
alias (one hop at most), and a profile that has links is never itself made an alias.

Where things live. The alias record is kept with the alias's own subject (on Redis: in the alias's slot), so
that a write to the alias sees it atomically; the profile's list of links is kept with the profile. On a
backend where the two are not in one atomic step (Redis Cluster), :meth:`LinkStore.link_identifier` goes in
resumable steps, each idempotent; a crash between them leaves the link ``merging`` until the same link is made
again (which finishes it). A read during a merge sees one side's fields or the other's, never neither.

The merge rule (an alias that has memory of its own, linked with ``merge=True``): per field, the one written
later (``written_at``) wins, the profile's on a tie; the first interaction is the earlier one (by
``created_at``); the alias's own fields and first-interaction record are then removed. The alias's ended
conversations, transcripts and analytics listing entries stay under the alias's subject: erasure reaches
them through the link (the domain erases every linked subject with the profile).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CallerMemoryError

if TYPE_CHECKING:
    from .refs import CallerRef

#: Identifier kinds, as links record them.
KINDS = ("phone", "email", "account")


class ProfileMoved(CallerMemoryError):
    """A write named a subject that is a live alias of another profile; nothing was written.

    Raised by :meth:`Store.patch_fields`, :meth:`Store.end_conversation` and
    :meth:`LinkStore.link_identifier` (when the *profile* given is an alias). The domain retries on
    ``profile``."""

    def __init__(self, profile: str) -> None:
        super().__init__("the caller's identifier is linked to another profile")
        self.profile = profile


@dataclass(frozen=True, slots=True)
class Link:
    """One identifier linked to a profile. ``subject`` is the identifier's pseudonym: it is never returned
    over HTTP (the random ``link_id`` is)."""

    link_id: str
    kind: str
    subject: str
    linked_at: int
    expires_at: int
    #: A merge was begun and not finished (a crash between its steps); making the same link again ends it.
    merging: bool = False


class LinkStatus(enum.Enum):
    #: A new link (after a merge, if the identifier had memory and ``merge`` was given).
    LINKED = "linked"
    #: Already linked to this profile: its expiry is renewed (and an unfinished merge finished).
    RENEWED = "renewed"
    #: The identifier is a live alias of another profile: nothing changed.
    ELSEWHERE = "elsewhere"
    #: The identifier is itself a profile with links of its own: nothing changed.
    HAS_LINKS = "has_links"
    #: The identifier has memory (a live field or a first interaction) and ``merge`` was False: nothing changed.
    NEEDS_MERGE = "needs_merge"
    #: The profile has ``max_links`` live links already: nothing changed.
    TOO_MANY = "too_many"
    #: The identifier is the profile itself: nothing changed.
    SAME = "same"


@dataclass(frozen=True, slots=True)
class LinkResult:
    status: LinkStatus
    #: The link as stored (its ``link_id`` is the existing one when RENEWED); None unless LINKED or RENEWED.
    link: Link | None = None
    #: Fields of the identifier's own memory that the merge moved into the profile (the later write won).
    fields_merged: int = 0
    #: The identifier's first interaction was earlier than the profile's and replaced it.
    first_interaction_merged: bool = False


class LinkStore(ABC):
    @abstractmethod
    async def resolve_profile(self, caller: CallerRef, now_ms: int) -> str:
        """The subject of the profile ``caller.subject`` belongs to: the profile a live alias record names,
        else ``caller.subject`` itself. One round trip."""

    @abstractmethod
    async def link_identifier(
        self, profile: CallerRef, link: Link, *, merge: bool, max_links: int, now_ms: int
    ) -> LinkResult:
        """Make ``link.subject`` an alias of ``profile.subject`` until ``link.expires_at``.

        ``link.link_id`` (random, made by the domain), ``kind``, ``linked_at`` and ``expires_at`` are stored as
        given for a new link; a RENEWED link keeps its id and ``linked_at`` and takes the new ``expires_at``.
        Raises :class:`ProfileMoved` if ``profile.subject`` is itself a live alias. Refuses (status, nothing
        changed) an identifier linked elsewhere, one with links of its own, one with memory unless ``merge``,
        the profile itself, and a new link beyond ``max_links`` live links. With ``merge``, applies the merge
        rule of this module; idempotent, and resumable after a crash (see the module docstring)."""

    @abstractmethod
    async def list_links(self, profile: CallerRef, now_ms: int) -> list[Link]:
        """The profile's live links (``expires_at`` after ``now_ms``), oldest ``linked_at`` first."""

    @abstractmethod
    async def unlink_identifier(
        self, profile: CallerRef, now_ms: int, *, subject: str | None = None, link_id: str | None = None
    ) -> Link | None:
        """Remove the profile's link to the identifier ``subject`` (or the link ``link_id``): the identifier
        is no longer an alias (an empty caller of its own again); what a merge moved stays with the profile.
        Returns the removed link, or None when the profile has no such live link (nothing changed)."""
