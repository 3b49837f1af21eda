"""The linked-identifier part of the Store contract (service/domain/store/links.py), identical on every backend.

P is a profile, A (B, C) identifiers linked to it. Times follow test_contract.py: real-clock based, explicit
``now_ms``; a link that must be seen expired expires well before Redis's own clock gets there, and is looked
at with a ``now_ms`` past its expiry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import (
    CallerRef,
    EndAnalytics,
    EndResult,
    EndStatus,
    EndWrite,
    FirstInteraction,
    Store,
)
from caller_memory.service.domain.store.links import Link, LinkResult, LinkStatus, ProfileMoved
from caller_memory.service.storage.sqlite.store import SCHEMA_VERSION, SQLiteStore

from tests.storage.test_contract import PROJECT, TTL, analytics_at, ending, field, new_subject, now_ms, values

MAX = 5


def ref(subject: str) -> CallerRef:
    return CallerRef(PROJECT, subject)


def link_to(subject: str, at: int, ttl: int = TTL, kind: str = "phone") -> Link:
    """A new link as the domain makes it: a random id, linked at ``at``, expiring ``ttl`` later."""
    return Link(uuid.uuid4().hex[:20], kind, subject, at, at + ttl)


async def link(
    store: Store, profile: str, subject: str, at: int, *, merge: bool = False, max_links: int = MAX, **kw: Any
) -> LinkResult:
    return await store.link_identifier(
        ref(profile), link_to(subject, at, **kw), merge=merge, max_links=max_links, now_ms=at
    )


async def remember(store: Store, subject: str, fields: dict[str, StoredField], at: int) -> None:
    assert (await store.patch_fields(ref(subject), fields, [], at)).applied


async def first_interaction(store: Store, subject: str, conversation_id: str, at: int) -> EndAnalytics:
    """End a conversation with analytics at ``at`` (its first interaction record, if it has none, is made
    then, created at ``at``)."""
    ended = await store.end_conversation(
        ending(subject, conversation_id, at, conversation_id, analytics=analytics_at(at)), at
    )
    assert ended.status is EndStatus.APPLIED and ended.analytics is not None
    return ended.analytics


async def first_of(store: Store, subject: str, at: int) -> FirstInteraction | None:
    """The caller's first interaction as the next end sees it (that end makes one if there is none)."""
    return (await first_interaction(store, subject, f"probe-{uuid.uuid4().hex}", at)).first


async def is_plain_caller(store: Store, subject: str, at: int) -> bool:
    """``subject`` is no alias: it resolves to itself, and a write to it is accepted."""
    if await store.resolve_profile(ref(subject), at) != subject:
        return False
    return (await store.patch_fields(ref(subject), {}, ["nothing"], at)).applied


# Linking ---------------------------------------------------------------------------------------------


