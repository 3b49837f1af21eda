"""Conversations written straight through the store, for tests and benches that need many of them."""

from __future__ import annotations

import asyncio

from caller_memory.service.domain.projects import Project
from caller_memory.service.domain.store.transcripts import ConversationKey, EndClaim
from caller_memory.service.http.app_keys import Services


async def ended_conversations(services: Services, shop: Project, raw: str, count: int, prefix: str) -> None:
    """``count`` conversations of the caller ``raw`` on the phone, each ended completed, as the store keeps
    them (written through the store: the end processing of each is not what is measured)."""
    caller = services.transcripts.caller(shop, raw)
    store, now = services.store, services.clock.now_ms()

    async def one(i: int) -> None:
        key = ConversationKey(shop.project_id, f"{prefix}-{i:05d}")
        write = services.transcripts.appends.write(
            shop,
            key,
            caller,
            caller.subject,
            channel="phone",
            agent="",
            messages=[],
            checkpoint=None,
            made_at=now,
            now=now,
        )
        await store.append_messages(write, now)
        await store.claim_end(EndClaim(key, "explicit", "completed", None, now + 60_000), now)
        await store.finish_end(key, now)

    for start in range(0, count, 100):
        await asyncio.gather(*(one(i) for i in range(start, min(count, start + 100))))
