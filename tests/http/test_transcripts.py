"""Conversation memory through a real server (SPEC sections 10 and 14), on SQLite, Redis and Redis Cluster:
start, append, status, history, summary, context, resume, the admin's listing and deletion, the ends the
service makes, late ends, erasure."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import pytest
from caller_memory.service.domain.conversations.views import ConversationStatus

from tests.conftest import OPERATOR_TOKEN, Api, Reply
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
STATUS_KEYS = set(ConversationStatus.__annotations__)  # what the status view declares, exactly


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


@dataclass
class As:
    """Requests about the project's conversations with one token."""

    api: Api
    token: str

    async def __call__(
        self, method: str, conversation_id: str, what: str = "", body: Any = None, **headers: str
    ) -> Reply:
        path = conv(conversation_id, what) if conversation_id else f"{BASE}/{what}"
        return await self.api.call(method, path, token=self.token, json=body, headers=headers or None)

    async def ok(self, method: str, conversation_id: str, what: str = "", body: Any = None) -> Any:
        reply = await self(method, conversation_id, what, body)
        assert 200 <= reply.status < 300, reply.body
        return reply.body

    async def append(self, conversation_id: str, messages: list[dict[str, Any]], **body: Any) -> Any:
        return await self.ok("POST", conversation_id, "messages", {"messages": messages, **body})

    async def begin(self, conversation_id: str, messages: list[dict[str, Any]], **body: Any) -> Any:
        """An append that starts the conversation (it names the caller and channel)."""
        return await self.append(conversation_id, messages, **{"caller": CALLER, "channel": "voice"} | body)

    async def start(self, conversation_id: str, **body: Any) -> Any:
        return await self.ok("POST", conversation_id, "start", {"caller": CALLER, "channel": "voice"} | body)

    async def history(self, conversation_id: str, query: str = "") -> Any:
        return await self.ok("GET", conversation_id, "history" + query)

    async def status(self, conversation_id: str) -> Any:
        return await self.ok("GET", conversation_id)

    async def audit(self) -> list[tuple[str, dict[str, Any]]]:
        records = (await self.ok("GET", "", "audit"))["records"]
        return [(r["action"], r["details"]) for r in records if r["action"].startswith("transcript.")]


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await configure(api)


@pytest.fixture
def agent(api: Api, shop: dict[str, str]) -> As:
    return As(api, shop["agent"])


@pytest.fixture
def admin(api: Api, shop: dict[str, str]) -> As:
    return As(api, shop["admin"])


# The platform example -----------------------------------------------------------------------------------


async def test_the_platform_example_round_trips_exactly(agent: As) -> None:
    appended = await agent.begin("call-1", copy.deepcopy(PLATFORM_EXAMPLE))
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
    read = await agent.history("call-1")
    assert read["contents"] == PLATFORM_EXAMPLE
    assert read["conversation_id"] == "call-1" and read["status"] == "active" and read["turn_id"] == 4
    assert read["times"] == "epoch_ms" and read["next_after_turn"] is None
    assert read["started_at"].endswith(":00:00Z")  # hour-rounded
    assert await agent.history("call-1", "?format=openai") == {"messages": SPOKEN}


async def test_after_turn_and_pages_of_whole_turns(agent: As) -> None:
    await agent.begin("call-1", copy.deepcopy(PLATFORM_EXAMPLE))
    assert (await agent.history("call-1", "?after_turn=2"))["contents"] == PLATFORM_EXAMPLE[3:]
    pages, after = [], None
    while True:
        page = await agent.history(
            "call-1", "?limit=2" + (f"&after_turn={after}" if after is not None else "")
        )
        pages.append([m["turn_id"] for m in page["contents"]])
        after = page["next_after_turn"]
        if after is None:
            break
    assert pages == [[1], [2, 2], [3, 3], [4]]  # a page ends on a whole turn
    # A turn longer than the page comes whole, rather than lose its end between two pages.
    first = await agent.history("call-1", "?limit=1&after_turn=1")
    assert [m["turn_id"] for m in first["contents"]] == [2, 2] and first["next_after_turn"] == 2
    last = await agent.history("call-1", "?limit=1&after_turn=3")
    assert [m["turn_id"] for m in last["contents"]] == [4] and last["next_after_turn"] is None


