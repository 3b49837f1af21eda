"""Conversation memory through a real server (SPEC sections 10 and 14), on SQLite, Redis and Redis Cluster:
start, append, status, history, summary, context, resume, the admin's listing and deletion, the ends the
service makes, late ends, erasure."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from tests.conftest import OPERATOR_TOKEN, Api
from tests.http.test_api import CALLER, assert_problem, memory_path

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
REPEAT_CALLER = {
    "state_keys": ["caller_name", "booking_day", "verified"],
    "identifier_blacklist": ["+440000000000"],
    "retention": "P30D",
    "default_region": "GB",
    "analytics_enabled": True,
}

#: SPEC section 14's platform example transcript, exactly as a voice platform sends it (times in ms).
PLATFORM_EXAMPLE: list[dict[str, Any]] = [
    {
        "role": "assistant",
        "content": "How can I help you today?",
        "turn_id": 1,
        "timestamp": 1678901230000,
        "metadata": {"source": "greeting"},
    },
    {
        "role": "user",
        "content": "Can you tell me a joke?",
        "turn_id": 2,
        "timestamp": 1678901234000,
        "metadata": {"source": "asr"},
    },
    {
        "message_id": "m-7",
        "role": "assistant",
        "content": "Why did the scarecrow ",
        "turn_id": 2,
        "timestamp": 1678901236000,
        "tokens": 6,
        "metadata": {
            "source": "llm",
            "interrupted": True,
            "interrupt_timestamp": 1678905225000,
            "original": "Why did the scarecrow win an award? Because he was outstanding in his field!",
            "agent": "booking",
        },
    },
    {
        "role": "user",
        "content": "You know what? Tell me a story instead.",
        "turn_id": 3,
        "timestamp": 1678905226000,
        "metadata": {"source": "asr"},
    },
    {
        "role": "assistant",
        "content": "Once upon a time in a land far away, ...",
        "turn_id": 3,
        "timestamp": 1678905228000,
        "metadata": {"source": "llm"},
    },
    {
        "role": "assistant",
        "content": "Are you still there?",
        "turn_id": 4,
        "timestamp": 1678905290000,
        "metadata": {"source": "command"},
    },
]
SPOKEN = [
    {"role": "assistant", "content": "How can I help you today?"},
    {"role": "user", "content": "Can you tell me a joke?"},
    {"role": "assistant", "content": "Why did the scarecrow "},
    {"role": "user", "content": "You know what? Tell me a story instead."},
    {"role": "assistant", "content": "Once upon a time in a land far away, ..."},
    {"role": "assistant", "content": "Are you still there?"},
]
STATUS_KEYS = {
    "conversation_id",
    "status",
    "channel",
    "agent",
    "started_at",
    "last_activity_at",
    "turn_id",
    "messages",
    "tokens",
    "bytes",
    "summary",
    "ended_by",
    "end_reason",
    "end_processed",
    "expires_at",
}


def conv(conversation_id: str, what: str = "") -> str:
    return f"{BASE}/conversations/{conversation_id}" + (f"/{what}" if what else "")


def message(turn: int, content: str, role: str = "user", **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, "turn_id": turn, **extra}


async def configure(api: Api, project: str = PROJECT, **conversation: Any) -> dict[str, str]:
    """The project with conversation memory on (``conversation`` overrides), and a token of each role."""
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": {"enabled": True, **conversation}}}
    reply = await api.call("PUT", f"/v1/projects/{project}", token=OPERATOR_TOKEN, json=document)
    assert reply.status in (200, 201), reply.body
    return {role: await api.mint(project, role) for role in ("agent", "analytics", "admin")}


async def mint_agent(api: Api, name: str | None, project: str = PROJECT) -> str:
    body: dict[str, Any] = {"role": "agent"} | ({"agent": name} if name else {})
    reply = await api.call("POST", f"/v1/projects/{project}/tokens", token=OPERATOR_TOKEN, json=body)
    assert reply.status == 201 and reply.body["agent"] == name, reply.body
    token: str = reply.body["token"]
    return token


async def append(
    api: Api, token: str, conversation_id: str, messages: list[dict[str, Any]], **body: Any
) -> Any:
    reply = await api.call(
        "POST", conv(conversation_id, "messages"), token=token, json={"messages": messages, **body}
    )
    assert reply.status == 200, reply.body
    return reply.body


async def history(api: Api, token: str, conversation_id: str, query: str = "") -> Any:
    reply = await api.call("GET", conv(conversation_id, "history") + query, token=token)
    assert reply.status == 200, reply.body
    return reply.body


async def audit_actions(api: Api, token: str) -> list[tuple[str, dict[str, Any]]]:
    reply = await api.call("GET", f"{BASE}/audit", token=token)
    return [(r["action"], r["details"]) for r in reply.body["records"]]


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await configure(api)


# The platform example -----------------------------------------------------------------------------------


async def test_the_platform_example_round_trips_exactly(api: Api, shop: dict[str, str]) -> None:
    sent = copy.deepcopy(PLATFORM_EXAMPLE)
    appended = await append(api, shop["agent"], "call-1", sent, caller=CALLER, channel="voice")
    assert appended == {
        "conversation_id": "call-1",
        "stored": True,
        "status": "active",
        "turn_id": 4,
        "added": 6,
        "messages": 6,
        "bytes": appended["bytes"],
        "tokens": appended["tokens"],
    }
    assert appended["bytes"] > 0 and appended["tokens"] >= 6
    read = await history(api, shop["agent"], "call-1")
    assert read["contents"] == PLATFORM_EXAMPLE
    assert read["conversation_id"] == "call-1" and read["status"] == "active" and read["turn_id"] == 4
    assert read["times"] == "epoch_ms" and read["next_after_turn"] is None
    assert read["started_at"].endswith(":00:00Z")  # hour-rounded
    chat = await history(api, shop["agent"], "call-1", "?format=openai")
    assert chat == {"messages": SPOKEN}


async def test_after_turn_and_pages_of_whole_turns(api: Api, shop: dict[str, str]) -> None:
    await append(
        api, shop["agent"], "call-1", copy.deepcopy(PLATFORM_EXAMPLE), caller=CALLER, channel="voice"
    )
    later = await history(api, shop["agent"], "call-1", "?after_turn=2")
    assert later["contents"] == PLATFORM_EXAMPLE[3:]
    pages, after = [], None
    while True:
        page = await history(
            api, shop["agent"], "call-1", "?limit=2" + (f"&after_turn={after}" if after is not None else "")
        )
        pages.append([m["turn_id"] for m in page["contents"]])
        after = page["next_after_turn"]
        if after is None:
            break
    assert pages == [[1], [2, 2], [3, 3], [4]]  # a page ends on a whole turn


async def test_tool_messages_are_kept_but_not_in_the_openai_layout(api: Api, shop: dict[str, str]) -> None:
    messages = [
        message(0, "What's on Friday?"),
        message(0, '{"slots": ["10:00"]}', "tool", metadata={"source": "tool"}),
        message(0, "We have 10:00 free.", "assistant"),
    ]
    await append(api, shop["agent"], "call-1", messages, caller=CALLER, channel="voice")
    platform = await history(api, shop["agent"], "call-1")
    assert [m["role"] for m in platform["contents"]] == ["user", "tool", "assistant"]
    assert [m["metadata"]["source"] for m in platform["contents"]] == ["message", "tool", "llm"]  # defaults
    chat = await history(api, shop["agent"], "call-1", "?format=openai")
    assert chat["messages"] == [
        {"role": "user", "content": "What's on Friday?"},
        {"role": "assistant", "content": "We have 10:00 free."},
    ]


async def test_once_ended_times_are_offsets_from_the_start(api: Api, shop: dict[str, str]) -> None:
    started = await api.call(
        "POST", conv("call-1", "start"), token=shop["agent"], json={"caller": CALLER, "channel": "voice"}
    )
    assert started.status == 200 and started.body["stored"] is True, started.body
    start = api.clock.now_ms()
    interrupted = {
        "source": "llm",
        "interrupted": True,
        "interrupt_timestamp": start + 2500,
        "original": "Hi!",
    }
    await append(
        api,
        shop["agent"],
        "call-1",
        [
            message(1, "Hello", timestamp=start + 1000),
            message(1, "H", "assistant", timestamp=start + 2000, metadata=interrupted),
        ],
    )
    ended = await api.call(
        "POST", conv("call-1", "end"), token=shop["agent"], json={"caller": CALLER, "end_reason": "completed"}
    )
    assert ended.status == 200 and ended.body["late"] is False, ended.body
    read = await history(api, shop["agent"], "call-1")
    assert read["status"] == "ended" and read["times"] == "offset_ms"
    assert [m["timestamp"] for m in read["contents"]] == [1000, 2000]
    assert read["contents"][1]["metadata"]["interrupt_timestamp"] == 2500
    status = (await api.call("GET", conv("call-1"), token=shop["agent"])).body
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert status["end_processed"] is True and status["last_activity_at"].endswith(":00:00Z")
    refused = await api.call(
        "POST", conv("call-1", "messages"), token=shop["agent"], json={"messages": [message(2, "x")]}
    )
    assert_problem(refused, 409, mentions="ended")


# Append rules -------------------------------------------------------------------------------------------


async def test_a_source_that_does_not_fit_its_role_is_422_naming_it(api: Api, shop: dict[str, str]) -> None:
    for role, source in (("user", "llm"), ("assistant", "asr"), ("tool", "command"), ("user", "greeting")):
        reply = await api.call(
            "POST",
            conv("call-1", "messages"),
            token=shop["agent"],
            json={
                "caller": CALLER,
                "channel": "voice",
                "messages": [message(1, "hi", role, metadata={"source": source})],
            },
        )
        assert_problem(reply, 422, mentions=f"'{source}' does not fit role '{role}'")
        assert reply.body["errors"][0]["field"] == "messages[0]", reply.body
    assert_problem(await api.call("GET", conv("call-1"), token=shop["agent"]), 404)


async def test_message_ids_make_appends_idempotent(api: Api, shop: dict[str, str]) -> None:
    first = [message(1, "Hello", message_id="m-1"), message(1, "Hi there", "assistant", message_id="m-2")]
    done = await append(api, shop["agent"], "call-1", first, caller=CALLER, channel="voice")
    again = await append(api, shop["agent"], "call-1", copy.deepcopy(first), caller=CALLER, channel="voice")
    assert again["added"] == 0 and again["messages"] == 2 and again["bytes"] == done["bytes"]
    other = await api.call(
        "POST",
        conv("call-1", "messages"),
        token=shop["agent"],
        json={"messages": [message(1, "Bye", message_id="m-2")]},
    )
    assert_problem(other, 409, mentions="m-2")
    assert [m["content"] for m in (await history(api, shop["agent"], "call-1"))["contents"]] == [
        "Hello",
        "Hi there",
    ]


async def test_a_refused_batch_changes_nothing(api: Api, shop: dict[str, str]) -> None:
    await append(
        api,
        shop["agent"],
        "call-1",
        [message(3, "turn three", message_id="m-1")],
        caller=CALLER,
        channel="voice",
    )
    before = await history(api, shop["agent"], "call-1")
    status_before = (await api.call("GET", conv("call-1"), token=shop["agent"])).body
    refusals = [
        (422, [message(3, "fine"), message(2, "back in time")]),  # order within the batch
        (422, [message(4, "fine"), message(1, "older than the conversation's")]),
        (409, [message(4, "fine"), message(4, "clash", message_id="m-1")]),
        (413, [message(4, "fine"), message(4, "x" * 20_000)]),
    ]
    for status, batch in refusals:
        reply = await api.call(
            "POST",
            conv("call-1", "messages"),
            token=shop["agent"],
            json={"messages": batch, "state": {"caller_name": "Ada"}},
        )
        assert_problem(reply, status)
    assert await history(api, shop["agent"], "call-1") == before
    assert (await api.call("GET", conv("call-1"), token=shop["agent"])).body == status_before
    too_large = await api.call(
        "POST", conv("call-1", "messages"), token=shop["agent"], json={"messages": [message(4, "x" * 20_000)]}
    )
    assert too_large.body["errors"][0]["field"] == "messages[0]" and "16384" in too_large.body["detail"]


async def test_appends_need_a_start_or_a_caller_and_channel(api: Api, shop: dict[str, str]) -> None:
    reply = await api.call(
        "POST", conv("call-1", "messages"), token=shop["agent"], json={"messages": [message(1, "hi")]}
    )
    assert_problem(reply, 404, mentions="has not started")
    await append(api, shop["agent"], "call-1", [message(1, "hi")], caller=CALLER, channel="voice")
    other = await api.call(
        "POST",
        conv("call-1", "messages"),
        token=shop["agent"],
        json={"caller": "+447700900123", "channel": "voice", "messages": [message(2, "me too")]},
    )
    assert_problem(other, 409, mentions="another caller")


async def test_404_never_existed_410_expired(api: Api) -> None:
    tokens = await configure(api, transcript_retention=2)
    assert_problem(await api.call("GET", conv("never"), token=tokens["agent"]), 404)
    await append(api, tokens["agent"], "call-1", [message(1, "hi")], caller=CALLER, channel="voice")
    assert (await api.call("GET", conv("call-1"), token=tokens["agent"])).status == 200
    api.clock.advance(2)
    for path in (conv("call-1"), conv("call-1", "history"), conv("call-1", "context")):
        assert_problem(await api.call("GET", path, token=tokens["agent"]), 410, mentions="expired")
    late = await api.call(
        "POST", conv("call-1", "messages"), token=tokens["agent"], json={"messages": [message(2, "x")]}
    )
    assert_problem(late, 410)
    summary = await api.call(
        "PUT", conv("call-1", "summary"), token=tokens["agent"], json={"text": "s", "through_turn": 1}
    )
    assert_problem(summary, 410)
    assert_problem(await api.call("GET", conv("never"), token=tokens["agent"]), 404)


async def test_a_full_project_is_507_and_not_logged_as_a_service_error(
    api: Api, captured_logs: pytest.LogCaptureFixture
) -> None:
    tokens = await configure(api, max_transcript_bytes=1024)
    await append(api, tokens["agent"], "call-1", [message(1, "x" * 1100)], caller=CALLER, channel="voice")
    full = await api.call(
        "POST", conv("call-1", "messages"), token=tokens["agent"], json={"messages": [message(2, "more")]}
    )
    assert_problem(full, 507, mentions="max_transcript_bytes")
    assert not [r for r in captured_logs.records if r.levelno >= logging.ERROR], captured_logs.text
    ended = await api.call("POST", conv("call-1", "end"), token=tokens["agent"], json={"caller": CALLER})
    assert ended.status == 200  # ends are never refused for it


# ETags --------------------------------------------------------------------------------------------------


async def test_history_etags_make_polling_cheap(api: Api, shop: dict[str, str]) -> None:
    await append(api, shop["agent"], "call-1", [message(1, "hi")], caller=CALLER, channel="voice")
    first = await api.call("GET", conv("call-1", "history"), token=shop["agent"])
    etag = first.headers["ETag"]
    assert etag.startswith('W/"') and first.headers["Cache-Control"] == "no-store"
    for held in (etag, etag.removeprefix("W/"), f'"other", {etag}', "*"):
        unchanged = await api.call(
            "GET", conv("call-1", "history"), token=shop["agent"], headers={"If-None-Match": held}
        )
        assert unchanged.status == 304 and unchanged.body == "" and unchanged.headers["ETag"] == etag
    chat = await api.call(
        "GET", conv("call-1", "history?format=openai"), token=shop["agent"], headers={"If-None-Match": etag}
    )
    assert chat.status == 200 and chat.headers["ETag"] != etag  # another layout, another tag
    await append(api, shop["agent"], "call-1", [message(2, "again")])
    changed = await api.call(
        "GET", conv("call-1", "history"), token=shop["agent"], headers={"If-None-Match": etag}
    )
    assert changed.status == 200 and changed.headers["ETag"] != etag and len(changed.body["contents"]) == 2
    malformed = await api.call(
        "GET", conv("call-1", "history"), token=shop["agent"], headers={"If-None-Match": "nope"}
    )
    assert_problem(malformed, 400, mentions="If-None-Match")
    # Going idle changes what the platform layout says, so it changes the tag too.
    api.clock.advance(121)
    idle = await api.call(
        "GET",
        conv("call-1", "history"),
        token=shop["agent"],
        headers={"If-None-Match": changed.headers["ETag"]},
    )
    assert idle.status == 200 and idle.body["status"] == "idle"


# Summary and context ------------------------------------------------------------------------------------


async def test_context_fits_the_budget_dropping_older_turns_first(api: Api, shop: dict[str, str]) -> None:
    await api.call("PATCH", memory_path(PROJECT), token=shop["admin"], json={"caller_name": "Ada"})
    turns = [
        m
        for turn in range(1, 6)
        for m in (
            message(turn, f"question {turn}", tokens=100),
            message(turn, f"answer {turn}", "assistant", tokens=100),
        )
    ]
    await append(api, shop["agent"], "call-1", turns, caller=CALLER, channel="voice")
    reply = await api.call("GET", conv("call-1", "context?max_tokens=1000"), token=shop["agent"])
    assert reply.status == 200 and reply.headers["Cache-Control"] == "no-store", reply.body
    context = reply.body
    profile, summary, recent = (context["sections"][k] for k in ("profile", "summary", "recent_turns"))
    assert profile["provenance"] == "caller_memory" and profile["fields"] == {"caller_name": "Ada"}
    assert profile["omitted"] == [] and 0 < profile["tokens"] <= 250
    assert summary is None
    assert recent["provenance"] == "transcript" and recent["token_source"] == "client"
    assert (recent["from_turn"], recent["to_turn"], recent["dropped_turns"]) == (2, 5, 1)
    assert recent["tokens"] == 800 and recent["messages"][0] == {"role": "user", "content": "question 2"}
    assert context["tokens"] == profile["tokens"] + 800 <= context["max_tokens"] == 1000
    assert context["unsummarized_tokens"] == 1000 and context["needs_summary"] is True
    # needs_summary: once the unsummarised turns pass 75% of the budget (1000 > 0.75 * 1333, not 0.75 * 1334).
    for budget, needed in ((1333, True), (1334, False)):
        body = (
            await api.call("GET", conv("call-1", f"context?max_tokens={budget}"), token=shop["agent"])
        ).body
        assert body["needs_summary"] is needed, (budget, body)

    stored = await api.call(
        "PUT",
        conv("call-1", "summary"),
        token=shop["agent"],
        json={"text": "Ada asked three things.", "through_turn": 3, "tokens": 50},
    )
    assert stored.status == 200 and set(stored.body) == STATUS_KEYS, stored.body
    assert stored.body["summary"] == {"through_turn": 3, "tokens": 50}
    context = (await api.call("GET", conv("call-1", "context?max_tokens=1000"), token=shop["agent"])).body
    assert context["sections"]["summary"] == {
        "provenance": "agent_summary",
        "tokens": 50,
        "token_source": "client",
        "through_turn": 3,
        "text": "Ada asked three things.",
    }
    recent = context["sections"]["recent_turns"]
    assert (recent["from_turn"], recent["to_turn"], recent["dropped_turns"]) == (4, 5, 0)
    assert context["unsummarized_tokens"] == 400 and context["needs_summary"] is False
    beyond = await api.call(
        "PUT", conv("call-1", "summary"), token=shop["agent"], json={"text": "x", "through_turn": 6}
    )
    assert_problem(beyond, 422, mentions="through_turn")


async def test_token_counts_say_when_they_are_estimates(api: Api, shop: dict[str, str]) -> None:
    await append(
        api,
        shop["agent"],
        "call-1",
        [message(1, "a" * 40), message(1, "b" * 8, "assistant")],
        caller=CALLER,
        channel="voice",
    )
    await api.call(
        "PUT", conv("call-1", "summary"), token=shop["agent"], json={"text": "c" * 20, "through_turn": 0}
    )
    context = (await api.call("GET", conv("call-1", "context"), token=shop["agent"])).body
    assert context["max_tokens"] == 2000  # the default budget
    assert context["sections"]["recent_turns"]["token_source"] == "estimate"
    assert context["sections"]["recent_turns"]["tokens"] == 12  # about four characters a token
    assert context["sections"]["summary"]["token_source"] == "estimate"
    assert context["sections"]["summary"]["tokens"] == 5


# Redaction, blacklist, disabled -------------------------------------------------------------------------


async def test_spoken_phone_numbers_are_redacted_in_content_and_original(
    api: Api, shop: dict[str, str]
) -> None:
    interrupted = {
        "source": "llm",
        "interrupted": True,
        "original": "I'll text 020 7946 0018 and +1 415 555 0123 now",
    }
    messages = [
        message(1, "Call my office on 020 7946 0018 please"),
        message(1, "I'll text 020 7946", "assistant", metadata=interrupted),
    ]
    await append(api, shop["agent"], "call-1", messages, caller=CALLER, channel="voice")
    contents = (await history(api, shop["agent"], "call-1"))["contents"]
    assert contents[0]["content"] == "Call my office on [phone] please"
    assert contents[1]["metadata"]["original"] == "I'll text [phone] and [phone] now"


async def test_without_redaction_the_callers_own_number_is_still_removed(api: Api) -> None:
    tokens = await configure(api, redact_phone_numbers=False)
    first = [message(1, "My number is (415) 555-0100, my office 020 7946 0018")]
    await append(api, tokens["agent"], "call-1", first, caller=CALLER, channel="voice")
    # A later append names neither caller nor channel: the service finds out whose number to remove.
    await append(api, tokens["agent"], "call-1", [message(2, "Again: +1 415-555-0100.")])
    contents = (await history(api, tokens["agent"], "call-1"))["contents"]
    assert contents[0]["content"] == "My number is [phone], my office 020 7946 0018"
    assert contents[1]["content"] == "Again: [phone]."


async def test_a_blacklisted_caller_is_accepted_and_dropped(api: Api, shop: dict[str, str]) -> None:
    body = {"caller": "+440000000000", "channel": "voice", "messages": [message(1, "test call")]}
    reply = await api.call("POST", conv("call-1", "messages"), token=shop["agent"], json=body)
    assert reply.status == 200 and reply.body["stored"] is False and reply.body["reason"] == "blacklisted"
    start = await api.call(
        "POST",
        conv("call-2", "start"),
        token=shop["agent"],
        json={"caller": "+440000000000", "channel": "voice"},
    )
    assert start.body == {
        "conversation": None,
        "stored": False,
        "reason": "blacklisted",
        "resume": None,
        "superseded": [],
    }
    for conversation_id in ("call-1", "call-2"):
        assert_problem(await api.call("GET", conv(conversation_id), token=shop["agent"]), 404)


async def test_a_project_with_conversation_memory_off_accepts_and_drops(api: Api) -> None:
    tokens = await api.project_with_tokens(PROJECT, REPEAT_CALLER)
    reply = await api.call(
        "POST",
        conv("call-1", "messages"),
        token=tokens["agent"],
        json={"caller": CALLER, "channel": "voice", "messages": [message(1, "hi")]},
    )
    assert reply.status == 200 and reply.body["stored"] is False and reply.body["reason"] == "disabled"
    start = await api.call(
        "POST", conv("call-1", "start"), token=tokens["agent"], json={"caller": CALLER, "channel": "voice"}
    )
    assert start.status == 200 and start.body["stored"] is False and start.body["reason"] == "disabled"
    assert_problem(await api.call("GET", conv("call-1"), token=tokens["agent"]), 404, mentions="enabled")
    stored = await api.call("GET", BASE, token=tokens["admin"])
    assert stored.body["memory"]["conversation"]["enabled"] is False


# Scope, admin, audit ------------------------------------------------------------------------------------


async def test_agent_scope_shows_an_agent_the_users_messages_and_its_own(api: Api) -> None:
    tokens = await configure(api, transcript_scope="agent")
    billing = await mint_agent(api, "billing")
    booking = await mint_agent(api, "booking")
    nobody = await mint_agent(api, None)
    messages = [
        message(1, "I have a question"),
        message(1, "Billing here", "assistant", metadata={"agent": "billing"}),
        message(2, "Booking here", "assistant", metadata={"agent": "booking"}),
        message(2, "Untagged", "assistant"),
    ]
    await append(api, tokens["agent"], "call-1", messages, caller=CALLER, channel="voice")

    async def seen(token: str) -> list[str]:
        return [m["content"] for m in (await history(api, token, "call-1"))["contents"]]

    assert await seen(billing) == ["I have a question", "Billing here"]
    assert await seen(booking) == ["I have a question", "Booking here"]
    assert await seen(nobody) == ["I have a question"]
    assert await seen(tokens["admin"]) == [m["content"] for m in messages]
    context = (await api.call("GET", conv("call-1", "context"), token=billing)).body
    assert [m["content"] for m in context["sections"]["recent_turns"]["messages"]] == [
        "I have a question",
        "Billing here",
    ]
    listed = await api.call("GET", f"{BASE}/tokens", token=tokens["admin"])
    assert sorted(t["agent"] or "" for t in listed.body["tokens"]) == ["", "", "", "", "billing", "booking"]


async def test_agent_names_belong_to_agent_tokens_only(api: Api, shop: dict[str, str]) -> None:
    for body in (
        {"role": "admin", "agent": "billing"},
        {"role": "analytics", "agent": "billing"},
        {"role": "agent", "agent": "bad name!"},
    ):
        reply = await api.call("POST", f"{BASE}/tokens", token=shop["admin"], json=body)
        assert_problem(reply, 422)
        assert reply.body["errors"][0]["field"] == "agent", reply.body


async def test_admins_list_and_delete_transcripts_and_their_reads_are_audited(
    api: Api, shop: dict[str, str]
) -> None:
    for conversation_id in ("call-1", "call-2"):
        await append(api, shop["agent"], conversation_id, [message(1, "hi")], caller=CALLER, channel="voice")
        api.clock.advance(1)
    listing = f"{BASE}/callers/{CALLER}/conversations"
    assert_problem(await api.call("GET", listing, token=shop["agent"]), 403)
    listed = await api.call("GET", listing, token=shop["admin"])
    assert listed.status == 200 and listed.headers["Cache-Control"] == "no-store"
    assert [c["conversation_id"] for c in listed.body["conversations"]] == ["call-2", "call-1"]
    assert all(set(c) == STATUS_KEYS for c in listed.body["conversations"])
    assert (
        await api.call("GET", f"{BASE}/callers/+447700900123/conversations", token=shop["admin"])
    ).body == {"conversations": []}

    await history(api, shop["agent"], "call-1")
    await api.call("GET", conv("call-1", "context"), token=shop["agent"])
    assert [a for a, _ in await audit_actions(api, shop["admin"]) if a.startswith("transcript.")] == []
    await history(api, shop["admin"], "call-1")
    assert (await api.call("GET", conv("call-1", "context"), token=shop["admin"])).status == 200

    assert_problem(await api.call("DELETE", conv("call-1"), token=shop["agent"]), 403)
    deleted = await api.call("DELETE", conv("call-1"), token=shop["admin"])
    assert deleted.status == 204 and deleted.body == ""
    assert_problem(await api.call("GET", conv("call-1"), token=shop["agent"]), 404)
    assert_problem(await api.call("DELETE", conv("call-1"), token=shop["admin"]), 404)
    actions = [(a, d) for a, d in await audit_actions(api, shop["admin"]) if a.startswith("transcript.")]
    assert actions == [
        ("transcript.deleted", {"conversation_id": "call-1", "messages": 1}),
        ("transcript.read", {"conversation_id": "call-1", "read": "context"}),
        ("transcript.read", {"conversation_id": "call-1", "read": "history"}),
    ]
    listed = await api.call("GET", listing, token=shop["admin"])
    assert [c["conversation_id"] for c in listed.body["conversations"]] == ["call-2"]


# Lifecycle: ends, late ends, resume, erasure ------------------------------------------------------------


async def test_an_inactivity_end_then_a_late_explicit_end(api: Api) -> None:
    tokens = await configure(api, idle_after=1, end_after_inactivity=2)
    await append(
        api,
        tokens["agent"],
        "call-1",
        [message(1, "hi")],
        caller=CALLER,
        channel="voice",
        state={"caller_name": "Ada"},
    )
    assert (await api.call("GET", conv("call-1"), token=tokens["agent"])).body["status"] == "active"
    api.clock.advance(1)
    assert (await api.call("GET", conv("call-1"), token=tokens["agent"])).body["status"] == "idle"
    api.clock.advance(1)
    swept = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert swept.status == 200 and swept.body["inactivity_ends"] == 1, swept.body
    status = (await api.call("GET", conv("call-1"), token=tokens["agent"])).body
    assert (status["status"], status["ended_by"], status["end_processed"]) == ("ended", "inactivity", True)
    memory = await api.call("GET", memory_path(PROJECT), token=tokens["agent"])
    assert memory.body["fields"] == {"caller_name": "Ada"}  # the checkpoint was persisted

    body = {"caller": CALLER, "state": {"booking_day": "Friday"}, "outcome": {"qa": "resolved"}}
    late = await api.call("POST", conv("call-1", "end"), token=tokens["agent"], json=body)
    assert late.status == 200 and late.body["late"] is True and late.body["persisted"] == ["booking_day"], (
        late.body
    )
    assert late.headers["Idempotent-Replayed"] == "false"
    replay = await api.call("POST", conv("call-1", "end"), token=tokens["agent"], json=body)
    assert (
        replay.status == 200 and replay.body == late.body and replay.headers["Idempotent-Replayed"] == "true"
    )
    other = await api.call(
        "POST",
        conv("call-1", "end"),
        token=tokens["agent"],
        json={**body, "state": {"booking_day": "Monday"}},
    )
    assert_problem(other, 409)
    memory = await api.call("GET", memory_path(PROJECT), token=tokens["agent"])
    assert memory.body["fields"] == {"caller_name": "Ada", "booking_day": "Friday"}
    listed = await api.call("GET", f"{BASE}/analytics/conversations", token=tokens["analytics"])
    rows = listed.body["conversations"]
    assert [(r["conversation_id"], r["ended_by"], r["end_reason"], r["qa"]) for r in rows] == [
        ("call-1", "inactivity", None, None)
    ]  # counted once, as the service's end recorded it
    again = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert again.body["inactivity_ends"] == 0


async def test_a_callback_supersedes_the_open_call_and_is_offered_resume(
    api: Api, shop: dict[str, str]
) -> None:
    first = [message(1, "I want to book Friday"), message(1, "Which time?", "assistant")]
    await append(
        api, shop["agent"], "call-1", first, caller=CALLER, channel="voice", state={"booking_day": "Friday"}
    )
    await api.call(
        "PUT",
        conv("call-1", "summary"),
        token=shop["agent"],
        json={"text": "Booking Friday.", "through_turn": 1},
    )
    api.clock.advance(60)
    other_channel = await api.call(
        "POST", conv("chat-1", "start"), token=shop["agent"], json={"caller": CALLER, "channel": "chat"}
    )
    assert other_channel.body["resume"] is None and other_channel.body["superseded"] == []
    started = await api.call(
        "POST",
        conv("call-2", "start"),
        token=shop["agent"],
        json={"caller": CALLER, "channel": "voice", "agent": "booking"},
    )
    assert started.status == 200, started.body
    body = started.body
    assert body["stored"] is True and body["superseded"] == ["call-1"]
    assert set(body["conversation"]) == STATUS_KEYS and body["conversation"]["agent"] == "booking"
    resume = body["resume"]
    assert resume["conversation_id"] == "call-1" and resume["channel"] == "voice"
    assert resume["ended_by"] == "superseded" and resume["state"] == {"booking_day": "Friday"}
    assert resume["summary"]["text"] == "Booking Friday."
    assert [m["content"] for m in resume["last_turns"]] == ["I want to book Friday", "Which time?"]
    status = (await api.call("GET", conv("call-1"), token=shop["agent"])).body
    assert status["ended_by"] == "superseded" and status["end_processed"] is True
    # Starting again answers the same conversation.
    again = await api.call(
        "POST", conv("call-2", "start"), token=shop["agent"], json={"caller": CALLER, "channel": "voice"}
    )
    assert again.status == 200 and again.body["conversation"]["conversation_id"] == "call-2"


async def test_a_dropped_call_is_offered_as_resume(api: Api, shop: dict[str, str]) -> None:
    await append(api, shop["agent"], "call-1", [message(1, "Hello?")], caller=CALLER, channel="voice")
    ended = await api.call(
        "POST", conv("call-1", "end"), token=shop["agent"], json={"caller": CALLER, "end_reason": "dropped"}
    )
    assert ended.status == 200
    rows = (await api.call("GET", f"{BASE}/analytics/conversations", token=shop["analytics"])).body[
        "conversations"
    ]
    assert [(r["ended_by"], r["end_reason"]) for r in rows] == [("explicit", "dropped")]
    csv = await api.call(
        "GET", f"{BASE}/analytics/conversations", token=shop["analytics"], headers={"Accept": "text/csv"}
    )
    header, row = csv.body.splitlines()[:2]
    assert header.endswith(",ended_by,end_reason") and row.endswith(",explicit,dropped")
    started = await api.call(
        "POST", conv("call-2", "start"), token=shop["agent"], json={"caller": CALLER, "channel": "voice"}
    )
    assert started.body["resume"]["conversation_id"] == "call-1"
    assert started.body["resume"]["end_reason"] == "dropped" and started.body["superseded"] == []
    api.clock.advance(601)  # beyond resume_window
    later = await api.call(
        "POST", conv("call-3", "start"), token=shop["agent"], json={"caller": CALLER, "channel": "voice"}
    )
    assert later.body["resume"] is None and later.body["superseded"] == ["call-2"]


async def test_erasure_removes_transcripts_and_counts_them(api: Api, shop: dict[str, str]) -> None:
    for conversation_id in ("call-1", "call-2"):
        await append(
            api, shop["agent"], conversation_id, [message(1, "hi")], caller=CALLER, channel=conversation_id
        )
    await append(api, shop["agent"], "call-3", [message(1, "hi")], caller="+447700900123", channel="voice")
    erased = await api.call("DELETE", f"{BASE}/callers/{CALLER}", token=shop["admin"])
    assert erased.status == 200 and erased.body["removed"]["transcripts"] == 2, erased.body
    for conversation_id in ("call-1", "call-2"):
        assert_problem(await api.call("GET", conv(conversation_id), token=shop["agent"]), 410)
    assert (await api.call("GET", conv("call-3"), token=shop["agent"])).status == 200
    # An append made before the erasure and delivered after it (an SDK outbox) is dropped.
    sent_at = api.clock.now_ms() - 1000
    retried = await api.call(
        "POST",
        conv("call-4", "messages"),
        token=shop["agent"],
        json={"caller": CALLER, "channel": "voice", "messages": [message(1, "late")], "sent_at": sent_at},
    )
    assert retried.status == 200 and retried.body["stored"] is False and retried.body["reason"] == "erased"
