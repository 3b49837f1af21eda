"""LiveKit's own MCP client (``MCPToolset`` over ``MCPServerHTTP``) driving Caller Memory's MCP tools (issue 34,
SPEC section 17), offline: an AgentSession in text mode with the drop-in (``remember_caller``,
``MemoryAgent``), the real service (in process, on a real port) and the loopback FakeLLM scripted to call the
tool ``remember``, in the order docs/mcp.md shows (``remember_caller``, then ``session.start`` with the
toolset, which LiveKit connects as the agent starts). What the toolset wrote is persisted by the drop-in's
end, and the caller's next call is greeted with it (read from the prefetched memory, no tool).

At the top of LiveKit's range only: LiveKit's MCP integration is built on mcp 2 from livekit-agents 1.8 on
(1.7's needs mcp<2, which neither the service nor the SDK's ``mcp`` extra can live with).

Runs in its own pytest process (the Makefile runs this file separately)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# At the top of LiveKit's range only (scripts/frameworks-low leaves this file out): 1.7's MCP client is built
# on mcp<2, which cannot share an environment with the service.
from caller_memory.sdk.livekit import CallMemory, MemoryAgent, remember_caller
from livekit.agents import RunResult
from livekit.agents.llm.mcp import MCPServerHTTP, MCPToolset

from tests.conftest import Api

# The fixtures (fake_llm, sessions, tokens, store_url, lines) come with the star import.
from tests.frameworks.conftest_livekit import *  # noqa: F403
from tests.frameworks.conftest_livekit import INSTRUCTIONS, NUMBER, PROJECT, Lines, Sessions, make_client
from tests.support.fake_llm import FakeLLM
from tests.support.remembering_model import NOT_KEPT, NOTED_NAME, remembering_model


def tool_answer(output: str) -> dict[str, Any]:
    """The tool's JSON answer in the tool message LiveKit gives the model (the MCP text content, as LiveKit
    serialises it), or {} for anything else (a tool error's text)."""
    try:
        said = json.loads(output)
        if isinstance(said, dict) and said.get("type") == "text":
            said = json.loads(said["text"])
    except (ValueError, KeyError, TypeError):
        return {}
    return said if isinstance(said, dict) else {}


def caller_memory_tools(url: str, token: str, call: CallMemory) -> MCPToolset:
    """The toolset of docs/mcp.md, "LiveKit Agents": Caller Memory's MCP endpoint bound to the drop-in's call,
    with only ``remember`` offered to the model (the drop-in already puts the memory in every turn)."""
    assert call.conversation is not None  # None only for a call without a caller number
    return MCPToolset(
        id="caller_memory",
        mcp_server=MCPServerHTTP(
            url=f"{url}/v1/projects/{PROJECT}/mcp",
            transport_type="streamable_http",
            headers={
                "Authorization": f"Bearer {token}",
                "X-Caller-Memory-Conversation": call.conversation.conversation_id,
            },
            allowed_tools=["remember"],
        ),
    )


def last_text(session: Any) -> str:
    assistant = [i for i in session.history.items if i.type == "message" and i.role == "assistant"]
    text: str = assistant[-1].text_content
    return text


async def memory_fields(api: Api, admin: str) -> dict[str, Any]:
    """The caller's memory as the HTTP API reads it back."""
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/callers/{NUMBER}/memory", token=admin)
    assert reply.status == 200, reply.body
    fields: dict[str, Any] = reply.body["fields"]
    return fields


async def test_the_mcp_toolset_remembers_through_the_service_and_the_drop_ins_end_persists_it(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path, lines: Lines
) -> None:
    fake_llm.reply = remembering_model(tool_answer)
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_mcp1")
        # The order of docs/mcp.md: LiveKit connects the toolset (initialize, tools/list) as the agent starts,
        # alongside the drop-in's first read that starts the conversation, in either order (the service lists
        # the tools of a call not started yet, and finds the call again at each tool call).
        tools = caller_memory_tools(api.base_url, tokens["agent"], call)
        await session.start(MemoryAgent(instructions=INSTRUCTIONS, tools=[tools]))
        assert [tool.id for tool in tools.tools] == ["remember"]  # connected: LiveKit drops a failed toolset

        # A key the project does not keep: the service answers a tool error, which LiveKit hands the model.
        run: RunResult[None] = await session.run(user_input="my favourite cheese is gouda")
        run.expect.next_event().is_function_call(
            name="remember", arguments={"key": "favourite_cheese", "value": "gouda"}
        )
        refused = run.expect.next_event().is_function_call_output(is_error=True).event().item.output
        assert "not one of the project's state_keys" in refused
        run.expect.next_event().is_message(role="assistant")
        assert last_text(session) == NOT_KEPT

        # One of its state keys: remembered by the service, for the end to persist.
        run = await session.run(user_input="call me Ada")
        run.expect.next_event().is_function_call(
            name="remember", arguments={"key": "caller_name", "value": "Ada"}
        )
        run.expect.next_event().is_function_call_output(is_error=False)
        run.expect.next_event().is_message(role="assistant")
        assert last_text(session) == NOTED_NAME
        assert await memory_fields(api, tokens["admin"]) == {}  # not before the end

        await session.aclose()  # the caller hangs up: the drop-in ends the call
        ended = await call.wait_ended()
        assert ended is not None and not ended.queued and ended.persisted == ("caller_name",)

        # The first turn's read started the conversation: the transcript starts at turn 1.
        history = await api.call(
            "GET", f"/v1/projects/{PROJECT}/conversations/SCL_mcp1/history", token=tokens["admin"]
        )
        assert [(m["role"], m["turn_id"]) for m in history.body["contents"]] == [
            ("user", 1),
            ("assistant", 1),
            ("user", 2),
            ("assistant", 2),
        ]

        # The end persisted what the model remembered, and nothing the service refused.
        assert (await memory_fields(api, tokens["admin"])).keys() == {"caller_name"}
        read = await client.read_memory(NUMBER)
        assert read.available and read["caller_name"] == "Ada"

        # The next call from the number is greeted by name from the memory the drop-in prefetches: no tool.
        session = sessions.new()
        call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_mcp2")
        await session.start(MemoryAgent(instructions=INSTRUCTIONS))
        await session.generate_reply()
        assert last_text(session) == "Welcome back, Ada!"
        await session.aclose()
        assert await call.wait_ended() is not None

    # The model was offered the one tool allowed, which takes no caller: the connection names it.
    [offered] = [tool["function"] for tool in fake_llm.requests[0]["tools"]]
    assert offered["name"] == "remember" and set(offered["parameters"]["required"]) == {"key", "value"}
    assert set(offered["parameters"]["properties"]) == {"key", "value"}
    # No number reached the model, whatever went through the tools (the log lines: the lines fixture).
    assert "4155550100" not in json.dumps(fake_llm.requests)