async def test_tool_messages_are_kept_but_not_in_the_openai_layout(agent: As) -> None:
    messages = [
        message(0, "What's on Friday?"),
        message(0, '{"slots": ["10:00"]}', "tool", metadata={"source": "tool"}),
        message(0, "We have 10:00 free.", "assistant"),
    ]
    await agent.begin("call-1", messages)
    platform = (await agent.history("call-1"))["contents"]
    assert [m["role"] for m in platform] == ["user", "tool", "assistant"]
    assert [m["metadata"]["source"] for m in platform] == ["message", "tool", "llm"]  # the defaults
    assert (await agent.history("call-1", "?format=openai"))["messages"] == [
        {"role": "user", "content": "What's on Friday?"},
        {"role": "assistant", "content": "We have 10:00 free."},
    ]


async def test_once_ended_times_are_offsets_from_the_start(api: Api, agent: As) -> None:
    assert (await agent.start("call-1"))["stored"] is True
    start = api.clock.now_ms()
    cut = {"source": "llm", "interrupted": True, "interrupt_timestamp": start + 2500, "original": "Hi!"}
    spoken = [
        message(1, "Hello", timestamp=start + 1000),
        message(1, "H", "assistant", timestamp=start + 2000, metadata=cut),
    ]
    await agent.append("call-1", spoken)
    ended = await agent.ok("POST", "call-1", "end", {"caller": CALLER, "end_reason": "completed"})
    assert ended["late"] is False
    read = await agent.history("call-1")
    assert read["status"] == "ended" and read["times"] == "offset_ms"
    assert [m["timestamp"] for m in read["contents"]] == [1000, 2000]
    assert read["contents"][1]["metadata"]["interrupt_timestamp"] == 2500
    status = await agent.status("call-1")
    assert status["ended_by"] == "explicit" and status["end_reason"] == "completed"
    assert status["end_processed"] is True and status["last_activity_at"].endswith(":00:00Z")
    refused = await agent("POST", "call-1", "messages", {"messages": [message(2, "x")]})
    assert_problem(refused, 409, mentions="ended")


# Append rules -------------------------------------------------------------------------------------------


async def test_a_source_that_does_not_fit_its_role_is_422_naming_it(agent: As) -> None:
    for role, source in (("user", "llm"), ("assistant", "asr"), ("tool", "command"), ("user", "greeting")):
        wrong = [message(1, "hi", role, metadata={"source": source})]
        reply = await agent(
            "POST", "call-1", "messages", {"caller": CALLER, "channel": "voice", "messages": wrong}
        )
        assert_problem(reply, 422, mentions=f"'{source}' does not fit role '{role}'")
        assert reply.body["errors"][0]["field"] == "messages[0]", reply.body
    assert_problem(await agent("GET", "call-1"), 404)


async def test_message_ids_make_appends_idempotent(agent: As) -> None:
    first = [message(1, "Hello", message_id="m-1"), message(1, "Hi there", "assistant", message_id="m-2")]
    done = await agent.begin("call-1", first)
    again = await agent.begin("call-1", copy.deepcopy(first))
    assert again["added"] == 0 and again["messages"] == 2 and again["bytes"] == done["bytes"]
    other = await agent("POST", "call-1", "messages", {"messages": [message(1, "Bye", message_id="m-2")]})
    assert_problem(other, 409, mentions="m-2")
    assert [m["content"] for m in (await agent.history("call-1"))["contents"]] == ["Hello", "Hi there"]


