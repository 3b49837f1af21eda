"""Redis backend, a platform's late transcript (service/domain/store/late_transcripts.py): one script
(``transcript_late.lua``) in the conversation's slot."""

from __future__ import annotations

from collections.abc import Sequence

from ...domain.store.late_transcripts import LateTranscriptStore
from ...domain.store.transcripts import ConversationKey, NewMessage
from . import keys
from .transport import Call, RedisTransport

#: The scripts this module runs (registered by RedisStore.open).
LATE_TRANSCRIPT_SCRIPTS = ("transcript_late",)


class RedisLateTranscripts(LateTranscriptStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def add_late_messages(
        self, key: ConversationKey, messages: Sequence[NewMessage], now_ms: int
    ) -> bool:
        header, listed, index, _ = keys.transcript_keys(key.project, key.conversation_id)
        args: list[str | bytes | int] = [now_ms, len(messages)]
        for m in messages:
            args += [m.turn_id, m.message_id or "", m.tokens, m.body]
        async with Call("add_late_messages", self._timeout):
            reply = await self._transport.script("transcript_late", [header, listed, index], args)
        return bool(int(reply))
