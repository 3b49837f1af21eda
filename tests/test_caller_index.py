"""Issue 27, item 7: a start costs what one with a few conversations costs, however many the caller has had;
the caller's conversation listing pages; the caller's region is kept with the conversation. SQLite, Redis
and Redis Cluster, real servers and a real file.

The cost is counted where the work is done, not timed: on Redis the commands the servers ran (``INFO
commandstats`` of every primary, commands run by scripts included), on SQLite the virtual machine steps of
the store's two connections (a progress handler). A start used to read every header of its caller.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
from caller_memory.service.app import build_services
from caller_memory.service.config import Settings
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.domain.projects import Project
from caller_memory.service.domain.store import CallerRef
from caller_memory.service.domain.store.transcripts import ConversationKey, TranscriptStatus
from caller_memory.service.http.app_keys import Services
from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.conftest import CLUSTER, PSEUDONYM_KEY, empty_store_url
from tests.support.conversations import ended_conversations

CALLER = "+14155550100"
CROWDED = "+14155550123"
UK_CALLER = "+442079460000"
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {"state_keys": ["cheese"], "retention": "P30D"},
        "conversation": {"enabled": True, "end_after_inactivity": "PT30M", "idle_after": "PT2M"},
    }
}


class Work:
    """Counts the work a store's backend does between :meth:`reset` and :meth:`count`."""

    def __init__(self, backend: str, request: pytest.FixtureRequest, services: Services) -> None:
        self.backend, self.request, self.services = backend, request, services
        self.steps = 0

    def _clients(self) -> Iterator[redis.Redis]:
        if self.backend == CLUSTER:
            yield from self.request.getfixturevalue("redis_cluster").clients()
        else:
            with self.request.getfixturevalue("redis_server").client() as client:
                yield client

    async def install(self) -> None:
        store = self.services.store
        if not isinstance(store, SQLiteStore):
            return

        def tick() -> int:
            self.steps += 1
            return 0

        def watch(conn: sqlite3.Connection | None) -> Callable[[], None]:
            assert conn is not None
            return lambda: conn.set_progress_handler(tick, 20)

        await store._run(store._reader_pool, watch(store._reader))
        await store._run(store._writer_pool, watch(store._writer))

    def reset(self) -> None:
        self.steps = 0
        if self.backend != "sqlite":
            for client in self._clients():
                client.config_resetstat()

    def count(self) -> int:
        if self.backend == "sqlite":
            return self.steps
        total = 0
        for client in self._clients():
            stats = client.info("commandstats")
            total += sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_"))
            total -= int(stats.get("cmdstat_info", {}).get("calls", 0)) + int(
                stats.get("cmdstat_config|resetstat", {}).get("calls", 0)
            )
        return total


@pytest.fixture(params=["sqlite", "redis", CLUSTER])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Any, clock: FakeClock
) -> AsyncIterator[tuple[Services, Work]]:
    url = empty_store_url(request, request.param, tmp_path)
    built = build_services(
        Settings(pseudonym_key=PSEUDONYM_KEY, store_url=url, store_timeout=10.0), clock=clock
    )
    await built.store.open()
    try:
        work = Work(request.param, request, built)
        await work.install()
        yield built, work
    finally:
        await built.store.close()


def advance(services: Services, seconds: float) -> None:
    """The services run on the fixture's fake clock, which the tests move on."""
    assert isinstance(services.clock, FakeClock)
    services.clock.advance(seconds)


async def project(services: Services, config: dict[str, Any] | None = None) -> Project:
    applied, _ = await services.projects.apply("shop", config or CONFIG, actor="test")
    return applied


async def measured_start(
    services: Services, work: Work, shop: Project, raw: str, tag: str
) -> tuple[int, Any]:
    """A live call of the caller (open), the line drops, the caller calls back: the work of that start."""
    await services.transcripts.append(
        shop,
        f"{tag}-live",
        {"caller": raw, "channel": "phone", "messages": [{"role": "user", "content": "Hi", "turn_id": 0}]},
    )
    advance(services, 60)
    work.reset()
    started = await services.lifecycle.start(shop, f"{tag}-back", {"caller": raw, "channel": "phone"})
    return work.count(), started