async def test_a_refused_batch_changes_nothing(agent: As) -> None:
    await agent.begin("call-1", [message(3, "turn three", message_id="m-1")])
    before, status_before = await agent.history("call-1"), await agent.status("call-1")
    refusals = [
        (422, [message(3, "fine"), message(2, "back in time")]),  # order within the batch
        (422, [message(4, "fine"), message(1, "older than the conversation's")]),
        (409, [message(4, "fine"), message(4, "clash", message_id="m-1")]),
        (413, [message(4, "fine"), message(4, "x" * 20_000)]),
    ]
    for status, batch in refusals:
        reply = await agent(
            "POST", "call-1", "messages", {"messages": batch, "state": {"caller_name": "Ada"}}
        )
        assert_problem(reply, status)
    assert await agent.history("call-1") == before
    assert await agent.status("call-1") == status_before
    too_large = await agent("POST", "call-1", "messages", {"messages": [message(4, "x" * 20_000)]})
    assert too_large.body["errors"][0]["field"] == "messages[0]" and "16,384" in too_large.body["detail"]


async def test_appends_need_a_start_or_a_caller_and_channel(agent: As) -> None:
    reply = await agent("POST", "call-1", "messages", {"messages": [message(1, "hi")]})
    assert_problem(reply, 404, mentions="has not started")
    await agent.begin("call-1", [message(1, "hi")])
    other = {"caller": "+447700900123", "channel": "voice", "messages": [message(2, "me too")]}
    assert_problem(await agent("POST", "call-1", "messages", other), 409, mentions="another caller")


async def test_404_never_existed_410_expired(api: Api) -> None:
    agent = As(api, (await configure(api, transcript_retention=2))["agent"])
    assert_problem(await agent("GET", "never"), 404)
    await agent.begin("call-1", [message(1, "hi")])
    await agent.status("call-1")
    api.clock.advance(2)
    for what in ("", "history", "context"):
        assert_problem(await agent("GET", "call-1", what), 410, mentions="expired")
    assert_problem(await agent("POST", "call-1", "messages", {"messages": [message(2, "x")]}), 410)
    assert_problem(await agent("PUT", "call-1", "summary", {"text": "s", "through_turn": 1}), 410)
    assert_problem(await agent("POST", "call-1", "start", {"caller": CALLER, "channel": "voice"}), 410)
    assert_problem(await agent("GET", "never"), 404)


async def test_a_full_project_is_507_and_not_logged_as_a_service_error(
    api: Api, captured_logs: pytest.LogCaptureFixture
) -> None:
    agent = As(api, (await configure(api, max_transcript_bytes=1024))["agent"])
    await agent.begin("call-1", [message(1, "x" * 1100)])
    full = await agent("POST", "call-1", "messages", {"messages": [message(2, "more")]})
    assert_problem(full, 507, mentions="max_transcript_bytes")
    assert not [r for r in captured_logs.records if r.levelno >= logging.ERROR], captured_logs.text
    await agent.ok("POST", "call-1", "end", {"caller": CALLER})  # ends are never refused for it


# ETags --------------------------------------------------------------------------------------------------


async def test_history_etags_make_polling_cheap(api: Api, agent: As) -> None:
    await agent.begin("call-1", [message(1, "hi")])
    first = await agent("GET", "call-1", "history")
    etag = first.headers["ETag"]
    assert etag.startswith('W/"') and first.headers["Cache-Control"] == "no-store"
    for held in (etag, etag.removeprefix("W/"), f'"other", {etag}', "*"):
        unchanged = await agent("GET", "call-1", "history", **{"If-None-Match": held})
        assert unchanged.status == 304 and unchanged.body == "" and unchanged.headers["ETag"] == etag
    chat = await agent("GET", "call-1", "history?format=openai", **{"If-None-Match": etag})
    assert chat.status == 200 and chat.headers["ETag"] != etag  # another layout, another tag
    assert_problem(await agent("GET", "call-1", "history", **{"If-None-Match": "nope"}), 400)
    seen = [etag]
    # A new message, a summary (a history read with one works: it once was a 500), and going idle (what
    # the platform layout says changes) each change the tag.
    for change in (
        agent.append("call-1", [message(2, "again")]),
        agent.ok("PUT", "call-1", "summary", {"text": "Said hi twice.", "through_turn": 2}),
    ):
        await change
        changed = await agent("GET", "call-1", "history", **{"If-None-Match": seen[-1]})
        assert changed.status == 200 and changed.headers["ETag"] not in seen
        seen.append(changed.headers["ETag"])
    api.clock.advance(121)
    idle = await agent("GET", "call-1", "history", **{"If-None-Match": seen[-1]})
    assert idle.status == 200 and idle.body["status"] == "idle" and len(idle.body["contents"]) == 2


