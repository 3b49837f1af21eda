"""The staff tools and the erasure over Streamable HTTP with the official ``mcp`` client: a ``staff`` token
looks up any caller of its project (each use audited as ``mcp:token:<id>``), agent and platform tokens are
refused them, and the erasure exists only on a connection that opts in, asks the person at the client to
confirm through elicitation, and answers the receipt."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import ElicitResult

from tests.mcp.conftest import BASE, CALLER, CONVERSATION, OTHER_CALLER, Shop
from tests.mcp.test_agent_tools import annotations_of, result_of, text_of

ALLOW = {"X-Caller-Memory-Erasure": "allow"}


async def audit(shop: Shop) -> list[dict[str, Any]]:
    reply = await shop.api.call("GET", f"{BASE}/audit?limit=50", token=shop.admin)
    assert reply.status == 200, reply.body
    records: list[dict[str, Any]] = reply.body["records"]
    return records


async def test_a_staff_token_looks_up_lists_and_reads_and_each_use_is_audited(shop: Shop) -> None:
    await shop.remember(caller_name="Ada")
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/{CONVERSATION}/messages",
        token=shop.agent,
        json={"messages": [{"role": "user", "content": "I want brie", "turn_id": 0}]},
    )
    assert reply.status == 200, reply.body
    async with shop.client(shop.staff, conversation=None) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {"lookup_caller", "list_conversations", "read_transcript"}
        assert all(annotations_of(t).read_only_hint for t in tools.values())
        found = result_of(await client.call_tool("lookup_caller", {"identifier": "(415) 555-0100"}))
        listed = result_of(await client.call_tool("list_conversations", {"identifier": CALLER}))
        read = result_of(await client.call_tool("read_transcript", {"conversation_id": CONVERSATION}))
        bad = await client.call_tool("lookup_caller", {"identifier": "not a number"})
        missing = await client.call_tool("read_transcript", {"conversation_id": "never"})
    # The one answer holding an identifier: the staff member's own, as the service normalised it.
    assert found["identifier"] == CALLER and found["fields"] == {"caller_name": "Ada"}
    assert [c["conversation_id"] for c in listed["conversations"]] == [CONVERSATION]
    assert [m["content"] for m in read["contents"]] == ["I want brie"]
    assert bad.is_error and "+1" not in text_of(bad)
    assert missing.is_error and "no transcript" in text_of(missing)
    actions = [(r["actor"], r["action"]) for r in await audit(shop)]
    staff_actor = next(a for a, _ in actions if a.startswith("mcp:token:"))
    assert {a for a, act in actions if a == staff_actor} == {staff_actor}
    assert {act for a, act in actions if a == staff_actor} >= {
        "caller.looked_up",
        "caller.conversations_listed",
        "transcript.read",
    }


@pytest.mark.parametrize("role", ["agent", "platform"])
async def test_staff_tools_are_refused_to_agent_and_platform_tokens(shop: Shop, role: str) -> None:
    token = shop.agent if role == "agent" else shop.platform
    # Refused at connection: the client raises the server's error (inside its task group's).
    with pytest.raises((MCPError, BaseExceptionGroup)) as caught:
        async with shop.client(token, conversation=None) as client:
            await client.list_tools()
    assert isinstance(caught.value, MCPError) or caught.group_contains(MCPError)
    reply = await shop.list_raw(token)
    # Refused as a JSON-RPC error (what MCP clients show), at the API's status, the problem as its data.
    assert reply.status == 403 and "staff" in reply.body["error"]["message"]
    assert reply.body["error"]["data"]["status"] == 403
    # On an agent connection, the same tokens see the agent tools only.
    async with shop.client(token) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert "lookup_caller" not in names
        unknown = await client.call_tool("lookup_caller", {"identifier": CALLER})
    assert unknown.is_error


async def test_erasure_is_refused_without_the_opt_in(shop: Shop) -> None:
    await shop.remember(caller_name="Ada")
    async with shop.client(shop.staff, conversation=None) as client:
        refused = await client.call_tool("erase_caller", {"identifier": CALLER})
    assert refused.is_error
    assert await shop.memory() == {"caller_name": "Ada"}
    reply = await shop.list_raw(shop.staff, headers={"X-Caller-Memory-Erasure": "yes"})
    assert reply.status == 422 and "allow" in reply.body["error"]["message"]


async def test_an_erasure_asks_first_then_answers_the_receipt_and_is_audited(shop: Shop) -> None:
    await shop.remember(caller_name="Ada")
    await shop.remember(OTHER_CALLER, caller_name="Bob")
    asked: list[str] = []

    def answering(action: Literal["accept", "decline", "cancel"], erase: bool = True) -> Any:
        async def answer(context: Any, params: Any) -> ElicitResult:
            asked.append(params.message)
            return ElicitResult(action=action, content={"erase": erase} if action == "accept" else None)

        return answer

    async with shop.client(
        shop.staff, conversation=None, headers=ALLOW, elicitation_callback=answering("decline")
    ) as client:
        tool = next(t for t in (await client.list_tools()).tools if t.name == "erase_caller")
        assert annotations_of(tool).destructive_hint is True
        declined = result_of(await client.call_tool("erase_caller", {"identifier": CALLER}))
    assert declined["erased"] is False and await shop.memory() == {"caller_name": "Ada"}
    async with shop.client(
        shop.staff, conversation=None, headers=ALLOW, elicitation_callback=answering("accept", erase=False)
    ) as client:
        unticked = result_of(await client.call_tool("erase_caller", {"identifier": CALLER}))
    assert unticked["erased"] is False and await shop.memory() == {"caller_name": "Ada"}
    async with shop.client(
        shop.staff, conversation=None, headers=ALLOW, elicitation_callback=answering("accept")
    ) as client:
        asked_before = len(asked)
        bad = await client.call_tool("erase_caller", {"identifier": "12"})
        assert bad.is_error and len(asked) == asked_before  # a bad identifier is refused before asking
        receipt = result_of(await client.call_tool("erase_caller", {"identifier": CALLER}))
    assert receipt["erased"] is True and receipt["removed"]["fields"] == 1
    assert all("+1" not in question and "555" not in question for question in asked)
    assert await shop.memory() == {}
    assert await shop.memory(OTHER_CALLER) == {"caller_name": "Bob"}
    erased = [r for r in await audit(shop) if r["action"] == "caller.erased"]
    assert len(erased) == 1 and erased[0]["actor"].startswith("mcp:token:")
    assert erased[0]["receipt_id"] == receipt["receipt_id"]
