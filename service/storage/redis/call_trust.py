"""Redis backend, call trust (service/domain/store/call_trust.py): one hash per conversation in the project's
key space (``attestation``, ``step_up``, ``expires_at``; one key, any slot on a cluster), kept and raised by
one script (``call_trust.lua``), so that trust only rises whatever the order of concurrent writes."""

from __future__ import annotations

from ...domain.store.call_trust import CallTrustStore
from . import keys
from .transport import Call, RedisTransport, hash_reply

#: The scripts this module runs (registered by RedisStore.open).
CALL_TRUST_SCRIPTS = ("call_trust",)


def call_trust_key(project: str, conversation_id: str) -> str:
    return f"{keys.project_key(project)}:call-trust:{conversation_id}"


class RedisCallTrust(CallTrustStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def keep_call_trust(
        self,
        project: str,
        conversation_id: str,
        attestation: str,
        *,
        step_up: bool,
        expires_at_ms: int,
        now_ms: int,
    ) -> None:
        async with Call("keep_call_trust", self._timeout):
            await self._transport.script(
                "call_trust",
                [call_trust_key(project, conversation_id)],
                [attestation, "1" if step_up else "0", expires_at_ms, now_ms],
            )

    async def raise_step_up(
        self, project: str, conversation_id: str, expires_at_ms: int, now_ms: int
    ) -> None:
        await self.keep_call_trust(
            project, conversation_id, "unknown", step_up=True, expires_at_ms=expires_at_ms, now_ms=now_ms
        )

    async def call_trust(self, project: str, conversation_id: str, now_ms: int) -> tuple[str, bool] | None:
        async with Call("call_trust", self._timeout):
            (reply,) = await self._transport.run(("HGETALL", call_trust_key(project, conversation_id)))
        data = hash_reply(reply)
        if not data or int(data.get(b"expires_at", b"0")) <= now_ms:
            return None
        return data.get(b"attestation", b"unknown").decode(), data.get(b"step_up") == b"1"