# Summary and context ------------------------------------------------------------------------------------


async def test_context_fits_the_budget_dropping_older_turns_first(agent: As, admin: As) -> None:
    await admin.api.call("PATCH", memory_path(PROJECT), token=admin.token, json={"caller_name": "Ada"})
    turns = [
        m
        for turn in range(1, 6)
        for m in (
            message(turn, f"question {turn}", tokens=100),
            message(turn, f"answer {turn}", "assistant", tokens=100),
        )
    ]
    await agent.begin("call-1", turns)
    reply = await agent("GET", "call-1", "context?max_tokens=1000")
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
        assert (await agent.ok("GET", "call-1", f"context?max_tokens={budget}"))["needs_summary"] is needed

    summarised = {"text": "Ada asked three things.", "through_turn": 3, "tokens": 50}
    stored = await agent.ok("PUT", "call-1", "summary", summarised)
    assert set(stored) == STATUS_KEYS and stored["summary"] == {"through_turn": 3, "tokens": 50}
    context = await agent.ok("GET", "call-1", "context?max_tokens=1000")
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
    beyond = await agent("PUT", "call-1", "summary", {"text": "x", "through_turn": 6})
    assert_problem(beyond, 422, mentions="through_turn")


async def test_token_counts_say_when_they_are_estimates(agent: As) -> None:
    await agent.begin("call-1", [message(1, "a" * 40), message(1, "b" * 8, "assistant")])
    await agent.ok("PUT", "call-1", "summary", {"text": "c" * 20, "through_turn": 0})
    context = await agent.ok("GET", "call-1", "context")
    assert context["max_tokens"] == 2000  # the default budget
    recent, summary = context["sections"]["recent_turns"], context["sections"]["summary"]
    assert (recent["token_source"], recent["tokens"]) == ("estimate", 12)  # about four characters a token
    assert (summary["token_source"], summary["tokens"]) == ("estimate", 5)


# Redaction, blacklist, disabled -------------------------------------------------------------------------


async def test_spoken_phone_numbers_are_redacted_in_content_and_original(agent: As) -> None:
    original = "I'll text 020 7946 0018 and +1 415 555 0123 now"
    messages = [
        message(1, "Call my office on 020 7946 0018 please"),
        message(1, "I'll text 020 7946", "assistant", metadata={"interrupted": True, "original": original}),
    ]
    await agent.begin("call-1", messages)
    contents = (await agent.history("call-1"))["contents"]
    assert contents[0]["content"] == "Call my office on [phone] please"
    assert contents[1]["metadata"]["original"] == "I'll text [phone] and [phone] now"


async def test_without_redaction_the_callers_own_number_is_still_removed(api: Api) -> None:
    agent = As(api, (await configure(api, redact_phone_numbers=False))["agent"])
    await agent.begin("call-1", [message(1, "My number is (415) 555-0100, my office 020 7946 0018")])
    # A later append names neither caller nor channel: the service finds out whose number to remove.
    await agent.append("call-1", [message(2, "Again: +1 415-555-0100.")])
    contents = (await agent.history("call-1"))["contents"]
    assert contents[0]["content"] == "My number is [phone], my office 020 7946 0018"
    assert contents[1]["content"] == "Again: [phone]."


async def test_a_blacklisted_caller_is_accepted_and_dropped(agent: As) -> None:
    appended = await agent.begin("call-1", [message(1, "test call")], caller="+440000000000")
    assert appended["stored"] is False and appended["reason"] == "blacklisted"
    assert await agent.start("call-2", caller="+440000000000") == {
        "conversation": None,
        "stored": False,
        "reason": "blacklisted",
        "resume": None,
        "superseded": [],
    }
    for conversation_id in ("call-1", "call-2"):
        assert_problem(await agent("GET", conversation_id), 404)


