"""Redis backend, linked identifiers (SPEC section 13; :mod:`caller_memory.service.domain.store.links`).

:class:`RedisLinks` is a mixin of :class:`~caller_memory.service.storage.redis.store.RedisStore`; it sends its commands through the store's
transport, as every other operation does. Key names are in :mod:`caller_memory.service.storage.redis.keys`, scripts in ``lua/link_*.lua``.

Layout. An identifier's alias record (``la``, a string ``"<expires_at>|<profile>|<link_id>"``) is in the
identifier's own slot, beside its memory, so that ``patch.lua`` refuses a write to an alias atomically and a
read of it fetches the memory and the record in one round trip. A profile's links (``ll``, a hash: alias
subject -> ``"<state>|<linked_at>|<expires_at>|<kind>|<link_id>"``) are in the profile's slot. Both expire
by themselves (``PEXPIREAT``: the record at its link's expiry, the hash at its latest entry's); reads filter by
the service's clock, and the link scripts drop expired entries on the way. No sweep is needed: what is not
expired by Redis is at most the entries of a live hash, pruned at its next link.

A link spans two slots, so it is made in steps, on one server as on a cluster (one algorithm, proven on both),
each one script in one slot and safe to repeat:

1. profile's slot (``link_reserve.lua``): refuse a profile that is itself an alias (ProfileMoved), the
   profile itself (SAME) and a new link beyond the limit (TOO_MANY); find the identifier's live entry (its id
   and ``linked_at`` are reused: a renewal, or a link cut short) or reserve one, state ``p`` (pending);
2. identifier's slot (``link_alias.lua``): refuse (ELSEWHERE, HAS_LINKS, NEEDS_MERGE; the reservation of
   step 1 is then taken back, ``link_drop.lua``) or set the alias record, and return the identifier's own
   live memory. From here every write to it is refused and every read follows the record;
3. profile's slot (``link_absorb.lua``): merge that memory into the profile's (unless the entry says it was
   merged already) and mark the entry made (``d``);
4. identifier's slot (``link_detach.lua``), only when it had memory: remove its own memory, now the
   profile's, while its record still names the profile.

A crash between steps leaves the entry pending (listed ``merging``) or the identifier's merged memory in
place (unreadable: reads follow the record); making the same link again runs every step again and finishes
it. A pending entry counts as a live link (the profile is not made an alias meanwhile, and it counts toward
the limit) until it is finished, unlinked or expires. A read of the identifier during a merge sees the profile's
fields (before step 3, without the identifier's; after it, merged), a read of the profile its own or the
merged ones: never neither.

Round trips: a read of a caller that is no alias 1 (memory and alias record in one write), of an alias 2;
:meth:`resolve_profile` 1; a link 3 (4 with a merge; 3 when the identifier refuses it; 1 for ProfileMoved,
SAME, TOO_MANY); :meth:`list_links` 1; an unlink 3 (1 when there is no such link).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...domain.errors import StoreCorrupt
from ...domain.store import CallerRef
from ...domain.store.links import Link, LinkResult, LinkStatus, LinkStore, ProfileMoved
from . import keys
from .transport import Call, RedisTransport, hash_reply

#: The scripts of linked identifiers, in ``lua/`` (registered by :meth:`~caller_memory.service.storage.redis.store.RedisStore.open`).
LINK_SCRIPTS = ("link_reserve", "link_alias", "link_absorb", "link_detach", "link_drop")

#: link_alias.lua's refusals.
_REFUSED = {2: LinkStatus.ELSEWHERE, 3: LinkStatus.HAS_LINKS, 4: LinkStatus.NEEDS_MERGE}


def alias_profile(record: bytes | None, now_ms: int) -> str | None:
    """The profile a stored alias record names while it is live (its expiry after ``now_ms``), else None."""
    if record is None:
        return None
    expires, _, rest = record.partition(b"|")
    profile, sep, _ = rest.partition(b"|")
    if not sep or not expires.isdigit():
        raise StoreCorrupt("a stored alias record cannot be read")
    return profile.decode() if int(expires) > now_ms else None


def _link_of(subject: str, entry: bytes) -> Link:
    """A link from its entry in a profile's links, ``"<state>|<linked_at>|<expires_at>|<kind>|<link_id>"``."""
    try:
        state, linked_at, expires_at, kind, link_id = entry.decode().split("|", 4)
        return Link(link_id, kind, subject, int(linked_at), int(expires_at), merging=state != "d")
    except ValueError as exc:
        raise StoreCorrupt("a stored link cannot be read") from exc