async def test_a_new_link_is_followed_by_reads_and_listed(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(store, p, {"cheese": field("gouda", t)}, t)
    new = link_to(a, t, kind="email")
    result = await store.link_identifier(ref(p), new, merge=False, max_links=MAX, now_ms=t)
    assert result == LinkResult(LinkStatus.LINKED, new, fields_merged=0, first_interaction_merged=False)
    assert await store.list_links(ref(p), t) == [new]
    assert await store.list_links(ref(a), t) == []  # an alias has no links of its own
    assert await store.resolve_profile(ref(a), t) == p
    assert await store.resolve_profile(ref(p), t) == p
    assert await store.read_fields(ref(a), t + 1) == await store.read_fields(ref(p), t + 1)
    assert values(await store.read_fields(ref(a), t + 1)) == {"cheese": "gouda"}
    # A later write to the profile is seen through the alias at once.
    await remember(store, p, {"day": field("Friday", t + 2)}, t + 2)
    assert values(await store.read_fields(ref(a), t + 2)) == {"cheese": "gouda", "day": "Friday"}
    # Projects do not share links.
    assert await store.resolve_profile(CallerRef("bakery", a), t) == a
    assert await store.read_fields(CallerRef("bakery", a), t) == {}


async def test_merge_without_memory_is_a_plain_link(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    # A dead field is no memory: nothing to merge, and it is not brought back.
    await remember(store, a, {"old": field(1, t, 1_000)}, t)
    result = await link(store, p, a, t + 1_000)
    assert result.status is LinkStatus.LINKED and result.fields_merged == 0
    assert not result.first_interaction_merged
    assert await store.read_fields(ref(p), t + 1_000) == {}
    merged = await link(store, p, new_subject(), t + 1_000, merge=True)  # merge given, nothing to merge
    assert merged.status is LinkStatus.LINKED and merged.fields_merged == 0


async def test_the_same_link_again_is_renewed_and_keeps_its_id(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    first = await link(store, p, a, t, ttl=TTL // 2)
    assert first.link is not None
    await remember(store, p, {"cheese": field("brie", t)}, t)
    again = Link("another-id", "phone", a, t + 5, t + TTL)
    renewed = await store.link_identifier(ref(p), again, merge=False, max_links=MAX, now_ms=t + 5)
    expected = dataclasses.replace(first.link, expires_at=t + TTL)  # its id and linked_at, the new expiry
    assert renewed == LinkResult(LinkStatus.RENEWED, expected)
    assert await store.list_links(ref(p), t + 5) == [expected]
    # Followed past the first expiry, until the new one.
    later = t + TTL // 2 + 1
    assert await store.list_links(ref(p), later) == [expected]
    assert await store.resolve_profile(ref(a), later) == p
    assert values(await store.read_fields(ref(a), later)) == {"cheese": "brie"}
    with pytest.raises(ProfileMoved):
        await store.patch_fields(ref(a), {"x": field(1, later)}, [], later)


async def test_renewing_a_link_is_never_too_many(store: Store) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    assert (await link(store, p, a, t, max_links=2)).status is LinkStatus.LINKED
    assert (await link(store, p, b, t + 1, max_links=2)).status is LinkStatus.LINKED
    assert (await link(store, p, a, t + 2, max_links=2)).status is LinkStatus.RENEWED
    # A limit lowered since: the existing links stay, and renew.
    assert (await link(store, p, b, t + 3, max_links=1)).status is LinkStatus.RENEWED


async def test_too_many_links_changes_nothing(store: Store) -> None:
    p, a, b, c, t = new_subject(), new_subject(), new_subject(), new_subject(), now_ms()
    await link(store, p, a, t, max_links=2)
    await link(store, p, b, t + 1, max_links=2)
    listed = await store.list_links(ref(p), t + 1)
    await remember(store, c, {"mine": field("c", t)}, t)
    refused = await link(store, p, c, t + 2, merge=True, max_links=2)
    assert refused == LinkResult(LinkStatus.TOO_MANY)
    assert await store.list_links(ref(p), t + 2) == listed
    assert values(await store.read_fields(ref(c), t + 2)) == {"mine": "c"}  # not merged
    assert await store.read_fields(ref(p), t + 2) == {}
    assert await is_plain_caller(store, c, t + 2)


async def test_an_expired_link_is_neither_followed_nor_listed_nor_counted(store: Store) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    await remember(store, p, {"cheese": field("edam", t, 2 * TTL)}, t)
    old = await link(store, p, a, t, ttl=TTL // 2)
    assert old.link is not None
    gone = t + TTL // 2  # the link's expiry instant: dead from then on
    assert await store.list_links(ref(p), gone - 1) == [old.link]
    assert await store.list_links(ref(p), gone) == []
    assert await store.resolve_profile(ref(a), gone) == a
    assert await store.read_fields(ref(a), gone) == {}
    assert await store.unlink_identifier(ref(p), gone, subject=a) is None
    # Writes to it are its own again.
    await remember(store, a, {"own": field(1, gone)}, gone)
    assert values(await store.read_fields(ref(a), gone)) == {"own": 1}
    assert values(await store.read_fields(ref(p), gone)) == {"cheese": "edam"}
    # An expired link does not count towards the limit, and linking the identifier again is a new link.
    assert (await link(store, p, b, gone, max_links=1)).status is LinkStatus.LINKED
    await store.unlink_identifier(ref(p), gone, subject=b)
    again = await link(store, p, a, gone + 1, merge=True, max_links=1)
    assert again.status is LinkStatus.LINKED and again.link is not None
    assert again.link.link_id != old.link.link_id and again.fields_merged == 1
    assert await store.list_links(ref(p), gone + 1) == [again.link]


async def test_the_profile_itself_is_same(store: Store) -> None:
    p, t = new_subject(), now_ms()
    assert await link(store, p, p, t) == LinkResult(LinkStatus.SAME)
    assert await store.list_links(ref(p), t) == []
    assert await is_plain_caller(store, p, t)


async def test_an_identifier_linked_elsewhere_is_refused(store: Store) -> None:
    p, q, a, t = new_subject(), new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t)}, t)
    mine = await link(store, p, a, t)
    assert await link(store, q, a, t + 1, merge=True) == LinkResult(LinkStatus.ELSEWHERE)
    assert await store.list_links(ref(q), t + 1) == []
    assert await store.list_links(ref(p), t + 1) == [mine.link]
    assert await store.resolve_profile(ref(a), t + 1) == p
    assert values(await store.read_fields(ref(a), t + 1)) == {"of": "p"}
    assert await store.read_fields(ref(q), t + 1) == {}


async def test_an_identifier_with_links_of_its_own_is_refused(store: Store) -> None:
    p, q, a, t = new_subject(), new_subject(), new_subject(), now_ms()
    await link(store, q, a, t)
    assert await link(store, p, q, t + 1, merge=True) == LinkResult(LinkStatus.HAS_LINKS)
    assert await store.list_links(ref(p), t + 1) == []
    assert await is_plain_caller(store, q, t + 1)
    assert await store.resolve_profile(ref(a), t + 1) == q


async def test_an_identifier_whose_links_expired_can_be_linked(store: Store) -> None:
    p, q, a, t = new_subject(), new_subject(), new_subject(), now_ms()
    await link(store, q, a, t, ttl=TTL // 2)
    later = t + TTL // 2
    assert (await link(store, p, q, later)).status is LinkStatus.LINKED
    assert await store.resolve_profile(ref(q), later) == p


async def test_an_identifier_with_memory_needs_merge_and_nothing_changes_without(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t)}, t)
    await remember(store, a, {"of": field("a", t + 1)}, t + 1)
    assert await link(store, p, a, t + 2) == LinkResult(LinkStatus.NEEDS_MERGE)
    assert await store.list_links(ref(p), t + 2) == []
    assert values(await store.read_fields(ref(a), t + 2)) == {"of": "a"}
    assert values(await store.read_fields(ref(p), t + 2)) == {"of": "p"}
    assert await is_plain_caller(store, a, t + 2)
    # The refusal took nothing of the limit: the one link allowed can still be made.
    assert (await link(store, p, new_subject(), t + 3, max_links=1)).status is LinkStatus.LINKED


async def test_a_first_interaction_alone_is_memory(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await first_interaction(store, a, "a-first", t)
    assert await store.read_fields(ref(a), t) == {}
    assert (await link(store, p, a, t + 1)).status is LinkStatus.NEEDS_MERGE
    merged = await link(store, p, a, t + 2, merge=True)
    assert merged.status is LinkStatus.LINKED and merged.first_interaction_merged
    assert merged.fields_merged == 0
    first = await first_of(store, p, t + 3)
    assert first is not None and first.conversation_id == "a-first"


async def test_linking_to_an_alias_is_profile_moved(store: Store) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    await link(store, p, a, t)
    with pytest.raises(ProfileMoved) as moved:
        await link(store, a, b, t + 1)
    assert moved.value.profile == p
    assert await store.list_links(ref(a), t + 1) == []
    assert await store.list_links(ref(p), t + 1) != [] and await is_plain_caller(store, b, t + 1)


# Writes through an alias -----------------------------------------------------------------------------


async def test_a_patch_through_an_alias_is_profile_moved_and_writes_nothing(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t)}, t)
    await link(store, p, a, t)
    for deletes in ([], ["of"]):
        with pytest.raises(ProfileMoved) as moved:
            await store.patch_fields(ref(a), {"new": field(1, t + 1)}, deletes, t + 1)
        assert moved.value.profile == p
    assert values(await store.read_fields(ref(p), t + 1)) == {"of": "p"}
    await store.unlink_identifier(ref(p), t + 2, subject=a)
    assert await store.read_fields(ref(a), t + 2) == {}  # nothing was written to the alias either