async def test_a_project_with_conversation_memory_off_accepts_and_drops(api: Api) -> None:
    tokens = await api.project_with_tokens(PROJECT, REPEAT_CALLER)
    agent = As(api, tokens["agent"])
    appended = await agent.begin("call-1", [message(1, "hi")])
    assert appended["stored"] is False and appended["reason"] == "disabled"
    started = await agent.start("call-1")
    assert started["stored"] is False and started["reason"] == "disabled"
    assert_problem(await agent("GET", "call-1"), 404, mentions="enabled")
    stored = await api.call("GET", BASE, token=tokens["admin"])
    assert stored.body["memory"]["conversation"]["enabled"] is False


# Scope, admin, audit ------------------------------------------------------------------------------------


async def test_agent_scope_shows_an_agent_the_users_messages_and_its_own(api: Api) -> None:
    tokens = await configure(api, transcript_scope="agent")
    billing, booking, nobody = [As(api, await mint_agent(api, name)) for name in ("billing", "booking", None)]
    messages = [
        message(1, "I have a question"),
        message(1, "Billing here", "assistant", metadata={"agent": "billing"}),
        message(2, "Booking here", "assistant", metadata={"agent": "booking"}),
        message(2, "Untagged", "assistant"),
    ]
    await As(api, tokens["agent"]).begin("call-1", messages)

    async def seen(reader: As) -> list[str]:
        return [m["content"] for m in (await reader.history("call-1"))["contents"]]

    assert await seen(billing) == ["I have a question", "Billing here"]
    assert await seen(booking) == ["I have a question", "Booking here"]
    assert await seen(nobody) == ["I have a question"]
    assert await seen(As(api, tokens["admin"])) == [m["content"] for m in messages]
    context = await billing.ok("GET", "call-1", "context")
    chat = context["sections"]["recent_turns"]["messages"]
    assert [m["content"] for m in chat] == ["I have a question", "Billing here"]
    listed = await As(api, tokens["admin"]).ok("GET", "", "tokens")
    assert sorted(t["agent"] or "" for t in listed["tokens"]) == ["", "", "", "", "billing", "booking"]


async def test_agent_names_belong_to_agent_tokens_only(admin: As) -> None:
    for body in (
        {"role": "admin", "agent": "billing"},
        {"role": "analytics", "agent": "billing"},
        {"role": "agent", "agent": "bad name!"},
    ):
        reply = await admin("POST", "", "tokens", body)
        assert_problem(reply, 422)
        assert reply.body["errors"][0]["field"] == "agent", reply.body


async def test_admins_list_and_delete_transcripts_and_their_reads_are_audited(
    api: Api, agent: As, admin: As
) -> None:
    for conversation_id in ("call-1", "call-2"):
        await agent.begin(conversation_id, [message(1, "hi")])
        api.clock.advance(1)
    assert_problem(await agent("GET", "", f"callers/{CALLER}/conversations"), 403)
    listed = await admin("GET", "", f"callers/{CALLER}/conversations")
    assert listed.status == 200 and listed.headers["Cache-Control"] == "no-store"
    assert [c["conversation_id"] for c in listed.body["conversations"]] == ["call-2", "call-1"]
    assert all(set(c) == STATUS_KEYS for c in listed.body["conversations"])
    assert await admin.ok("GET", "", "callers/+447700900123/conversations") == {
        "conversations": [],
        "next_cursor": None,
    }

    await agent.history("call-1")
    await agent.ok("GET", "call-1", "context")
    assert await admin.audit() == []  # the agent in the call is not audited
    await admin.history("call-1")
    await admin.ok("GET", "call-1", "context")

    assert_problem(await agent("DELETE", "call-1"), 403)
    deleted = await admin("DELETE", "call-1")
    assert deleted.status == 204 and deleted.body == ""
    assert_problem(await agent("GET", "call-1"), 410)  # deleted: gone, not never-existed
    assert_problem(await admin("DELETE", "call-1"), 404)
    assert await admin.audit() == [
        ("transcript.deleted", {"conversation_id": "call-1", "messages": 1}),
        ("transcript.read", {"conversation_id": "call-1", "read": "context"}),
        ("transcript.read", {"conversation_id": "call-1", "read": "history"}),
    ]
    listed = await admin("GET", "", f"callers/{CALLER}/conversations")
    assert [c["conversation_id"] for c in listed.body["conversations"]] == ["call-2"]


