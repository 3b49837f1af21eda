"""Redis backend, platform events (service/domain/store/platform_events.py): an event id's sighting is one
string in the project's key space (its value the expiry, its TTL the same), set by one script; held ends are
one hash of documents and one sorted set of due times under one hash tag (one slot on a cluster), so that a
hold and a take are each one atomic script."""

from __future__ import annotations

import hashlib
from typing import Any

from ...domain.store.platform_events import PlatformEventStore
from . import keys
from .transport import Call, RedisTransport

#: The scripts this module runs (registered by RedisStore.open).
PLATFORM_EVENT_SCRIPTS = ("platform_event", "platform_end_hold", "platform_end_take")

HELD_ENDS_KEY = "cm:{platform-ends}:documents"
HELD_ENDS_DUE_KEY = "cm:{platform-ends}:due"


def event_key(project: str, platform: str, event_id: str) -> str:
    """An event id's sighting: hashed, so that a platform's id of any length or alphabet makes one key."""
    digest = hashlib.sha256(event_id.encode("utf-8")).hexdigest()
    return f"{keys.project_key(project)}:platform-event:{platform}:{digest}"


def inactivity_hold_key(project: str, conversation_id: str) -> str:
    """A platform conversation's hold on its inactivity end (its value the time it holds until)."""
    return f"{keys.project_key(project)}:inactivity-hold:{conversation_id}"


def held_member(project: str, conversation_id: str) -> bytes:
    return project.encode() + b"\x00" + conversation_id.encode()


class RedisPlatformEvents(PlatformEventStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def first_sighting(
        self, project: str, platform: str, event_id: str, now_ms: int, keep_until_ms: int
    ) -> bool:
        async with Call("first_sighting", self._timeout):
            reply = await self._transport.script(
                "platform_event", [event_key(project, platform, event_id)], [now_ms, keep_until_ms]
            )
        return bool(int(reply))

    async def hold_inactivity_end(
        self, project: str, conversation_id: str, until_ms: int, now_ms: int
    ) -> None:
        async with Call("hold_inactivity_end", self._timeout):
            await self._transport.run(
                (
                    "SET",
                    inactivity_hold_key(project, conversation_id),
                    until_ms,
                    "PX",
                    max(1, until_ms - now_ms),
                )
            )

    async def inactivity_end_held_until(self, project: str, conversation_id: str, now_ms: int) -> int | None:
        async with Call("inactivity_end_held_until", self._timeout):
            (found,) = await self._transport.run(("GET", inactivity_hold_key(project, conversation_id)))
        if found is None or int(found) <= now_ms:
            return None
        return int(found)

    async def hold_platform_end(
        self, project: str, conversation_id: str, document: bytes, due_ms: int
    ) -> bool:
        member = held_member(project, conversation_id)
        async with Call("hold_platform_end", self._timeout):
            reply = await self._transport.script(
                "platform_end_hold", [HELD_ENDS_KEY, HELD_ENDS_DUE_KEY], [member, document, due_ms]
            )
        return bool(int(reply))

    async def take_platform_end(self, project: str, conversation_id: str) -> bytes | None:
        member = held_member(project, conversation_id)
        async with Call("take_platform_end", self._timeout):
            reply: Any = await self._transport.script(
                "platform_end_take", [HELD_ENDS_KEY, HELD_ENDS_DUE_KEY], [member]
            )
        return None if reply is None else bytes(reply)

    async def due_platform_ends(self, now_ms: int, limit: int) -> list[tuple[str, str]]:
        async with Call("due_platform_ends", self._timeout):
            (members,) = await self._transport.run(
                ("ZRANGEBYSCORE", HELD_ENDS_DUE_KEY, "-inf", now_ms, "LIMIT", 0, limit)
            )
        found: list[tuple[str, str]] = []
        for member in members:
            project, _, conversation_id = bytes(member).partition(b"\x00")
            found.append((project.decode(), conversation_id.decode()))
        return found
