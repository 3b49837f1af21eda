"""The lifecycle of a conversation's transcript through the use cases, over real stores (SQLite, Redis and
Redis Cluster) and a fake clock: the inactivity end (exactly once, with the last checkpoint), an explicit end
racing it, the late end, supersession and resume on a callback, a crashed end taken over, erasure reaching
what is in flight. tests/http/test_transcripts.py covers the HTTP shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from caller_memory.service.app import build_services
from caller_memory.service.config import Settings
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.conversations.ending import Outcome
from caller_memory.service.domain.errors import Conflict, Gone
from caller_memory.service.domain.projects import Project
from caller_memory.service.domain.store import ListingPage
from caller_memory.service.domain.store.transcripts import ConversationKey, EndClaim
from caller_memory.service.http.app_keys import Services

from tests.conftest import CLUSTER, PSEUDONYM_KEY, empty_store_url

CALLER = "+14155550100"
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["booking_day", "cheese", "caller_name"],
            "analytics_enabled": True,
            "retention": "P30D",
        },
        "conversation": {"enabled": True, "end_after_inactivity": "PT30M", "idle_after": "PT2M"},
    }
}


@pytest.fixture(params=["sqlite", "redis", CLUSTER])
async def services(
    request: pytest.FixtureRequest, tmp_path: Any, clock: FakeClock
) -> AsyncIterator[Services]:
    url = empty_store_url(request, request.param, tmp_path)
    built = build_services(
        Settings(pseudonym_key=PSEUDONYM_KEY, store_url=url, store_timeout=5.0), clock=clock
    )
    await built.store.open()
    try:
        yield built
    finally:
        await built.store.close()


async def project(services: Services, config: dict[str, Any] | None = None) -> Project:
    applied, _ = await services.projects.apply("shop", config or CONFIG, actor="test")
    return applied


def user(text: str, turn: int, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, "turn_id": turn, "metadata": {"source": "asr"}, **extra}


def assistant(text: str, turn: int, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "turn_id": turn, "metadata": {"source": "llm"}, **extra}


async def dropped_call(services: Services, shop: Project, conversation_id: str = "call-1") -> None:
    """A call that got as far as choosing gouda for Friday, then the line dropped (nobody ended it)."""
    await services.transcripts.append(
        shop,
        conversation_id,
        {
            "caller": CALLER,
            "channel": "phone",
            "messages": [assistant("Hello, cheese shop!", 0), user("Gouda for Friday please", 1)],
            "state": {"cheese": "gouda", "booking_day": "Friday", "not_a_state_key": 1},
        },
    )


async def listed(services: Services) -> list[Any]:
    page = ListingPage(start="0", stop="9999999999999:~", limit=100)
    return await services.store.list_conversations("shop", page, services.clock.now_ms())


async def memory(services: Services, shop: Project) -> dict[str, Any]:
    import orjson

    view = await services.memory.read(shop, CALLER)
    return {name: orjson.loads(value) for name, value in view.fields.items()}


async def test_an_abandoned_conversation_is_ended_by_inactivity_exactly_once(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 0  # not due yet
    status = await services.transcripts.status(shop, "call-1")
    assert status["status"] == "active"
    clock.advance(3 * 60)
    assert (await services.transcripts.status(shop, "call-1"))["status"] == "idle"
    assert await memory(services, shop) == {}  # a checkpoint is not memory until the end
    clock.advance(30 * 60)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 0
    status = await services.transcripts.status(shop, "call-1")
    assert (status["status"], status["ended_by"], status["end_processed"]) == ("ended", "inactivity", True)
    assert await memory(services, shop) == {"cheese": "gouda", "booking_day": "Friday"}
    entries = await listed(services)
    assert [(e.conversation_id, e.ended_by) for e in entries] == [("call-1", "inactivity")]


async def test_activity_postpones_the_inactivity_end(services: Services, clock: FakeClock) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    clock.advance(25 * 60)
    await services.transcripts.append(shop, "call-1", {"messages": [user("still there", 2)]})
    clock.advance(10 * 60)  # 35 min after the start, 10 after the last activity
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 0
    clock.advance(21 * 60)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1


async def test_an_explicit_end_racing_the_inactivity_end_is_counted_once_and_loses_nothing(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    clock.advance(31 * 60)
    ended, _ = await asyncio.gather(
        services.conversations.end(
            shop, "call-1", CALLER, {"caller_name": "Ada"}, Outcome(qa="resolved"), channel="phone"
        ),
        services.lifecycle.run_inactivity_ends(services.projects),
    )
    await services.lifecycle.run_inactivity_ends(services.projects)
    assert len(await listed(services)) == 1
    fields = await memory(services, shop)
    assert fields["caller_name"] == "Ada"  # what the client sent is never lost
    status = await services.transcripts.status(shop, "call-1")
    assert status["status"] == "ended" and status["end_processed"]
    assert ended.late == (status["ended_by"] == "inactivity")


async def test_a_late_end_applies_its_state_and_leaves_analytics(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    clock.advance(31 * 60)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1
    clock.advance(60)
    late = await services.conversations.end(
        shop, "call-1", CALLER, {"booking_day": "Saturday", "x": 1}, Outcome(qa="resolved"), channel="phone"
    )
    assert (late.late, late.persisted, late.ignored, late.replayed) == (True, ["booking_day"], ["x"], False)
    assert (await memory(services, shop))["booking_day"] == "Saturday"
    again = await services.conversations.end(
        shop, "call-1", CALLER, {"booking_day": "Saturday", "x": 1}, Outcome(qa="resolved"), channel="phone"
    )
    assert (again.late, again.replayed) == (True, True)
    with pytest.raises(Conflict):
        await services.conversations.end(
            shop, "call-1", CALLER, {"booking_day": "Monday"}, Outcome(), channel="phone"
        )
    assert [e.ended_by for e in await listed(services)] == ["inactivity"]


async def test_an_older_checkpoint_never_overwrites_a_later_write(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)  # checkpoint: Friday
    clock.advance(60)
    await services.memory.patch(shop, CALLER, {"booking_day": "Sunday"})
    clock.advance(31 * 60)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1
    fields = await memory(services, shop)
    assert fields["booking_day"] == "Sunday"
    assert fields["cheese"] == "gouda"


async def test_a_callback_supersedes_the_open_call_and_is_offered_to_resume_it(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    await services.transcripts.put_summary(
        shop, "call-1", {"text": "Wants gouda for Friday; not confirmed yet.", "through_turn": 1}
    )
    clock.advance(90)
    started = await services.lifecycle.start(shop, "call-2", {"caller": CALLER, "channel": "phone"})
    assert started["superseded"] == ["call-1"]
    resume = started["resume"]
    assert resume is not None
    assert resume["conversation_id"] == "call-1"
    assert resume["ended_by"] == "superseded"
    assert resume["state"] == {"cheese": "gouda", "booking_day": "Friday", "not_a_state_key": 1}
    assert resume["summary"] is not None and resume["summary"]["text"].startswith("Wants gouda")
    assert [m["content"] for m in resume["last_turns"]] == ["Hello, cheese shop!", "Gouda for Friday please"]
    assert resume["last_turns"][0]["timestamp"] >= 0  # times since that call's start, not epoch times
    # The superseded call's checkpoint is memory before the callback's first read.
    assert await memory(services, shop) == {"cheese": "gouda", "booking_day": "Friday"}
    assert [(e.conversation_id, e.ended_by) for e in await listed(services)] == [("call-1", "superseded")]
    # A repeated start of the same conversation supersedes nothing more.
    again = await services.lifecycle.start(shop, "call-2", {"caller": CALLER, "channel": "phone"})
    assert again["superseded"] == []


async def test_resume_stays_on_its_channel_and_inside_its_window(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    other = await services.lifecycle.start(shop, "chat-1", {"caller": CALLER, "channel": "webchat"})
    assert (other["superseded"], other["resume"]) == ([], None)
    clock.advance(31 * 60)
    await services.lifecycle.run_inactivity_ends(services.projects)
    late = await services.lifecycle.start(shop, "call-2", {"caller": CALLER, "channel": "phone"})
    assert late["resume"] is None  # ended by inactivity 31 min after its last activity: past resume_window


async def test_a_completed_call_is_not_offered_but_a_dropped_one_is(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop, "call-1")
    await services.conversations.end(
        shop, "call-1", CALLER, {}, Outcome(), channel="phone", end_reason="completed"
    )
    started = await services.lifecycle.start(shop, "call-2", {"caller": CALLER, "channel": "phone"})
    assert started["resume"] is None
    await services.conversations.end(
        shop, "call-2", CALLER, {}, Outcome(), channel="phone", end_reason="dropped"
    )
    third = await services.lifecycle.start(shop, "call-3", {"caller": CALLER, "channel": "phone"})
    assert third["resume"] is not None and third["resume"]["conversation_id"] == "call-2"


async def test_an_end_that_crashed_half_way_is_taken_over(services: Services, clock: FakeClock) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    clock.advance(31 * 60)
    now = clock.now_ms()
    # A replica claimed the end and died before doing it.
    await services.store.claim_end(
        EndClaim(ConversationKey("shop", "call-1"), "inactivity", "", now - 30 * 60_000, now + 60_000), now
    )
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 0  # its lease still holds
    clock.advance(61)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1
    assert await memory(services, shop) == {"cheese": "gouda", "booking_day": "Friday"}
    assert len(await listed(services)) == 1


async def test_erasure_removes_transcripts_and_what_was_in_flight(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    made = clock.now_ms()
    await dropped_call(services, shop)
    clock.advance(5)
    receipt = await services.memory.erase(shop, CALLER, actor="test")
    assert receipt.transcripts_removed == 1
    with pytest.raises(Gone):
        await services.transcripts.history(shop, "call-1")
    clock.advance(5)
    # An outbox delivering, after the erasure, messages made before it.
    for conversation_id in ("call-1", "call-9"):
        dropped = await services.transcripts.append(
            shop,
            conversation_id,
            {"caller": CALLER, "channel": "phone", "messages": [user("hello?", 2)], "sent_at": made},
        )
        assert (dropped["stored"], dropped.get("reason")) == (False, "erased")
    assert (await services.transcripts.for_caller(shop, CALLER))["conversations"] == []
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 0
    # A new call after the erasure is remembered.
    fresh = await services.transcripts.append(
        shop, "call-10", {"caller": CALLER, "channel": "phone", "messages": [user("hi", 0)]}
    )
    assert fresh["stored"]


async def test_a_blacklisted_caller_has_no_transcript(services: Services) -> None:
    config = {**CONFIG, "memory": {**CONFIG["memory"], "repeat_caller": {
        **CONFIG["memory"]["repeat_caller"], "identifier_blacklist": [CALLER]}}}  # fmt: skip
    shop = await project(services, config)
    dropped = await services.transcripts.append(
        shop, "call-1", {"caller": CALLER, "channel": "phone", "messages": [user("hi", 0)]}
    )
    assert (dropped["stored"], dropped.get("reason")) == (False, "blacklisted")
    started = await services.lifecycle.start(shop, "call-1", {"caller": CALLER, "channel": "phone"})
    assert (started["stored"], started["conversation"]) == (False, None)


async def test_an_end_naming_another_caller_leaves_the_transcript_alone(services: Services) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    # Refused before anything is written (issue 27): it neither claims the transcript nor takes the id's end.
    with pytest.raises(Conflict, match="another caller"):
        await services.conversations.end(shop, "call-1", "+447700900123", {}, Outcome(), channel="phone")
    assert (await services.transcripts.status(shop, "call-1"))["status"] == "active"
    appended = await services.transcripts.append(shop, "call-1", {"messages": [user("still here", 2)]})
    assert appended["stored"] and appended["added"] == 1


async def test_the_retry_of_an_explicit_end_that_crashed_is_still_applied(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop)
    now = clock.now_ms()
    # An explicit end claimed the transcript and its replica died before anything else.
    await services.store.claim_end(
        EndClaim(ConversationKey("shop", "call-1"), "explicit", "completed", None, now + 60_000), now
    )
    clock.advance(61)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1  # taken over: checkpoint
    assert await memory(services, shop) == {"cheese": "gouda", "booking_day": "Friday"}
    status = await services.transcripts.status(shop, "call-1")
    assert (status["ended_by"], status["end_reason"], status["end_processed"]) == (
        "explicit",
        "completed",
        True,
    )
    # The client's retry, from its outbox.
    retry = await services.conversations.end(
        shop,
        "call-1",
        CALLER,
        {"booking_day": "Saturday"},
        Outcome(qa="resolved"),
        channel="phone",
        end_reason="completed",
    )
    assert (retry.late, retry.persisted) == (False, ["booking_day"])
    assert (await memory(services, shop))["booking_day"] == "Saturday"
    assert len(await listed(services)) == 1


async def test_an_explicit_end_after_the_transcript_expired_is_late_not_a_conflict(
    services: Services, clock: FakeClock
) -> None:
    config = {**CONFIG, "memory": {**CONFIG["memory"], "conversation": {
        "enabled": True, "transcript_retention": "PT40M", "end_after_inactivity": "PT30M"}}}  # fmt: skip
    shop = await project(services, config)
    await dropped_call(services, shop)
    clock.advance(31 * 60)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1
    clock.advance(10 * 60)  # the transcript expired; the service's end record is remembered
    late = await services.conversations.end(
        shop, "call-1", CALLER, {"booking_day": "Monday"}, Outcome(), channel="phone"
    )
    assert late.late and late.persisted == ["booking_day"]
    assert (await memory(services, shop))["booking_day"] == "Monday"


async def test_a_conversation_started_by_its_first_append_supersedes_like_a_start(
    services: Services, clock: FakeClock
) -> None:
    shop = await project(services)
    await dropped_call(services, shop, "call-1")
    clock.advance(60)
    # The callback's start failed (the SDK then starts the conversation with its first batch).
    await services.transcripts.append(
        shop, "call-2", {"caller": CALLER, "channel": "phone", "messages": [user("hello again", 0)]}
    )
    status = await services.transcripts.status(shop, "call-1")
    assert (status["status"], status["ended_by"]) == ("ended", "superseded")
    assert await memory(services, shop) == {"cheese": "gouda", "booking_day": "Friday"}
    # A later append to the callback supersedes nothing more (and an append elsewhere nothing at all).
    await services.transcripts.append(shop, "call-2", {"caller": CALLER, "channel": "phone", "messages": []})
    assert [e.conversation_id for e in await listed(services)] == ["call-1"]