# Lifecycle: ends, late ends, resume, erasure ------------------------------------------------------------


async def test_an_inactivity_end_then_a_late_explicit_end(api: Api) -> None:
    tokens = await configure(api, idle_after=1, end_after_inactivity=2)
    agent = As(api, tokens["agent"])
    await agent.begin("call-1", [message(1, "hi")], state={"caller_name": "Ada"})
    assert (await agent.status("call-1"))["status"] == "active"
    api.clock.advance(1)
    assert (await agent.status("call-1"))["status"] == "idle"
    api.clock.advance(1)
    swept = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert swept.status == 200 and swept.body["inactivity_ends"] == 1, swept.body
    status = await agent.status("call-1")
    assert (status["status"], status["ended_by"], status["end_processed"]) == ("ended", "inactivity", True)
    memory = await api.call("GET", memory_path(PROJECT), token=tokens["agent"])
    assert memory.body["fields"] == {"caller_name": "Ada"}  # the checkpoint was persisted

    body = {"caller": CALLER, "state": {"booking_day": "Friday"}, "outcome": {"qa": "resolved"}}
    late = await agent("POST", "call-1", "end", body)
    assert late.status == 200 and late.body["late"] is True, late.body
    assert late.body["persisted"] == ["booking_day"] and late.headers["Idempotent-Replayed"] == "false"
    replay = await agent("POST", "call-1", "end", body)
    assert replay.body == late.body and replay.headers["Idempotent-Replayed"] == "true"
    assert_problem(await agent("POST", "call-1", "end", {**body, "state": {"booking_day": "Monday"}}), 409)
    memory = await api.call("GET", memory_path(PROJECT), token=tokens["agent"])
    assert memory.body["fields"] == {"caller_name": "Ada", "booking_day": "Friday"}
    rows = (await As(api, tokens["analytics"]).ok("GET", "", "analytics/conversations"))["conversations"]
    # Counted once, as the service's end recorded it.
    assert [(r["conversation_id"], r["ended_by"], r["end_reason"], r["qa"]) for r in rows] == [
        ("call-1", "inactivity", None, None)
    ]
    again = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert again.body["inactivity_ends"] == 0


async def test_a_callback_supersedes_the_open_call_and_is_offered_resume(api: Api, agent: As) -> None:
    first = [message(1, "I want to book Friday"), message(1, "Which time?", "assistant")]
    await agent.begin("call-1", first, state={"booking_day": "Friday"})
    await agent.ok("PUT", "call-1", "summary", {"text": "Booking Friday.", "through_turn": 1})
    api.clock.advance(60)
    other_channel = await agent.start("chat-1", channel="chat")
    assert other_channel["resume"] is None and other_channel["superseded"] == []
    started = await agent.start("call-2", agent="booking")
    assert started["stored"] is True and started["superseded"] == ["call-1"]
    assert set(started["conversation"]) == STATUS_KEYS and started["conversation"]["agent"] == "booking"
    resume = started["resume"]
    assert resume["conversation_id"] == "call-1" and resume["channel"] == "voice"
    assert resume["ended_by"] == "superseded" and resume["state"] == {"booking_day": "Friday"}
    assert resume["summary"]["text"] == "Booking Friday."
    assert [m["content"] for m in resume["last_turns"]] == ["I want to book Friday", "Which time?"]
    status = await agent.status("call-1")
    assert status["ended_by"] == "superseded" and status["end_processed"] is True
    again = await agent.start("call-2")  # starting again answers the same conversation
    assert again["conversation"]["conversation_id"] == "call-2"


