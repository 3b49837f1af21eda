"""Per-caller lists of a project's conversations that hold something of the caller outside the conversation's
own slot (the memory proxy's last answer, the keys a call remembered through MCP): a set per caller, which
an erasure walks to delete each conversation's key. The set is written before what it lists, so nothing is
kept where an erasure would not find it; it may name a key already gone (deleting it again deletes nothing).
Each key is one slot, so each command stands alone on a cluster."""

from __future__ import annotations

from collections.abc import Callable

from .transport import RedisTransport


async def list_conversation(
    transport: RedisTransport, listed: str, conversation_id: str, until_ms: int
) -> None:
    """Add ``conversation_id`` to the caller's set ``listed``, which lives at least until ``until_ms``."""
    await transport.run(
        ("SADD", listed, conversation_id),
        ("PEXPIREAT", listed, until_ms, "NX"),
        ("PEXPIREAT", listed, until_ms, "GT"),
    )


async def drop_listed(transport: RedisTransport, listed: str, key_of: Callable[[str], str]) -> int:
    """Delete the key (``key_of(conversation_id)``) of each conversation the set ``listed`` names, then the
    set; how many keys there were."""
    (members,) = await transport.run(("SMEMBERS", listed))
    dropped = 0
    for member in members or ():
        conversation_id = member.decode() if isinstance(member, bytes) else str(member)
        (removed,) = await transport.run(("DEL", key_of(conversation_id)))
        dropped += int(removed)
    await transport.run(("DEL", listed))
    return dropped