class RedisLinks(LinkStore):
    """The linked-identifier methods of the Store interface on Redis (standalone or Redis Cluster)."""

    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def resolve_profile(self, caller: CallerRef, now_ms: int) -> str:
        async with Call("resolve_profile", self._timeout):
            (record,) = await self._transport.run(("GET", keys.alias_key(caller.project, caller.subject)))
        return alias_profile(record, now_ms) or caller.subject

    async def link_identifier(
        self, profile: CallerRef, link: Link, *, merge: bool, max_links: int, now_ms: int
    ) -> LinkResult:
        async with Call("link_identifier", self._timeout):
            found = await self._reserve(profile, link, max_links, now_ms)
            if not isinstance(found, tuple):
                return LinkResult(found)
            reserved, mark = found
            status, memory = await self._make_alias(profile, reserved, merge, now_ms)
            if status in _REFUSED:
                await self._drop(profile, reserved, pending=True)
                return LinkResult(_REFUSED[status])
            merged = await self._absorb(profile, reserved, memory, now_ms, mark)
            if merged is None:
                # The profile was erased after this link began: the erasure wins, and nothing was merged.
                # What step 2 did is undone: the alias record goes, the identifier's own memory stays (had
                # the erasure found it linked, it erased it itself; otherwise it is still its own).
                await self._detach(profile, reserved, now_ms, drop=True, own=False)
                await self._drop(profile, reserved, pending=True)
                return LinkResult(LinkStatus.LINKED, reserved)
            if memory:
                await self._detach(profile, reserved, now_ms, drop=False, own=True)
        fields, first = merged
        return LinkResult(
            LinkStatus.RENEWED if status == 1 else LinkStatus.LINKED,
            reserved,
            fields_merged=fields,
            first_interaction_merged=first,
        )

    async def list_links(self, profile: CallerRef, now_ms: int) -> list[Link]:
        async with Call("list_links", self._timeout):
            (raw,) = await self._transport.run(("HGETALL", keys.links_key(profile.project, profile.subject)))
        return sorted(
            (
                link
                for subject, entry in hash_reply(raw).items()
                if (link := _link_of(subject.decode(), entry)).expires_at > now_ms
            ),
            key=lambda link: (link.linked_at, link.link_id),
        )

    async def unlink_identifier(
        self, profile: CallerRef, now_ms: int, *, subject: str | None = None, link_id: str | None = None
    ) -> Link | None:
        if subject is None and link_id is None:
            return None
        async with Call("unlink_identifier", self._timeout):
            (raw,) = await self._transport.run(("HGETALL", keys.links_key(profile.project, profile.subject)))
            found = [
                link
                for name, entry in hash_reply(raw).items()
                if (subject is None or name.decode() == subject)
                and (link := _link_of(name.decode(), entry)).expires_at > now_ms
                and (link_id is None or link.link_id == link_id)
            ]
            if not found:
                return None
            (removed,) = found
            # The alias record first: once it is gone the identifier is a caller of its own, and the entry
            # alone (a crash in between) names a link nobody follows. Its own memory goes with the record
            # only when the link was made: what is there is what the merge moved (or its remains); a link
            # still being made has not moved anything yet.
            await self._detach(profile, removed, now_ms, drop=True, own=not removed.merging)
            await self._drop(profile, removed, pending=False)
        return removed

    # The steps of a link (separate so that tests can stop between them) --------------------------------

    async def _reserve(
        self, profile: CallerRef, link: Link, max_links: int, now_ms: int
    ) -> tuple[Link, str] | LinkStatus:
        """Step 1, in the profile's slot: the link as it is to be stored (a new reservation, or the
        identifier's live entry) and the profile's erasure mark then (step 3 refuses if it changed), or the
        refusal (SAME, TOO_MANY); raises ProfileMoved."""
        project = profile.project
        reply: list[Any] = await self._transport.script(
            "link_reserve",
            [
                keys.alias_key(project, profile.subject),
                keys.links_key(project, profile.subject),
                keys.tombstone_key(project, profile.subject),
            ],
            [
                now_ms,
                link.subject,
                link.link_id,
                link.kind,
                link.linked_at,
                link.expires_at,
                max_links,
                "1" if link.subject == profile.subject else "",
            ],
        )
        status = int(reply[0])
        if status == 3:
            raise ProfileMoved(reply[1].decode())
        if status == 2:
            return LinkStatus.TOO_MANY
        if status == 4:
            return LinkStatus.SAME
        # The identifier's entry: its id, linked_at and kind; the new expiry (written by step 3).
        link_id, linked_at, kind = reply[1].decode(), int(reply[2]), reply[3].decode()
        return Link(link_id, kind, link.subject, linked_at, link.expires_at), reply[5].decode()

    async def _make_alias(
        self, profile: CallerRef, link: Link, merge: bool, now_ms: int
    ) -> tuple[int, list[Any]]:
        """Step 2, in the identifier's slot: link_alias.lua's status, and the identifier's own live memory as
        link_absorb.lua takes it (F, F pairs of name and packed field, then its first interaction's pairs)."""
        project, subject = profile.project, link.subject
        reply: list[Any] = await self._transport.script(
            "link_alias",
            [
                keys.alias_key(project, subject),
                keys.links_key(project, subject),
                keys.memory_key(project, subject),
                keys.first_interaction_key(project, subject),
            ],
            [now_ms, profile.subject, link.link_id, link.expires_at, "1" if merge else ""],
        )
        status = int(reply[0])
        if status in _REFUSED:
            return status, []
        memory = reply[1:]
        return status, memory if len(memory) > 1 else []

    async def _absorb(
        self, profile: CallerRef, link: Link, memory: Sequence[Any], now_ms: int, mark: str
    ) -> tuple[int, bool] | None:
        """Step 3, in the profile's slot: (fields merged, first interaction merged), or None if the profile
        was erased since step 1 found its erasure ``mark``, or after ``now_ms`` (nothing written)."""
        project, subject = profile.project, profile.subject
        reply: list[Any] = await self._transport.script(
            "link_absorb",
            [
                keys.memory_key(project, subject),
                keys.caller_index_key(subject),
                keys.first_interaction_key(project, subject),
                keys.links_key(project, subject),
                keys.tombstone_key(project, subject),
            ],
            [
                now_ms,
                keys.index_member(project, subject),
                link.subject,
                link.link_id,
                link.kind,
                link.linked_at,
                link.expires_at,
                mark,
                *(memory or (0,)),
            ],
        )
        if int(reply[0]) == 0:
            return None
        return int(reply[1]), int(reply[2]) == 1

    async def _detach(self, profile: CallerRef, link: Link, now_ms: int, *, drop: bool, own: bool) -> bool:
        """Step 4 (``own``), or the removal of the alias record (``drop``), in the identifier's slot, while the
        record names this profile and link. True if it did."""
        project, subject = profile.project, link.subject
        done = await self._transport.script(
            "link_detach",
            [
                keys.alias_key(project, subject),
                keys.memory_key(project, subject),
                keys.caller_index_key(subject),
                keys.first_interaction_key(project, subject),
            ],
            [
                now_ms,
                profile.subject,
                link.link_id,
                keys.index_member(project, subject),
                "1" if drop else "",
                "1" if own else "",
            ],
        )
        return int(done) == 1

    async def _drop(self, profile: CallerRef, link: Link, *, pending: bool) -> bool:
        """Remove the identifier's entry from the profile's links if it is this link (and, with ``pending``,
        still being made). True if it did."""
        removed = await self._transport.script(
            "link_drop",
            [keys.links_key(profile.project, profile.subject)],
            [link.subject, link.link_id, "1" if pending else ""],
        )
        return int(removed) == 1