async def test_a_dropped_call_is_offered_as_resume(api: Api, agent: As, shop: dict[str, str]) -> None:
    await agent.begin("call-1", [message(1, "Hello?")])
    await agent.ok("POST", "call-1", "end", {"caller": CALLER, "end_reason": "dropped"})
    analytics = As(api, shop["analytics"])
    rows = (await analytics.ok("GET", "", "analytics/conversations"))["conversations"]
    assert [(r["ended_by"], r["end_reason"]) for r in rows] == [("explicit", "dropped")]
    csv = await analytics("GET", "", "analytics/conversations", Accept="text/csv")
    header, row = csv.body.splitlines()[:2]
    assert header.endswith(",ended_by,end_reason,attestation") and row.endswith(",explicit,dropped,unknown")
    started = await agent.start("call-2")
    assert started["resume"]["conversation_id"] == "call-1"
    assert started["resume"]["end_reason"] == "dropped" and started["superseded"] == []
    api.clock.advance(601)  # beyond resume_window
    later = await agent.start("call-3")
    assert later["resume"] is None and later["superseded"] == ["call-2"]


async def test_erasure_removes_transcripts_and_counts_them(api: Api, agent: As, admin: As) -> None:
    for conversation_id in ("call-1", "call-2"):
        await agent.begin(conversation_id, [message(1, "hi")], channel=conversation_id)
    await agent.begin("call-3", [message(1, "hi")], caller="+447700900123")
    erased = await admin.ok("DELETE", "", f"callers/{CALLER}")
    assert erased["removed"]["transcripts"] == 2, erased
    for conversation_id in ("call-1", "call-2"):
        assert_problem(await agent("GET", conversation_id), 410)
    await agent.status("call-3")
    # An append made before the erasure and delivered after it (an SDK outbox) is dropped.
    retried = await agent.begin("call-4", [message(1, "late")], sent_at=api.clock.now_ms() - 1000)
    assert retried["stored"] is False and retried["reason"] == "erased"


async def test_an_agent_token_writes_as_its_own_agent(api: Api) -> None:
    tokens = await configure(api, transcript_scope="agent")
    billing = As(api, await mint_agent(api, "billing"))
    await billing.start("call-1")
    await billing.append("call-1", [message(1, "hello"), message(1, "Billing here", "assistant")])
    contents = (await As(api, tokens["admin"]).history("call-1"))["contents"]
    assert [m["metadata"].get("agent") for m in contents] == [
        None,
        "billing",
    ]  # the user's stays unattributed
    assert (await billing.status("call-1"))["agent"] == "billing"
    before = await As(api, tokens["admin"]).history("call-1")
    impostor = await billing("POST", "call-1", "messages", {
        "messages": [message(2, "Booking here", "assistant", metadata={"agent": "booking"})]})  # fmt: skip
    assert_problem(impostor, 422)
    assert impostor.body["errors"][0]["field"] == "messages[0].metadata.agent"
    assert await As(api, tokens["admin"]).history("call-1") == before
    refused = await billing(
        "POST", "call-2", "start", {"caller": CALLER, "channel": "voice", "agent": "booking"}
    )
    assert_problem(refused, 422)


async def test_a_retry_of_a_message_without_a_timestamp_is_a_no_op(agent: As) -> None:
    batch = [{"message_id": "m-1", "role": "user", "content": "hi", "turn_id": 0}]
    first = await agent.begin("call-1", batch, sent_at=1_700_000_000_000)
    agent.api.clock.advance(5)
    again = await agent.begin("call-1", batch, sent_at=1_700_000_000_000)
    assert (first["added"], again["added"], again["messages"]) == (1, 0, 1)
    assert (await agent.history("call-1"))["contents"][0]["timestamp"] == 1_700_000_000_000


@pytest.mark.parametrize(
    "bad",
    [{"turn_id": "2"}, {"turn_id": 2.0}, {"turn_id": True}, {"content": 5}, {"timestamp": "1678901230000"}],
)
async def test_message_fields_have_their_json_types(agent: As, bad: dict[str, Any]) -> None:
    reply = await agent("POST", "call-1", "messages", {
        "caller": CALLER, "channel": "voice", "messages": [message(2, "hi") | bad]})  # fmt: skip
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"].startswith("messages[0]."), reply.body
    assert_problem(await agent("GET", "call-1"), 404)  # nothing was started


