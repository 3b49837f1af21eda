"""Redis backend, the memory proxy's upstream (service/domain/store/llm.py): one string per project, in the
project's own key space (one key: any slot on a cluster)."""

from __future__ import annotations

from ...domain.store.llm import LlmStore
from . import keys
from .transport import Call, RedisTransport


def llm_key(project: str) -> str:
    """The string holding a project's upstream document (beside its configuration, ``keys.project_key``)."""
    return keys.project_key(project) + ":llm"


class RedisLlm(LlmStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def put_llm(self, project: str, document: bytes) -> bool:
        async with Call("put_llm", self._timeout):
            (previous,) = await self._transport.run(("SET", llm_key(project), document, "GET"))
        return previous is None

    async def get_llm(self, project: str) -> bytes | None:
        async with Call("get_llm", self._timeout):
            (found,) = await self._transport.run(("GET", llm_key(project)))
        return None if found is None else bytes(found)

    async def delete_llm(self, project: str) -> bool:
        async with Call("delete_llm", self._timeout):
            (removed,) = await self._transport.run(("DEL", llm_key(project)))
        return bool(int(removed))
