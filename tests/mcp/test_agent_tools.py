"""The agent tools over Streamable HTTP with the official ``mcp`` client, on SQLite and Redis."""

from __future__ import annotations

import json
from typing import Any

from mcp_types import TextContent, ToolAnnotations

from tests.conftest import OPERATOR_TOKEN
from tests.mcp.conftest import BASE, CALLER, CONFIG, Shop


def text_of(answer: Any) -> str:
    """A tool answer's (first) text."""
    content = answer.content[0]
    assert isinstance(content, TextContent), content
    return content.text


def annotations_of(tool: Any) -> ToolAnnotations:
    assert tool.annotations is not None, tool.name
    annotations: ToolAnnotations = tool.annotations
    return annotations


def result_of(answer: Any) -> dict[str, Any]:
    assert not answer.is_error, answer.content
    structured: dict[str, Any] = answer.structured_content
    assert json.loads(text_of(answer)) == structured
    return structured


async def test_the_agent_tools_are_listed_with_their_hints(shop: Shop) -> None:
    async with shop.client() as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == {"get_caller_memory", "remember", "get_context", "get_history"}
    for name in ("get_caller_memory", "get_context", "get_history"):
        assert annotations_of(tools[name]).read_only_hint is True
    assert annotations_of(tools["remember"]).read_only_hint is False


async def test_get_caller_memory_reads_the_calls_caller(shop: Shop) -> None:
    await shop.remember(caller_name="Ada", cheese="brie")
    async with shop.client() as client:
        found = result_of(await client.call_tool("get_caller_memory", {}))
    assert found == {"fields": {"caller_name": "Ada", "cheese": "brie"}, "withheld": [], "known": True}


async def test_remember_then_the_sdks_end_persists_it(shop: Shop) -> None:
    async with shop.client() as client:
        kept = result_of(await client.call_tool("remember", {"key": "booking", "value": {"day": "Tue"}}))
        assert kept["kept"] is True
        bad = await client.call_tool("remember", {"key": "password", "value": "x"})
    assert bad.is_error and "state_keys" in text_of(bad)
    assert await shop.memory() == {}
    reply = await shop.api.call(
        "POST",
        "/v1/projects/cheese-shop/conversations/call-1/end",
        token=shop.agent,
        json={"caller": CALLER, "state": {"cheese": "gouda"}},
    )
    assert reply.status == 200, reply.body
    assert await shop.memory() == {"booking": {"day": "Tue"}, "cheese": "gouda"}


async def test_context_and_history(shop: Shop) -> None:
    async with shop.client() as client:
        context = result_of(await client.call_tool("get_context", {"max_tokens": 500}))
        history = result_of(await client.call_tool("get_history", {}))
        bad = await client.call_tool("get_context", {"max_tokens": 0})
    assert context["max_tokens"] == 500
    assert history["conversation_id"] == "call-1"
    assert bad.is_error


async def test_the_calls_stored_trust_withholds_fields_from_reads_and_writes(shop: Shop) -> None:
    rc = CONFIG["memory"]["repeat_caller"] | {
        "field_classes": {"booking": "account"},
        "trust": {"account": "A"},
    }
    config = {"memory": {"repeat_caller": rc, "conversation": {"enabled": True}}}
    reply = await shop.api.call("PUT", BASE, token=OPERATOR_TOKEN, json=config)
    assert reply.status == 200, reply.body
    await shop.remember(caller_name="Ada", booking={"day": "Fri"})
    await shop.start("call-b", attestation="B")
    await shop.start("call-a", attestation="A")
    async with shop.client(conversation="call-b") as client:
        weak = result_of(await client.call_tool("get_caller_memory", {}))
        refused = await client.call_tool("remember", {"key": "booking", "value": {"day": "Mon"}})
    async with shop.client(conversation="call-a") as client:
        strong = result_of(await client.call_tool("get_caller_memory", {}))
    assert weak == {"fields": {"caller_name": "Ada"}, "withheld": ["booking"], "known": True}
    assert refused.is_error and "trust" in text_of(refused)
    assert strong["fields"] == {"booking": {"day": "Fri"}, "caller_name": "Ada"} and strong["withheld"] == []