async def test_an_end_through_an_alias_is_profile_moved_and_leaves_no_claim(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await link(store, p, a, t)
    write = ending(a, "conv-1", t + 1, "fp", {"new": field(1, t + 1)}, analytics=analytics_at(t + 1))
    with pytest.raises(ProfileMoved) as moved:
        await store.end_conversation(write, t + 1)
    assert moved.value.profile == p
    assert await store.read_fields(ref(p), t + 1) == {}
    # What the domain does next: the same end, for the profile. The id is free (no claim was left).
    ended = await store.end_conversation(dataclasses.replace(write, caller=ref(p)), t + 1)
    assert ended.status is EndStatus.APPLIED and ended.analytics is not None
    assert ended.analytics.first is None  # the profile's first interaction, made by this end
    assert values(await store.read_fields(ref(a), t + 1)) == {"new": 1}
    await store.unlink_identifier(ref(p), t + 2, subject=a)
    assert await store.read_fields(ref(a), t + 2) == {}
    assert (await store.erase_caller(ref(a), t + 3, t + TTL)).first_interaction is False  # none on the alias


async def test_an_end_applied_before_aliasing_replays(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    write = ending(a, "conv-1", t, "fp", {"n": field(1, t)}, analytics=analytics_at(t))
    applied = await store.end_conversation(write, t)
    assert applied.status is EndStatus.APPLIED
    assert (await link(store, p, a, t + 1, merge=True)).fields_merged == 1
    await remember(store, p, {"n": field(2, t + 2)}, t + 2)
    # The client's retry of that end reaches the alias: the same answer as before, and nothing re-applied.
    replay = await store.end_conversation(dataclasses.replace(write, made_at=t + 3), t + 3)
    assert replay == EndResult(EndStatus.REPLAYED, applied.analytics)
    assert values(await store.read_fields(ref(p), t + 3)) == {"n": 2}
    # Another body under that id is no replay: moved (the domain then finds it a conflict on the profile).
    other = dataclasses.replace(write, fingerprint="other")
    with pytest.raises(ProfileMoved):
        await store.end_conversation(other, t + 4)
    conflict = await store.end_conversation(dataclasses.replace(other, caller=ref(p)), t + 4)
    assert conflict == EndResult(EndStatus.CONFLICT)


async def test_a_retry_of_a_redirected_end_replays_through_the_domains_retry(store: Store) -> None:
    """An end first applied to the profile (after a ProfileMoved) and retried by the client to the alias
    again: moved, not a conflict, so that the domain's retry on the profile finds the replay."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await link(store, p, a, t)
    write = ending(a, "conv-1", t + 1, "fp", {"n": field(1, t + 1)})
    assert (await end_as_the_domain_does(store, write, t + 1)).status is EndStatus.APPLIED
    assert (await end_as_the_domain_does(store, write, t + 2)).status is EndStatus.REPLAYED


async def end_as_the_domain_does(store: Store, write: EndWrite, at: int) -> EndResult:
    """End the conversation for its caller, or for the profile it is linked to (what the domain does on
    ProfileMoved; the profile is never itself an alias, so one retry is enough)."""
    try:
        return await store.end_conversation(write, at)
    except ProfileMoved as moved:
        return await store.end_conversation(dataclasses.replace(write, caller=ref(moved.profile)), at)


# The merge rule --------------------------------------------------------------------------------------


async def test_merge_the_later_write_wins_per_field_both_ways(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    profile_fields = {
        "newer_on_p": field("p", t + 10),
        "newer_on_a": field("p", t),
        "tie": field("p", t + 5),
        "only_p": field("p", t),
    }
    alias_fields = {
        "newer_on_p": field("a", t),
        "newer_on_a": field("a", t + 10),
        "tie": field("a", t + 5),
        "only_a": field("a", t + 1, 2 * TTL),
    }
    await remember(store, p, profile_fields, t + 10)
    await remember(store, a, alias_fields, t + 10)
    await remember(store, a, {"dead_on_a": field("a", t, 20)}, t + 10)
    result = await link(store, p, a, t + 20, merge=True)
    assert result.status is LinkStatus.LINKED
    assert result.fields_merged == 2  # newer_on_a and only_a moved
    # Each field as it was stored (value, expiry and write time), from the side whose write was later.
    assert await store.read_fields(ref(p), t + 20) == {
        "newer_on_p": profile_fields["newer_on_p"],
        "newer_on_a": alias_fields["newer_on_a"],
        "tie": profile_fields["tie"],
        "only_p": profile_fields["only_p"],
        "only_a": alias_fields["only_a"],
    }
    # The alias's own memory is gone: once unlinked it is an empty caller, and the profile keeps the merge.
    unlinked = await store.unlink_identifier(ref(p), t + 21, subject=a)
    assert unlinked == result.link
    assert await store.read_fields(ref(a), t + 21) == {}
    assert set(await store.read_fields(ref(p), t + 21)) == {
        "newer_on_p",
        "newer_on_a",
        "tie",
        "only_p",
        "only_a",
    }
    erased = await store.erase_caller(ref(a), t + 22, t + TTL)
    assert (erased.fields, erased.first_interaction, erased.links) == (0, False, 0)


async def test_merge_the_earlier_first_interaction_wins(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await first_interaction(store, a, "a-first", t)
    await first_interaction(store, p, "p-first", t + 1_000)
    merged = await link(store, p, a, t + 2_000, merge=True)
    assert merged.status is LinkStatus.LINKED and merged.first_interaction_merged
    first = await first_of(store, p, t + 3_000)
    assert first is not None and first.conversation_id == "a-first"
    await store.unlink_identifier(ref(p), t + 4_000, link_id=merged.link.link_id if merged.link else "")
    assert (await store.erase_caller(ref(a), t + 5_000, t + TTL)).first_interaction is False


async def test_merge_the_profiles_earlier_first_interaction_stays(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await first_interaction(store, p, "p-first", t)
    await first_interaction(store, a, "a-first", t + 1_000)
    merged = await link(store, p, a, t + 2_000, merge=True)
    assert merged.status is LinkStatus.LINKED and not merged.first_interaction_merged
    first = await first_of(store, p, t + 3_000)
    assert first is not None and first.conversation_id == "p-first"
    await store.unlink_identifier(ref(p), t + 4_000, subject=a)
    assert (await store.erase_caller(ref(a), t + 5_000, t + TTL)).first_interaction is False


async def test_merge_is_idempotent(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t), "x": field("p", t)}, t)
    await remember(store, a, {"of": field("a", t + 1), "y": field("a", t)}, t + 1)
    await first_interaction(store, a, "a-first", t + 1)
    first = await link(store, p, a, t + 2, merge=True)
    assert (first.status, first.fields_merged, first.first_interaction_merged) == (LinkStatus.LINKED, 2, True)
    merged = await store.read_fields(ref(p), t + 2)
    again = await store.link_identifier(ref(p), link_to(a, t + 3), merge=True, max_links=MAX, now_ms=t + 3)
    assert again.status is LinkStatus.RENEWED and again.link is not None and first.link is not None
    assert again.link.link_id == first.link.link_id and not again.link.merging
    assert await store.read_fields(ref(p), t + 3) == merged
    assert values(merged) == {"of": "a", "x": "p", "y": "a"}
    assert [link.merging for link in await store.list_links(ref(p), t + 3)] == [False]


async def test_ends_racing_a_merge_all_land_once(store: Store) -> None:
    """Both callers end conversations while they are merged; the domain retries on ProfileMoved. Every
    field lands on the profile, each conversation is applied once, the profile keeps one first interaction
    (the earlier), and a read of the alias always sees one side or the other."""
    p, a, t = new_subject(), new_subject(), now_ms()
    await first_interaction(store, a, "a-first", t)
    await first_interaction(store, p, "p-first", t + 1)
    await remember(store, a, {"a_only": field("a", t)}, t)
    await remember(store, p, {"p_only": field("p", t)}, t)
    n = 12
    writes = [
        ending(who, f"{side}-{i}", t + 10 + i, f"fp-{i}", {f"{side}_{i}": field(i, t + 10 + i)},
               analytics=analytics_at(t + 10 + i))
        for i in range(n) for side, who in (("p", p), ("a", a))
    ]  # fmt: skip

    async def read_alias() -> set[str]:
        return set(await store.read_fields(ref(a), t + 20))

    # The link starts amid the ends (half of them are queued before it), and reads run throughout.
    half = len(writes) // 2
    outcome = await asyncio.gather(
        *(end_as_the_domain_does(store, w, t + 20) for w in writes[:half]),
        link(store, p, a, t + 20, merge=True),
        *(end_as_the_domain_does(store, w, t + 20) for w in writes[half:]),
        *(read_alias() for _ in range(n)),
    )
    linked = outcome[half]
    ended, reads = outcome[:half] + outcome[half + 1 : len(writes) + 1], outcome[len(writes) + 1 :]
    assert isinstance(linked, LinkResult) and linked.status is LinkStatus.LINKED
    for result in ended:
        assert isinstance(result, EndResult) and result.status is EndStatus.APPLIED
        # Each side had its first interaction already: every end is a repeat call.
        assert result.analytics is not None and result.analytics.first is not None
        assert result.analytics.first.conversation_id in ("a-first", "p-first")
    for seen in reads:
        assert isinstance(seen, set) and seen & {"a_only", "p_only"}, "a read saw neither side"
    stored = values(await store.read_fields(ref(p), t + 30))
    assert stored == {"a_only": "a", "p_only": "p"} | {
        name: i for w in writes for name, i in values(dict(w.sets)).items()
    }
    assert await store.read_fields(ref(a), t + 30) == await store.read_fields(ref(p), t + 30)
    # Applied once: every retry replays, whichever subject it names.
    for write in writes:
        assert (await end_as_the_domain_does(store, write, t + 40)).status is EndStatus.REPLAYED
    first = await first_of(store, p, t + 50)
    assert first is not None and first.conversation_id == "a-first"
    erased = await store.erase_caller(ref(a), t + 60, t + TTL)  # the alias's own memory went with the merge
    assert (erased.fields, erased.first_interaction, erased.links) == (0, False, 1)


# Unlinking -------------------------------------------------------------------------------------------


async def test_unlink_by_subject_or_id(store: Store) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    await remember(store, a, {"from_a": field("a", t)}, t)
    by_subject = await link(store, p, a, t, merge=True)
    by_id = await link(store, p, b, t + 1)
    assert by_subject.link is not None and by_id.link is not None
    assert await store.unlink_identifier(ref(p), t + 2, subject=a) == by_subject.link
    assert await store.unlink_identifier(ref(p), t + 2, link_id=by_id.link.link_id) == by_id.link
    assert await store.list_links(ref(p), t + 2) == []
    for subject in (a, b):
        assert await store.read_fields(ref(subject), t + 2) == {}  # empty callers of their own again
        assert await is_plain_caller(store, subject, t + 2)
    assert values(await store.read_fields(ref(p), t + 2)) == {"from_a": "a"}  # what the merge moved stays
    # Gone: unlinking again changes nothing.
    assert await store.unlink_identifier(ref(p), t + 3, subject=a) is None
    assert await store.unlink_identifier(ref(p), t + 3, link_id=by_id.link.link_id) is None
    # Each alias can be written and linked afresh.
    await remember(store, a, {"again": field(1, t + 4)}, t + 4)
    assert (await link(store, p, a, t + 5)).status is LinkStatus.NEEDS_MERGE


async def test_unlink_names_only_the_profiles_own_links(store: Store) -> None:
    p, q, a, t = new_subject(), new_subject(), new_subject(), now_ms()
    mine = await link(store, p, a, t)
    assert mine.link is not None
    assert await store.unlink_identifier(ref(q), t + 1, subject=a) is None
    assert await store.unlink_identifier(ref(q), t + 1, link_id=mine.link.link_id) is None
    assert await store.unlink_identifier(ref(p), t + 1, link_id="no-such-link") is None
    assert await store.unlink_identifier(ref(p), t + 1, subject=new_subject()) is None
    assert await store.list_links(ref(p), t + 1) == [mine.link]
    assert await store.resolve_profile(ref(a), t + 1) == p


async def test_links_are_listed_oldest_first(store: Store) -> None:
    p, t = new_subject(), now_ms()
    made = []
    for at, kind in ((t + 20, "phone"), (t, "email"), (t + 10, "account")):
        result = await link(store, p, new_subject(), at, kind=kind)
        made.append(result.link)
    listed = await store.list_links(ref(p), t + 30)
    assert listed == [made[1], made[2], made[0]]
    assert [link.kind for link in listed] == ["email", "account", "phone"]


# Erasure ---------------------------------------------------------------------------------------------


async def test_erasing_a_profile_removes_its_list_of_links(store: Store) -> None:
    p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t)}, t)
    await link(store, p, a, t)
    await link(store, p, b, t + 1)
    erased = await store.erase_caller(ref(p), t + 2, t + TTL)
    assert (erased.fields, erased.links) == (1, 2)
    assert await store.list_links(ref(p), t + 2) == []
    # The aliases' own records are the domain's to erase, each with its subject.
    for subject in (a, b):
        assert (await store.erase_caller(ref(subject), t + 3, t + TTL)).links == 1
        assert await store.resolve_profile(ref(subject), t + 3) == subject
        assert await store.read_fields(ref(subject), t + 3) == {}
    assert (await store.erase_caller(ref(p), t + 4, t + TTL)).links == 0


async def test_erasing_an_alias_removes_its_alias_record(store: Store) -> None:
    p, a, t = new_subject(), new_subject(), now_ms()
    await remember(store, p, {"of": field("p", t)}, t)
    await link(store, p, a, t)
    erased = await store.erase_caller(ref(a), t + 1, t + TTL)
    assert (erased.fields, erased.first_interaction, erased.links) == (0, False, 1)
    assert await store.resolve_profile(ref(a), t + 1) == a
    assert await store.read_fields(ref(a), t + 1) == {}
    # The profile's memory is not the alias's to erase.
    assert values(await store.read_fields(ref(p), t + 1)) == {"of": "p"}
    # A caller who is neither has no links to remove.
    assert (await store.erase_caller(ref(new_subject()), t + 2, t + TTL)).links == 0


# Expiry on SQLite ------------------------------------------------------------------------------------


async def test_sqlite_sweep_removes_expired_links(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "links.db")
    await store.open()
    try:
        p, a, b, t = new_subject(), new_subject(), new_subject(), now_ms()
        await link(store, p, a, t, ttl=1_000)
        await link(store, p, b, t, ttl=5_000)
        counts, more = await store.sweep(t + 1_000, 100)
        assert counts["links"] == 1 and not more
        assert (await store.sweep(t + 1_000, 100))[0]["links"] == 0  # safe to repeat
        assert (await store.erase_caller(ref(p), t + 2_000, t + TTL)).links == 1  # only b's was left
    finally:
        await store.close()


async def test_sqlite_a_file_of_the_previous_release_gains_links(tmp_path: Path) -> None:
    """A file of schema version 3 (no link tables) opens, gains them, keeps its memory, and is marked 4 (so
    that the previous release, which would write to an alias, refuses it)."""
    path, p, a, t = tmp_path / "memory.db", new_subject(), new_subject(), now_ms()
    store = SQLiteStore(path)
    await store.open()
    await remember(store, p, {"of": field("p", t)}, t)
    await store.close()
    conn = sqlite3.connect(path)
    conn.executescript(
        "DROP TABLE aliases; DROP TABLE links; UPDATE meta SET value = '3' WHERE key = 'schema_version';"
    )
    conn.close()
    again = SQLiteStore(path)
    await again.open()
    try:
        assert (await link(again, p, a, t)).status is LinkStatus.LINKED
        assert values(await again.read_fields(ref(a), t)) == {"of": "p"}
    finally:
        await again.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
        (str(SCHEMA_VERSION),)
    ]
    conn.close()
