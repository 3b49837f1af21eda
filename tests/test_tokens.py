"""Token lookups cached per process: how long another process's revocation can take to be seen."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.errors import Unauthenticated
from caller_memory.service.domain.retention import AuditLog
from caller_memory.service.domain.tokens import TokenService
from caller_memory.service.storage.sqlite import SQLiteStore

CACHE_SECONDS = 0.4


async def test_a_revocation_elsewhere_is_seen_within_the_cache_time_however_the_header_is_written(
    tmp_path: Path,
) -> None:
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'tokens.db'}")
    await store.open()
    try:
        clock = FakeClock()
        here = TokenService(store, clock, None, CACHE_SECONDS, AuditLog(store, clock))  # revokes
        there = TokenService(store, clock, None, CACHE_SECONDS, AuditLog(store, clock))  # another process
        minted = await here.mint("shop", "agent", actor="test")
        assert (await there.authenticate(f"Bearer {minted.secret}")).token_id == minted.record.token_id
        await asyncio.sleep(CACHE_SECONDS * 0.6)
        # The same token, written differently: a new entry of the credential cache, from the token record
        # read 0.6 cache-times ago.
        assert (await there.authenticate(f"bearer  {minted.secret}")).token_id == minted.record.token_id
        await here.revoke("shop", minted.record.token_id, actor="test")
        await asyncio.sleep(CACHE_SECONDS * 0.6)  # 1.2 cache-times after the token was read
        for header in (f"Bearer {minted.secret}", f"bearer  {minted.secret}"):
            with pytest.raises(Unauthenticated):
                await there.authenticate(header)
    finally:
        await store.close()


class SlowLookups:
    """The store, with token lookups held until released (a lookup in flight while a revocation runs)."""

    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.release = asyncio.Event()

    async def get_token(self, token_id: str) -> object:
        record = await self.store.get_token(token_id)
        await self.release.wait()
        return record

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


async def test_a_lookup_that_overlaps_a_revocation_does_not_bring_the_token_back(tmp_path: Path) -> None:
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'tokens.db'}")
    await store.open()
    try:
        slow = SlowLookups(store)
        tokens = TokenService(slow, FakeClock(), None, 60.0, AuditLog(store, FakeClock()))  # type: ignore[arg-type]
        minted = await tokens.mint("shop", "agent", actor="test")
        tokens._cache.clear()  # as in another process: the token must be looked up
        lookup = asyncio.create_task(tokens.authenticate(f"Bearer {minted.secret}"))
        await asyncio.sleep(0.05)  # the lookup has read the record and waits
        await tokens.revoke("shop", minted.record.token_id, actor="test")
        slow.release.set()
        assert (await lookup).token_id == minted.record.token_id  # it started before the revocation
        with pytest.raises(Unauthenticated):  # but did not put the token back in the cache
            await tokens.authenticate(f"Bearer {minted.secret}")
    finally:
        await store.close()