async def test_a_starts_work_does_not_grow_with_the_callers_conversations(
    backend: tuple[Services, Work],
) -> None:
    services, work = backend
    shop = await project(services)
    await ended_conversations(services, shop, CALLER, 10, "few")
    await ended_conversations(services, shop, CROWDED, 3000, "many")
    few, started_few = await measured_start(services, work, shop, CALLER, "a")
    many, started_many = await measured_start(services, work, shop, CROWDED, "b")
    # Both starts superseded the live call and offer it for resume, as before.
    assert started_few["superseded"] == ["a-live"] and started_many["superseded"] == ["b-live"]
    assert started_few["resume"]["conversation_id"] == "a-live"
    assert started_many["resume"]["conversation_id"] == "b-live"
    # The work is that of the few (reading 3,000 headers ran 6,000 more commands or so, on SQLite some
    # hundred thousand more steps), within the noise of the store's own bookkeeping.
    assert many <= few * 1.25 + 20, (few, many)


async def test_an_erased_or_deleted_conversation_is_neither_superseded_nor_resumed(
    backend: tuple[Services, Work],
) -> None:
    services, _ = backend
    shop = await project(services)
    await services.transcripts.append(
        shop,
        "gone",
        {"caller": CALLER, "channel": "phone", "messages": [{"role": "user", "content": "Hi", "turn_id": 0}]},
    )
    await services.transcripts.delete(shop, "gone")
    started = await services.lifecycle.start(shop, "next", {"caller": CALLER, "channel": "phone"})
    assert started["superseded"] == [] and started["resume"] is None
    # A dropped call ended, then deleted: no resume of it either.
    advance(services, 60)
    again = await services.lifecycle.start(shop, "third", {"caller": CALLER, "channel": "phone"})
    assert again["superseded"] == ["next"]
    assert again["resume"] is not None and again["resume"]["conversation_id"] == "next"
    await services.transcripts.delete(shop, "next")
    advance(services, 60)
    last = await services.lifecycle.start(shop, "fourth", {"caller": CALLER, "channel": "phone"})
    assert last["superseded"] == ["third"]
    assert last["resume"] is not None and last["resume"]["conversation_id"] == "third"
    # What the store hands a start: the open one and the resumable one, no deleted one.
    subject = services.transcripts.caller(shop, CALLER).subject
    now = services.clock.now_ms()
    found = await services.store.channel_conversations(
        CallerRef("shop", subject), "phone", now, now - 600_000
    )
    assert sorted(h.key.conversation_id for h in found) == ["fourth", "third"]
    assert await services.store.channel_conversations(CallerRef("shop", subject), "chat", now, now) == []


async def test_the_listing_pages_every_conversation_once(backend: tuple[Services, Work]) -> None:
    services, _ = backend
    shop = await project(services)
    await ended_conversations(services, shop, CALLER, 23, "old")
    for i in range(4):  # starts of distinct milliseconds too, one of them still live
        advance(services, 1)
        await services.lifecycle.start(shop, f"new-{i}", {"caller": CALLER, "channel": "phone"})
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = await services.transcripts.for_caller(shop, CALLER, limit=5, cursor=cursor)
        assert len(page["conversations"]) <= 5
        seen += [c["conversation_id"] for c in page["conversations"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted([f"old-{i:05d}" for i in range(23)] + [f"new-{i}" for i in range(4)])
    assert len(seen) == len(set(seen)) and pages == 6
    # Newest start first: the four starts, the latest first, then the 23 of one millisecond by id, descending.
    assert seen[:4] == ["new-3", "new-2", "new-1", "new-0"] and seen[4:] == sorted(seen[4:], reverse=True)
    for bad in ("nope", "MTIz", "eHl6Lm9uZQ"):
        with pytest.raises(InvalidInput) as refused:
            await services.transcripts.for_caller(shop, CALLER, limit=5, cursor=bad)
        assert refused.value.field == "cursor"


async def test_the_callers_region_is_kept_with_the_conversation(backend: tuple[Services, Work]) -> None:
    services, _ = backend
    shop = await project(services)
    await services.lifecycle.start(shop, "uk", {"caller": UK_CALLER, "channel": "phone"})
    await services.transcripts.append(
        shop,
        "us",
        {"caller": CALLER, "channel": "phone", "messages": [{"role": "user", "content": "Hi", "turn_id": 0}]},
    )
    await services.lifecycle.start(shop, "mail", {"caller": "email:ada@example.com", "channel": "chat"})
    now = services.clock.now_ms()
    regions = {}
    for conversation_id in ("uk", "us", "mail"):
        header, _ = await services.store.read_conversation(ConversationKey("shop", conversation_id), now)
        assert header is not None and header.status is TranscriptStatus.OPEN
        regions[conversation_id] = header.region
    assert regions == {"uk": "GB", "us": "US", "mail": ""}
    # Never the number: the region is all the store has of it.
    subject = services.transcripts.caller(shop, UK_CALLER).subject
    listed = await services.store.caller_conversations(CallerRef("shop", subject), now)
    assert [h.region for h in listed] == ["GB"]
