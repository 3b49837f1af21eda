"""A merge racing an erasure of its profile, on Redis (issue 27, item 4): a link is made in four steps in two
slots (service/storage/redis/links.py), and an erasure of the profile may land between them. Whatever the
clocks say (here the erasure is stamped at the link's own millisecond), nothing of the identifier's memory
reaches the erased profile after the erasure's receipt, and an identifier the erasure did not reach keeps its
memory. On a standalone server and on a Redis Cluster."""

from __future__ import annotations

from typing import Any

from caller_memory.service.domain.store.links import LinkResult
from caller_memory.service.storage.redis.store import RedisStore

from tests.storage.test_contract import TTL, field, new_subject, now_ms, values
from tests.storage.test_links import MAX, link, link_to, ref, remember


async def erase_as_the_domain_does(store: RedisStore, profile: str, at: int) -> None:
    """Erase the profile, then the identifiers its links named that still name it (MemoryService.erase)."""
    erased = await store.erase_caller(ref(profile), at, at + TTL)
    for alias in erased.aliases:
        if await store.resolve_profile(ref(alias), at) == profile:
            await store.erase_caller(ref(alias), at, at + TTL)


async def link_with_an_erasure_after(store: RedisStore, step: str) -> tuple[str, str, int, LinkResult]:
    """A profile and an identifier with memory each, linked with a merge while the profile's erasure (at the
    link's own millisecond) lands right after the link's ``step`` (the script of that name)."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t)}, t)
    await remember(store, a, {"mine": field("a", t)}, t)
    script = store._transport.script

    async def erasure_after(name: str, keys: Any, args: Any) -> Any:
        reply = await script(name, keys, args)
        if name == step:
            await erase_as_the_domain_does(store, p, t)
        return reply

    store._transport.script = erasure_after  # type: ignore[method-assign,assignment]
    try:
        return p, a, t, await link(store, p, a, t, merge=True)
    finally:
        store._transport.script = script  # type: ignore[method-assign]


async def test_an_erasure_between_the_alias_and_the_merge_leaves_the_profile_empty(
    redis_store: RedisStore,
) -> None:
    # After link_alias the identifier reads as the profile: the erasure takes both.
    p, a, t, result = await link_with_an_erasure_after(redis_store, "link_alias")
    assert result.fields_merged == 0
    # After the receipt, neither holds anything: the merge did not bring the identifier's memory back.
    assert await redis_store.read_fields(ref(p), t + 1) == {}
    assert await redis_store.read_fields(ref(a), t + 1) == {}
    assert await redis_store.list_links(ref(p), t + 1) == []


async def test_an_erasure_between_the_reservation_and_the_alias_leaves_the_identifier_its_memory(
    redis_store: RedisStore,
) -> None:
    # After link_reserve the identifier is no alias yet: the erasure leaves it alone.
    p, a, t, _ = await link_with_an_erasure_after(redis_store, "link_reserve")
    assert await redis_store.read_fields(ref(p), t + 1) == {}
    assert await redis_store.resolve_profile(ref(a), t + 1) == a
    assert values(await redis_store.read_fields(ref(a), t + 1)) == {"mine": "a"}  # not lost


async def test_a_link_refused_for_an_erasure_stamped_after_it_keeps_the_identifiers_memory(
    redis_store: RedisStore,
) -> None:
    """An erasure stamped after the link's time (a replica's clock ahead) makes the link refuse its merge;
    the identifier, which that erasure never reached, keeps its own memory."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(redis_store, a, {"mine": field("a", t)}, t)
    await redis_store.erase_caller(ref(p), t + 1, t + TTL)
    await redis_store.link_identifier(ref(p), link_to(a, t), merge=True, max_links=MAX, now_ms=t)
    assert await redis_store.read_fields(ref(p), t + 2) == {}
    assert await redis_store.resolve_profile(ref(a), t + 2) == a
    assert values(await redis_store.read_fields(ref(a), t + 2)) == {"mine": "a"}
