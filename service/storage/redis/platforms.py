"""Redis backend, platform connections (service/domain/store/platforms.py): one hash per project, a field
per platform, in the project's own key space (one key: any slot on a cluster, each operation atomic)."""

from __future__ import annotations

from ...domain.store.platforms import PlatformStore
from . import keys
from .transport import Call, RedisTransport


def platforms_key(project: str) -> str:
    """The hash of a project's connection documents by platform (beside its configuration,
    ``keys.project_key``)."""
    return keys.project_key(project) + ":platforms"


class RedisPlatforms(PlatformStore):
    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def put_platform_connection(self, project: str, platform: str, document: bytes) -> bool:
        async with Call("put_platform_connection", self._timeout):
            (added,) = await self._transport.run(("HSET", platforms_key(project), platform, document))
        return bool(int(added))

    async def get_platform_connection(self, project: str, platform: str) -> bytes | None:
        async with Call("get_platform_connection", self._timeout):
            (found,) = await self._transport.run(("HGET", platforms_key(project), platform))
        return None if found is None else bytes(found)

    async def delete_platform_connection(self, project: str, platform: str) -> bool:
        async with Call("delete_platform_connection", self._timeout):
            (removed,) = await self._transport.run(("HDEL", platforms_key(project), platform))
        return bool(int(removed))
