"""Bad input to conversation memory: every body and query of its endpoints gets a clear 4xx naming the field
(or the parameter), never a 5xx, and changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Api
from tests.http.test_api import CALLER, assert_problem
from tests.http.test_transcripts import BASE, configure, conv, message

GOOD_MESSAGE = message(1, "hello")
TOO_LONG = "x" * 70


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    """A project with conversation memory on and one conversation, call-1, with one message at turn 1."""
    tokens = await configure(api)
    reply = await api.call(
        "POST",
        conv("call-1", "messages"),
        token=tokens["agent"],
        json={"caller": CALLER, "channel": "voice", "messages": [GOOD_MESSAGE]},
    )
    assert reply.status == 200, reply.body
    return tokens


async def unchanged(api: Api, shop: dict[str, str]) -> None:
    status = await api.call("GET", conv("call-1"), token=shop["agent"])
    assert status.status == 200
    assert (status.body["messages"], status.body["turn_id"], status.body["summary"]) == (1, 1, None)
    assert status.body["status"] == "active"
    for other in ("call-2", "call-3"):
        assert (await api.call("GET", conv(other), token=shop["agent"])).status == 404


def with_message(**changes: Any) -> dict[str, Any]:
    return {"messages": [{**GOOD_MESSAGE, **changes}]}


START = {"caller": CALLER, "channel": "voice"}

APPEND_CASES: list[tuple[dict[str, Any], str, int]] = [
    ({"messages": "hello"}, "messages", 422),
    ({"messages": [GOOD_MESSAGE] * 101}, "messages", 422),
    ({"messages": [{"content": "hi", "turn_id": 1}]}, "messages[0].role", 422),
    (with_message(role="system"), "messages[0].role", 422),
    (with_message(content=None), "messages[0].content", 422),
    (with_message(turn_id=-1), "messages[0].turn_id", 422),
    (with_message(turn_id=2**53 - 1, tokens=-1), "messages[0].tokens", 422),
    (with_message(turn_id=[2]), "messages[0].turn_id", 422),
    (with_message(turn_id=1.5), "messages[0].turn_id", 422),
    (with_message(timestamp=-5), "messages[0].timestamp", 422),
    (with_message(tokens=1_000_001), "messages[0].tokens", 422),
    (with_message(message_id="has space"), "messages[0].message_id", 422),
    (with_message(message_id=""), "messages[0].message_id", 422),
    (with_message(colour="blue"), "messages[0].colour", 422),
    (with_message(metadata={"source": "llm"}), "messages[0]", 422),
    (with_message(metadata={"source": "telepathy"}), "messages[0]", 422),
    (with_message(metadata={"interrupted": True}), "messages[0]", 422),
    (with_message(role="assistant", metadata={"original": "x"}), "messages[0]", 422),
    (with_message(role="assistant", metadata={"interrupt_timestamp": 5}), "messages[0]", 422),
    (with_message(metadata={"agent": "bad name"}), "messages[0].metadata.agent", 422),
    (with_message(metadata={"mood": "happy"}), "messages[0].metadata.mood", 422),
    (with_message(metadata=[]), "messages[0].metadata", 422),
    ({"messages": [message(2, "a"), message(1, "b")]}, "messages", 422),
    ({**with_message(), "caller": CALLER}, "caller", 422),
    ({**with_message(), "caller": CALLER, "channel": "bad channel"}, "channel", 422),
    ({**with_message(), "caller": "hello", "channel": "voice"}, "caller", 422),
    ({**with_message(), "caller": "1" * 65, "channel": "voice"}, "caller", 422),
    ({**with_message(), "agent": TOO_LONG}, "agent", 422),
    ({**with_message(), "state": {"bad-name": 1}}, "state.bad-name", 422),
    ({**with_message(), "state": {"caller_name": "x" * 3000}}, "state.caller_name", 422),
    ({**with_message(), "state": ["caller_name"]}, "state", 422),
    ({**with_message(), "sent_at": -1}, "sent_at", 422),
    ({**with_message(), "sent_at": "yesterday"}, "sent_at", 422),
    ({**with_message(), "extra": 1}, "extra", 422),
    (with_message(content="x" * 20_000), "messages[0]", 413),
]


@pytest.mark.parametrize(("body", "field", "status"), APPEND_CASES)
async def test_bad_appends_name_the_field_and_change_nothing(
    api: Api, shop: dict[str, str], body: dict[str, Any], field: str, status: int
) -> None:
    # A state checkpoint with a valid key rides along: a refused append must not keep even that.
    sent = {"state": {"caller_name": "Ada"}, **body}
    for conversation_id in ("call-1", "call-2"):
        if conversation_id == "call-2" and "caller" not in sent:
            sent = {**sent, "caller": CALLER, "channel": "voice"}
        reply = await api.call("POST", conv(conversation_id, "messages"), token=shop["agent"], json=sent)
        assert_problem(reply, status)
        assert reply.body["errors"][0]["field"] == field, reply.body
    await unchanged(api, shop)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"channel": "voice"}, "caller"),
        ({"caller": CALLER}, "channel"),
        ({**START, "caller": "hello"}, "caller"),
        ({**START, "caller": 14155550100}, "caller"),
        ({**START, "channel": ""}, "channel"),
        ({**START, "channel": "-voice"}, "channel"),
        ({**START, "channel": TOO_LONG}, "channel"),
        ({**START, "agent": "bad name"}, "agent"),
        ({**START, "extra": True}, "extra"),
    ],
)
async def test_bad_starts_name_the_field_and_change_nothing(
    api: Api, shop: dict[str, str], body: dict[str, Any], field: str
) -> None:
    reply = await api.call("POST", conv("call-2", "start"), token=shop["agent"], json=body)
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == field, reply.body
    await unchanged(api, shop)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"through_turn": 1}, "text"),
        ({"text": "s"}, "through_turn"),
        ({"text": "x" * 32_001, "through_turn": 1}, "text"),
        ({"text": 5, "through_turn": 1}, "text"),
        ({"text": "s", "through_turn": -1}, "through_turn"),
        ({"text": "s", "through_turn": 2}, "through_turn"),  # beyond the latest turn
        ({"text": "s", "through_turn": 1, "tokens": -1}, "tokens"),
        ({"text": "s", "through_turn": 1, "tokens": 1_000_001}, "tokens"),
        ({"text": "s", "through_turn": 1, "model": "gpt"}, "model"),
    ],
)
async def test_bad_summaries_name_the_field_and_change_nothing(
    api: Api, shop: dict[str, str], body: dict[str, Any], field: str
) -> None:
    reply = await api.call("PUT", conv("call-1", "summary"), token=shop["agent"], json=body)
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == field, reply.body
    await unchanged(api, shop)


@pytest.mark.parametrize(
    ("query", "parameter"),
    [
        ("format=xml", "format"),
        ("format=OPENAI", "format"),
        ("after_turn=-1", "after_turn"),
        ("after_turn=abc", "after_turn"),
        ("after_turn=1e3", "after_turn"),
        ("after_turn=+1", "after_turn"),
        ("after_turn=9007199254740992", "after_turn"),
        ("after_turn=99999999999999999999", "after_turn"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=", "limit"),
        ("limit=1&limit=2", "limit"),
    ],
)
async def test_bad_history_queries_name_the_parameter(
    api: Api, shop: dict[str, str], query: str, parameter: str
) -> None:
    reply = await api.call("GET", conv("call-1", f"history?{query}"), token=shop["agent"])
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == parameter, reply.body
    assert "[number]" not in reply.body["detail"]  # bounds are written so that masking leaves them be


@pytest.mark.parametrize("value", ["0", "1000001", "x", "-5", "2.5", ""])
async def test_bad_context_budgets_name_the_parameter(api: Api, shop: dict[str, str], value: str) -> None:
    reply = await api.call("GET", conv("call-1", f"context?max_tokens={value}"), token=shop["agent"])
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == "max_tokens", reply.body


async def test_the_query_bounds_are_accepted(api: Api, shop: dict[str, str]) -> None:
    for path in (
        "history?after_turn=9007199254740991&limit=1000&format=openai",
        "history?after_turn=0&limit=1",
        "context?max_tokens=1",
        "context?max_tokens=1000000",
    ):
        reply = await api.call("GET", conv("call-1", path), token=shop["agent"])
        assert reply.status == 200, (path, reply.body)


@pytest.mark.parametrize(
    ("method", "what", "body"),
    [
        ("POST", "start", START),
        ("POST", "messages", {"messages": [GOOD_MESSAGE]}),
        ("GET", "", None),
        ("DELETE", "", None),
        ("GET", "history", None),
        ("PUT", "summary", {"text": "s", "through_turn": 1}),
        ("GET", "context", None),
    ],
)
@pytest.mark.parametrize("conversation_id", ["bad id!", "-dash", "x" * 129, "caf%C3%A9"])
async def test_a_malformed_conversation_id_is_422_naming_it(
    api: Api, shop: dict[str, str], method: str, what: str, body: Any, conversation_id: str
) -> None:
    reply = await api.call(method, conv(conversation_id, what), token=shop["admin"], json=body)
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == "conversation_id", reply.body
    await unchanged(api, shop)


async def test_a_caller_listing_with_a_bad_identifier_names_it(api: Api, shop: dict[str, str]) -> None:
    for identifier in ("hello", "12", "+1%20415%20555%20CALL"):
        reply = await api.call("GET", f"{BASE}/callers/{identifier}/conversations", token=shop["admin"])
        assert_problem(reply, 422)
        assert reply.body["errors"][0]["field"] == "identifier", reply.body


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"caller": CALLER, "end_reason": "hung_up"}, "end_reason"),
        ({"caller": CALLER, "end_reason": 1}, "end_reason"),
        ({"caller": CALLER, "end_reason": "Completed"}, "end_reason"),
    ],
)
async def test_a_bad_end_reason_is_422_and_does_not_end(
    api: Api, shop: dict[str, str], body: dict[str, Any], field: str
) -> None:
    reply = await api.call("POST", conv("call-1", "end"), token=shop["agent"], json=body)
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == field, reply.body
    await unchanged(api, shop)


@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        (b"", "application/json", 400),
        (b"{", "application/json", 400),
        (b"[]", "application/json", 422),
        (b"null", "application/json", 422),
        (b'"text"', "application/json", 422),
        (b"{}", "text/plain", 415),
        (b'{"messages": [], "messages": []}', "application/json", 422),
        (b'{"text": "s", "through_turn": 9007199254740992}', "application/json", 422),
    ],
)
@pytest.mark.parametrize(("method", "what"), [("POST", "start"), ("POST", "messages"), ("PUT", "summary")])
async def test_bodies_that_are_not_json_objects(
    api: Api, shop: dict[str, str], data: bytes, content_type: str, status: int, method: str, what: str
) -> None:
    reply = await api.call(
        method, conv("call-1", what), token=shop["agent"], data=data, headers={"Content-Type": content_type}
    )
    assert 400 <= reply.status < 500
    assert_problem(reply, status)
    await unchanged(api, shop)