async def test_a_late_end_with_another_end_reason_is_a_conflict(api: Api) -> None:
    tokens = await configure(api, idle_after=1, end_after_inactivity=2)
    agent = As(api, tokens["agent"])
    await agent.begin("call-1", [message(1, "hi")])
    api.clock.advance(2)
    assert (await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)).body["inactivity_ends"] == 1
    body = {"caller": CALLER, "state": {"booking_day": "Friday"}, "end_reason": "dropped"}
    assert (await agent.ok("POST", "call-1", "end", body))["late"] is True
    assert_problem(await agent("POST", "call-1", "end", {**body, "end_reason": "completed"}), 409)


async def test_an_inactivity_end_must_come_before_the_transcript_expires(api: Api) -> None:
    document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": {
        "enabled": True, "transcript_retention": "PT1M", "end_after_inactivity": "PT30M"}}}  # fmt: skip
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == "memory.conversation.end_after_inactivity"


async def test_a_summary_longer_than_the_budget_is_left_out_of_the_context(agent: As) -> None:
    await agent.begin("call-1", [message(1, "hello"), message(1, "Hi!", "assistant")])
    await agent.ok("PUT", "call-1", "summary", {"text": "a long summary", "through_turn": 0, "tokens": 500})
    context = await agent.ok("GET", "call-1", "context?max_tokens=100")
    assert context["sections"]["summary"] is None and context["tokens"] <= 100
    fits = await agent.ok("GET", "call-1", "context?max_tokens=1000")
    assert fits["sections"]["summary"]["tokens"] == 500 and fits["tokens"] <= 1000


async def test_errors_say_what_is_wrong_in_words(agent: As) -> None:
    too_big = await agent("GET", "call-1", "context?max_tokens=99999999")
    assert_problem(too_big, 422)
    assert "at most 1,000,000" in too_big.body["detail"]
    system = await agent("POST", "call-1", "messages", {
        "caller": CALLER, "channel": "voice", "messages": [message(0, "You are a bot", "system")]})  # fmt: skip
    assert "system prompts are never stored" in system.body["detail"]
    many = await agent("POST", "call-1", "messages", {
        "caller": CALLER, "channel": "voice", "messages": [message(0, "x")] * 101})  # fmt: skip
    assert "at most 100 items in one request" in many.body["detail"]
    channel = await agent("POST", "call-1", "start", {"caller": CALLER, "channel": "no spaces"})
    assert "letters, digits" in channel.body["detail"] and "^" not in channel.body["detail"]


async def test_a_summary_naming_its_caller_masks_their_number_written_in_their_own_country(api: Api) -> None:
    # The project reads numbers as GB ones and masks only the caller's own; this caller is American and
    # their number is written the US way (read as a GB number it would be another one).
    tokens = await configure(api, redact_phone_numbers=False)
    agent = As(api, tokens["agent"])
    american = "+14155550123"
    await agent.ok("POST", "call-1", "messages", {
        "caller": american, "channel": "voice", "messages": [message(0, "hi")]})  # fmt: skip
    summary = {"text": "Call back on (415) 555-0123 after six", "through_turn": 0}
    await agent.ok("PUT", "call-1", "summary", summary | {"caller": american})
    stored = (await agent.ok("GET", "call-1", "context"))["sections"]["summary"]["text"]
    assert stored == "Call back on [phone] after six"
    await agent.ok(
        "PUT", "call-1", "summary", {"text": "Or on 020 7946 0018", "through_turn": 0, "caller": american}
    )
    kept = (await agent.ok("GET", "call-1", "context"))["sections"]["summary"]["text"]
    assert kept == "Or on 020 7946 0018"  # another number, left as it is with redact_phone_numbers off
    other = await agent("PUT", "call-1", "summary", summary | {"caller": CALLER})
    assert_problem(other, 409)
