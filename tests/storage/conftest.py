"""Fixtures of the storage contract suite: one ``store`` fixture parametrised over every backend.

One real redis-server serves the whole session (the session fixture ``redis_server`` of
``tests/conftest.py``); it is flushed before each test that uses it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio
from caller_memory.service.storage import open_store
from caller_memory.service.storage.base import Store
from caller_memory.service.storage.redis import RedisStore

from tests.support.redis_server import RedisServer


@pytest.fixture
def flushed_redis(redis_server: RedisServer) -> RedisServer:
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "redis":
        url = request.getfixturevalue("flushed_redis").url
    else:
        url = f"sqlite:///{tmp_path}/t.db"
    backend = open_store(url)
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def redis_store(flushed_redis: RedisServer) -> AsyncIterator[RedisStore]:
    backend = RedisStore(flushed_redis.url)
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
async def redis_client(flushed_redis: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client to look at what the Redis backend left on the server."""
    client = redis.asyncio.Redis.from_url(flushed_redis.url)
    try:
        yield client
    finally:
        await client.aclose()
