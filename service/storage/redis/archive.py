"""Redis backend, the archive index (service/domain/store/archive.py): a sorted set per caller, in the
caller's slot (object key -> expiry), that expires with its last entry. One script lists an object, after
the same tombstone check as a transcript's registration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...domain.store.archive import ArchiveStore
from . import keys
from .transport import Call, RedisTransport

if TYPE_CHECKING:
    from ...domain.store import CallerRef


class RedisArchiveIndex(ArchiveStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def list_archived(
        self, caller: CallerRef, object_key: str, expires_at: int, made_at: int, now_ms: int
    ) -> bool:
        script_keys = [
            keys.caller_archive_key(caller.project, caller.subject),
            keys.tombstone_key(caller.project, caller.subject),
        ]
        async with Call("list_archived", self._timeout):
            listed = await self._transport.script(
                "archive_index", script_keys, [now_ms, made_at, object_key, expires_at]
            )
        return bool(int(listed))

    async def archived_objects(self, caller: CallerRef, now_ms: int) -> list[str]:
        key = keys.caller_archive_key(caller.project, caller.subject)
        async with Call("archived_objects", self._timeout):
            (found,) = await self._transport.run(("ZRANGE", key, f"({now_ms}", "+inf", "BYSCORE"))
        return sorted(member.decode() for member in found)

    async def unlist_archived(self, caller: CallerRef, object_keys: Sequence[str]) -> int:
        if not object_keys:
            return 0
        key = keys.caller_archive_key(caller.project, caller.subject)
        async with Call("unlist_archived", self._timeout):
            (removed,) = await self._transport.run(("ZREM", key, *dict.fromkeys(object_keys)))
        return int(removed)
