"""Redis backend, state keys remembered through MCP (service/domain/store/remembered.py): one hash per
conversation (name -> ``"<made_at>|<keep_until>|<value>"``, the key expiring at its latest ``keep_until``),
and per caller a set of the conversations with one (expiring with the latest), which an erasure walks. Each
key is one slot; the set may name a hash already gone (harmless: deleting it again deletes nothing)."""

from __future__ import annotations

from ...domain.store.refs import CallerRef
from ...domain.store.remembered import RememberedStore, RememberedValue
from ...domain.store.transcripts import ConversationKey
from . import keys
from .caller_lists import drop_listed, list_conversation
from .transport import Call, RedisTransport


def remembered_key(project: str, conversation_id: str) -> str:
    return f"{keys.project_key(project)}:remembered:{conversation_id}"


def remembered_callers_key(project: str, subject: str) -> str:
    return f"{keys.project_key(project)}:remembered-of:{subject}"


class RedisRemembered(RememberedStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def remember_state(
        self,
        key: ConversationKey,
        subject: str,
        name: str,
        value: RememberedValue,
        *,
        keep_until_ms: int,
        now_ms: int,
    ) -> None:
        if keep_until_ms <= now_ms:
            return
        listed = remembered_callers_key(key.project, subject)
        held = remembered_key(key.project, key.conversation_id)
        async with Call("remember_state", self._timeout):
            # The caller's set first: a value is never kept where an erasure would not find it.
            await list_conversation(self._transport, listed, key.conversation_id, keep_until_ms)
            await self._transport.run(
                ("HSET", held, name, b"%d|%d|%s" % (value.made_at, keep_until_ms, value.value)),
                ("PEXPIREAT", held, keep_until_ms, "NX"),
                ("PEXPIREAT", held, keep_until_ms, "GT"),
            )

    async def remembered_state(self, key: ConversationKey, now_ms: int) -> dict[str, RememberedValue]:
        async with Call("remembered_state", self._timeout):
            (found,) = await self._transport.run(
                ("HGETALL", remembered_key(key.project, key.conversation_id))
            )
        pairs = found.items() if isinstance(found, dict) else zip(found[::2], found[1::2], strict=True)
        out: dict[str, RememberedValue] = {}
        for raw_name, raw in pairs:
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            made_at, until, value = bytes(raw).split(b"|", 2)
            if int(until) > now_ms:
                out[name] = RememberedValue(value, int(made_at))
        return out

    async def forget_remembered(self, key: ConversationKey) -> None:
        async with Call("forget_remembered", self._timeout):
            await self._transport.run(("DEL", remembered_key(key.project, key.conversation_id)))

    async def drop_remembered(self, caller: CallerRef) -> int:
        listed = remembered_callers_key(caller.project, caller.subject)
        async with Call("drop_remembered", self._timeout):
            return await drop_listed(
                self._transport,
                listed,
                lambda conversation_id: remembered_key(caller.project, conversation_id),
            )
