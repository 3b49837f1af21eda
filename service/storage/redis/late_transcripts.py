"""Redis backend, a platform's late transcript (service/domain/store/late_transcripts.py): one script
(``transcript_late.lua``) in the conversation's slot, then its bytes added to the project's count
(``transcript_tally.lua``, in the project's slot), as an append's are on a cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...domain.clock import HOUR_MS
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

    if TYPE_CHECKING:
        # Provided by RedisTranscripts (service/storage/redis/transcripts.py).
        async def _tally(
            self, project: str, hour: int, amount: int, prune_before: int = 0, until: int = 0
        ) -> None: ...

    async def add_late_messages(
        self, key: ConversationKey, messages: Sequence[NewMessage], now_ms: int
    ) -> bool:
        header, listed, index, _ = keys.transcript_keys(key.project, key.conversation_id)
        args: list[str | bytes | int] = [now_ms, len(messages)]
        for m in messages:
            args += [m.turn_id, m.message_id or "", m.tokens, m.body]
        async with Call("add_late_messages", self._timeout):
            expires_at = int(await self._transport.script("transcript_late", [header, listed, index], args))
            if not expires_at:
                return False
            added = sum(len(m.body) for m in messages)
            prune = now_ms - max(0, expires_at - now_ms) - HOUR_MS
            await self._tally(key.project, now_ms - now_ms % HOUR_MS, added, prune, expires_at)
        return True
