"""An agent connection is bound to its call: whatever the model writes, it never reaches another caller or
another project; ``remember`` followed by a platform's end persists the key; no number in a tool's answer or
in any log line."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.conftest import OPERATOR_TOKEN, canonical_digits
from tests.mcp.conftest import BASE, CALLER, CONFIG, CONVERSATION, OTHER_CALLER, Shop
from tests.mcp.test_agent_tools import result_of, text_of
from tests.platforms.test_retell_webhooks import ANALYSIS, Retell, retell, started

__all__ = ["retell"]  # the fixture, used below


async def test_whatever_the_model_sends_the_tools_answer_for_the_bound_call_only(shop: Shop) -> None:
    await shop.remember(caller_name="Ada")
    await shop.remember(OTHER_CALLER, caller_name="Bob")
    await shop.start("call-2", OTHER_CALLER)
    smuggled = {
        "caller": OTHER_CALLER,
        "identifier": OTHER_CALLER,
        "conversation_id": "call-2",
        "project": "x",
    }
    async with shop.client() as client:
        memory = await client.call_tool("get_caller_memory", smuggled)
        history = await client.call_tool("get_history", smuggled)
        context = await client.call_tool("get_context", smuggled)
        kept = await client.call_tool("remember", {"key": "cheese", "value": "brie", **smuggled})
        staff = await client.call_tool("lookup_caller", {"identifier": OTHER_CALLER})
    for answer in (memory, history, context, kept):
        assert "Bob" not in str(answer.content)
        if not answer.is_error:
            assert "call-2" not in str(answer.structured_content)
    if not memory.is_error:
        assert memory.structured_content["fields"] == {"caller_name": "Ada"}
    assert staff.is_error  # not an agent connection's tool
    # The other caller's call ends: nothing was remembered for it.
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/call-2/end",
        token=shop.agent,
        json={"caller": OTHER_CALLER, "state": {}},
    )
    assert reply.status == 200, reply.body
    assert await shop.memory(OTHER_CALLER) == {"caller_name": "Bob"}


async def test_a_token_of_one_project_never_reaches_another(shop: Shop) -> None:
    other = "other-shop"
    reply = await shop.api.call("PUT", f"/v1/projects/{other}", token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    their_agent = await shop.api.mint(other, "agent")
    # The other project has a conversation of the same id, of another caller with memory.
    reply = await shop.api.call(
        "POST",
        f"/v1/projects/{other}/conversations/{CONVERSATION}/start",
        token=their_agent,
        json={"caller": OTHER_CALLER, "channel": "phone"},
    )
    assert reply.status == 200, reply.body
    reply = await shop.api.call(
        "PATCH",
        f"/v1/projects/{other}/callers/{OTHER_CALLER}/memory",
        token=OPERATOR_TOKEN,
        json={"cheese": "feta"},
    )
    assert reply.status == 200, reply.body
    for token in (shop.agent, shop.staff, shop.admin, shop.platform):
        for conversation in (CONVERSATION, None):
            reply = await shop.list_raw(token, project=other, conversation=conversation)
            assert reply.status == 404, (token, conversation, reply.body)  # not even told it exists
    # Its own project's conversation of that id is its own caller's.
    async with shop.client() as client:
        found = result_of(await client.call_tool("get_caller_memory", {}))
    assert "feta" not in str(found)


async def test_a_connection_before_its_call_starts_lists_the_tools_and_binds_once_it_starts(
    shop: Shop,
) -> None:
    await shop.remember(OTHER_CALLER, caller_name="Bob")
    async with shop.client(conversation="call-later") as client:
        names = {t.name for t in (await client.list_tools()).tools}
        early = await client.call_tool("get_caller_memory", {})
        await shop.start("call-later", OTHER_CALLER)
        later = result_of(await client.call_tool("get_caller_memory", {}))
    assert names == {"get_caller_memory", "remember", "get_context", "get_history"}
    assert early.is_error and "has not started" in text_of(early)
    assert later["fields"] == {"caller_name": "Bob"}
    for conversation in ("has space", "x" * 200):
        reply = await shop.list_raw(shop.agent, conversation=conversation)
        assert reply.status == 422, reply.body
        assert "X-Caller-Memory-Conversation" in reply.body["error"]["message"]


async def test_bad_input_is_a_tool_error_that_changes_nothing(shop: Shop) -> None:
    async with shop.client() as client:
        answers = [
            await client.call_tool("remember", {"key": "password", "value": "x"}),
            await client.call_tool("remember", {"key": "1bad", "value": "x"}),
            await client.call_tool("remember", {"key": "cheese", "value": "x" * 3000}),
            await client.call_tool("remember", {"key": "cheese"}),
            await client.call_tool("get_context", {"max_tokens": -5}),
            await client.call_tool("get_history", {"after_turn": "soon"}),
        ]
    for answer in answers:
        assert answer.is_error, answer
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/{CONVERSATION}/end",
        token=shop.agent,
        json={"caller": CALLER, "state": {}},
    )
    assert reply.status == 200, reply.body
    assert await shop.memory() == {}
    # The call has ended: nothing more is remembered.
    async with shop.client() as client:
        late = await client.call_tool("remember", {"key": "cheese", "value": "brie"})
    assert late.is_error and "ended" in text_of(late)


async def test_a_remembered_number_is_redacted_and_no_number_is_in_an_answer_or_a_log(
    shop: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await shop.remember(caller_name="Ada")
    answers: list[Any] = []
    async with shop.client() as client:
        answers.append(
            await client.call_tool("remember", {"key": "booking", "value": f"call me on {CALLER}"})
        )
        for tool, arguments in (
            ("get_caller_memory", {}),
            ("get_context", {"max_tokens": 1000}),
            ("get_history", {}),
            ("remember", {"key": "nope", "value": CALLER}),
        ):
            answers.append(await client.call_tool(tool, arguments))
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/{CONVERSATION}/end",
        token=shop.agent,
        json={"caller": CALLER, "state": {}},
    )
    assert reply.status == 200, reply.body
    digits = CALLER.removeprefix("+1")
    assert "booking" in await shop.memory() and digits not in canonical_digits(str(await shop.memory()))
    for answer in answers:
        assert digits not in canonical_digits(str(answer.content) + str(answer.structured_content))
    for record in caplog.records:
        assert digits not in canonical_digits(record.getMessage()), record.getMessage()


async def test_remember_then_a_platforms_end_persists_the_key(retell: Retell) -> None:
    conversation = await started(retell)
    platform = await retell.api.mint("cheese-shop", "platform")
    shop = Shop(retell.api, retell.agent, retell.admin, staff="", platform=platform)
    async with shop.client(platform, conversation=conversation) as client:
        kept = result_of(await client.call_tool("remember", {"key": "cheese", "value": "Stilton"}))
    assert kept["kept"] is True
    analysis = ANALYSIS | {"custom_analysis_data": {"customer_name": "Ada"}}
    call = retell.call("call_1", conversation, call_analysis=analysis)
    assert (await retell.event("call_ended", call)).body["outcome"] == "held"
    assert (await retell.event("call_analyzed", call)).body["outcome"] == "ended"
    assert await retell.memory() == {"caller_name": "Ada", "cheese": "Stilton"}


async def test_with_conversation_memory_off_the_tools_say_so(shop: Shop) -> None:
    config = {"memory": {"repeat_caller": CONFIG["memory"]["repeat_caller"]}}  # conversation memory off
    reply = await shop.api.call("PUT", BASE, token=OPERATOR_TOKEN, json=config)
    assert reply.status == 200, reply.body
    async with shop.client(conversation="call-off") as client:
        assert {t.name for t in (await client.list_tools()).tools} >= {"remember"}
        refused = await client.call_tool("get_caller_memory", {})
    assert refused.is_error and "memory.conversation.enabled" in text_of(refused)
