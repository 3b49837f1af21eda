"""Issue 27, item 6: numbers outside a transcript's content. Ids a client chooses (conversation id, channel,
agent, message id) that hold a phone number are refused at the first request that names them (422 naming
the member, never echoing it, nothing stored); outcome strings are masked, never refused; checkpoint values
are redacted like content. Through a real server on SQLite, Redis and Redis Cluster."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.conftest import OPERATOR_TOKEN, Api
from tests.http.test_api import CALLER, assert_problem
from tests.http.test_transcripts import PROJECT, As, configure, message

NUMBER = "+14155550177"  # a number the caller gives for a transfer or a callback (not the caller's own)
DIGITS = NUMBER[2:]


@pytest.fixture
async def tokens(api: Api) -> dict[str, str]:
    return await configure(api)


def no_number(body: Any) -> None:
    text = orjson.dumps(body).decode()
    assert DIGITS not in text and DIGITS[-7:] not in text, text


@pytest.mark.parametrize(
    ("what", "body", "field"),
    [
        ("start", {"caller": CALLER, "channel": "phone-1" + DIGITS}, "channel"),
        ("start", {"caller": CALLER, "channel": "phone", "agent": "agent" + DIGITS}, "agent"),
        ("messages", {"caller": CALLER, "channel": "c-" + DIGITS, "messages": []}, "channel"),
        (
            "messages",
            {"caller": CALLER, "channel": "phone", "messages": [message(1, "hi", message_id="m-1" + DIGITS)]},
            "messages[0].message_id",
        ),
        (
            "messages",
            {
                "caller": CALLER,
                "channel": "phone",
                "messages": [message(1, "hi", "assistant", metadata={"agent": "a" + DIGITS})],
            },
            "messages[0].metadata.agent",
        ),
        ("end", {"caller": CALLER, "channel": "voice " + NUMBER}, "channel"),
    ],
)
async def test_an_id_holding_a_number_is_refused_naming_it(
    api: Api, tokens: dict[str, str], what: str, body: dict[str, Any], field: str
) -> None:
    agent = As(api, tokens["agent"])
    refused = await agent("POST", "call-1", what, body)
    assert_problem(refused, 422)
    assert refused.body["errors"][0]["field"] == field
    no_number(refused.body)
    assert_problem(await agent("GET", "call-1"), 404)  # nothing was stored


@pytest.mark.parametrize("what", ["start", "messages", "end"])
async def test_a_conversation_id_holding_a_number_is_refused_at_its_first_request(
    api: Api, tokens: dict[str, str], what: str
) -> None:
    agent = As(api, tokens["agent"])
    body: dict[str, Any] = {"caller": CALLER, "channel": "phone"}
    if what == "messages":
        body["messages"] = [message(1, "hi")]
    refused = await agent("POST", "call-" + DIGITS, what, body)
    assert_problem(refused, 422)
    assert refused.body["errors"][0]["field"] == "conversation_id"
    no_number(refused.body)
    memory = await api.call("GET", f"/v1/projects/{PROJECT}/callers/{CALLER}/memory", token=tokens["admin"])
    assert memory.body["fields"] == {}


async def test_ids_platforms_make_are_taken(api: Api, tokens: dict[str, str]) -> None:
    agent = As(api, tokens["agent"])
    for conversation_id in (
        "vapi:5f0c2b4e-8a7d-4f55-9e21-416555010077",
        "CA0123456789abcdef0123456789abcdef",
    ):
        started = await agent.start(conversation_id)
        assert started["stored"] is True
        await agent.ok("POST", conversation_id, "end", {"caller": CALLER})


async def test_an_agent_token_named_with_a_number_is_refused(api: Api, tokens: dict[str, str]) -> None:
    # A GB mobile in its national form, in a project whose region is GB (no caller here to read it by).
    body = {"role": "agent", "agent": "desk-07911123456"}
    refused = await api.call("POST", f"/v1/projects/{PROJECT}/tokens", token=OPERATOR_TOKEN, json=body)
    assert_problem(refused, 422)
    assert refused.body["errors"][0]["field"] == "agent"
    assert "7911123456" not in orjson.dumps(refused.body).decode()


async def test_an_outcome_is_masked_never_refused(api: Api, tokens: dict[str, str]) -> None:
    agent = As(api, tokens["agent"])
    await agent.begin("call-1", [message(1, "put me through please")])
    outcome = {"qa": "ok", "handoff_reason": "asked for a human", "handoff_to": NUMBER}
    ended = await agent.ok("POST", "call-1", "end", {"caller": CALLER, "outcome": outcome})
    assert ended["erased"] is False
    rows = await As(api, tokens["analytics"]).ok("GET", "", "analytics/conversations")
    [row] = rows["conversations"]
    assert row["handoff_to"] == "[phone]" and row["handoff_reason"] == "asked for a human"
    no_number(rows)
    csv = await api.call(
        "GET",
        f"/v1/projects/{PROJECT}/analytics/conversations",
        token=tokens["analytics"],
        headers={"Accept": "text/csv"},
    )
    assert csv.status == 200 and DIGITS not in str(csv.body)
    # Its retry (the SDK's outbox) is the same request: a replay, not a conflict.
    again = await agent("POST", "call-1", "end", {"caller": CALLER, "outcome": outcome})
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"


async def test_checkpoint_values_are_redacted_like_content(api: Api, tokens: dict[str, str]) -> None:
    agent = As(api, tokens["agent"])
    state = {"caller_name": "Ada", "booking_day": f"Friday, call back on {NUMBER}"}
    await agent.begin("call-1", [message(1, "hi")], state=state)
    await agent.ok("POST", "call-1", "end", {"caller": CALLER, "end_reason": "dropped", "state": {}})
    resumed = await agent.start("call-2")
    offered = resumed["resume"]
    assert offered["conversation_id"] == "call-1"
    assert offered["state"] == {"caller_name": "Ada", "booking_day": "Friday, call back on [phone]"}
    no_number(resumed)
