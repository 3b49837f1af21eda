"""Fixtures of the storage contract suite: one ``store`` fixture parametrised over every backend.

One real redis-server and one real Redis Cluster (3 primaries, 3 replicas) serve the whole session (the
session fixtures ``redis_server`` and ``redis_cluster`` of ``tests/conftest.py``); they are flushed before
each test that uses them (every primary of the cluster).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from caller_memory.service.domain.store import Store
from caller_memory.service.storage import open_store
from caller_memory.service.storage.redis.store import RedisStore

from tests.conftest import CLUSTER, empty_store_url

REDIS_BACKENDS = ["redis", CLUSTER]


#: The standalone Redis with the read cache on (CALLER_MEMORY_READ_CACHE_SECONDS): the whole contract holds
#: with memory reads served from the cache (the store's own writes are always read back at once).
CACHED = "redis-cached"


@pytest.fixture(params=["sqlite", *REDIS_BACKENDS, CACHED])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    # A generous store timeout: the contract is what a store does, not how fast (50 concurrent patches to one
    # caller, each fsynced and confirmed by a replica on the cluster, outlasted 0.5 s on a loaded machine).
    # The timeout itself has its own tests, with their own stores.
    cached = request.param == CACHED
    url = empty_store_url(request, "redis" if cached else request.param, tmp_path)
    backend = open_store(url, timeout=5.0, cache_seconds=1.0 if cached else 0.0)
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(params=REDIS_BACKENDS)
def redis_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty standalone Redis, or an empty Redis Cluster."""
    return empty_store_url(request, request.param, tmp_path)


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    # The same generous timeout as ``store``: 36 claims racing from three stores outlasted 0.5 s in CI once.
    backend = RedisStore(redis_url, socket_timeout=5.0)
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


class WholeCluster(redis.asyncio.RedisCluster):
    """A cluster client whose ``KEYS`` looks at every primary (redis-py sends it to one node; ``SCRIPT FLUSH``
    already goes to every primary)."""

    async def keys(self, pattern: Any = "*", **kwargs: Any) -> Any:
        return await super().keys(pattern, target_nodes=self.PRIMARIES, **kwargs)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[redis.asyncio.Redis | redis.asyncio.RedisCluster]:
    """A plain client to look at what the Redis backend left on the server (or on every primary)."""
    client: redis.asyncio.Redis | redis.asyncio.RedisCluster
    if redis_url.startswith("redis+cluster://"):
        host, _, port = redis_url.removeprefix("redis+cluster://").split(",")[0].rstrip("/").partition(":")
        client = WholeCluster(host=host, port=int(port))
    else:
        client = redis.asyncio.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()
