"""Pipecat's own MCP client (``MCPClient`` over ``StreamableHttpParameters``) driving Caller Memory's MCP tools
(issue 34, SPEC section 17), offline: a real pipeline with the drop-in (``CallerMemory``), the real
``OpenAILLMService`` talking to the loopback FakeLLM scripted to call the tool ``remember``, and the real
service (in process, SQLite). The client connects in the order docs/mcp.md shows (``tools()`` before the
pipeline, so before the call starts). What the tool wrote is persisted by the drop-in's end (the bot hangs
up), and the caller's next call is greeted with it (from the memory the drop-in puts in the context, no
tool). Every log line (loguru and std logging) is checked for the caller's number (``every_log_line``).

Runs in its own pytest process (the Makefile runs this file separately)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from caller_memory.sdk import MemoryClient
from caller_memory.sdk.pipecat import CallerMemory
from mcp.client.session_group import StreamableHttpParameters
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.services.mcp_service import MCPClient

from tests.conftest import OPERATOR_TOKEN, Api
from tests.frameworks import conftest_pipecat
from tests.frameworks.conftest_pipecat import LIVE, Call, Paced, aggregators, make_llm
from tests.support.fake_llm import FakeLLM, text_of
from tests.support.remembering_model import NOT_KEPT, NOTED_NAME, remembering_model

# The shared fixtures (a module of this file's own, not a conftest.py: see its docstring).
every_log_line = conftest_pipecat.every_log_line
stop_calls = conftest_pipecat.stop_calls

PROJECT = "cheese-shop"
CALLER = "+14155550100"


def tool_answer(output: str) -> dict[str, Any]:
    """The tool's JSON answer in the tool message Pipecat gives the model (the MCP result's text, which Pipecat
    encodes once more as a JSON string), or {} for anything else (Pipecat passes a tool error's text on as
    the result)."""
    try:
        said = json.loads(output)
        if isinstance(said, str):
            said = json.loads(said)
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """SQLite only: these tests are about the framework, the stores have their own suites."""
    return f"sqlite:///{tmp_path}/memory.db"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    reply = await api.call(
        "PUT",
        f"/v1/projects/{PROJECT}",
        token=OPERATOR_TOKEN,
        json={
            "memory": {
                "repeat_caller": {"state_keys": ["caller_name"], "default_region": "US"},
                "conversation": {"enabled": True},
            }
        },
    )
    assert reply.status in (200, 201), reply.body
    return {role: await api.mint(PROJECT, role) for role in ("agent", "admin")}


@pytest.fixture
async def llm() -> AsyncIterator[FakeLLM]:
    async with FakeLLM(remembering_model(tool_answer)) as fake:
        yield fake


def caller_memory_mcp(url: str, token: str, memory: CallerMemory) -> MCPClient:
    """The client of docs/mcp.md, "Pipecat": Caller Memory's MCP endpoint bound to the drop-in's call, with
    only ``remember`` offered to the model (the drop-in already puts the memory in every turn)."""
    assert memory.conv is not None  # None only for a call without a caller number
    return MCPClient(
        server_params=StreamableHttpParameters(
            url=f"{url}/v1/projects/{PROJECT}/mcp",
            headers={
                "Authorization": f"Bearer {token}",
                "X-Caller-Memory-Conversation": memory.conv.conversation_id,
            },
        ),
        tools_filter=["remember"],
    )


def call_with_tools(memory: CallerMemory, llm_url: str, context: LLMContext) -> Call:
    """conftest_pipecat's call, [user aggregator, CallerMemory, LLM, Paced, assistant aggregator], on
    ``context`` (whose tools are the MCP client's)."""
    llm = make_llm(llm_url)
    pair = aggregators(context)
    pipeline = Pipeline([pair.user(), memory, llm, Paced(0.0), pair.assistant()])
    worker = PipelineWorker(
        pipeline, enable_rtvi=False, idle_timeout_secs=None, params=PipelineParams(), cancel_timeout_secs=5
    )
    call = Call(memory, llm, context, worker)
    LIVE.append(call)

    @pair.assistant().event_handler("on_assistant_turn_stopped")
    async def said(aggregator: Any, message: Any) -> None:
        if message.content:
            await call.replies.put((message.content, message.interrupted))

    return call


async def memory_fields(api: Api, admin: str) -> dict[str, Any]:
    """The caller's memory as the HTTP API reads it back."""
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/callers/{CALLER}/memory", token=admin)
    assert reply.status == 200, reply.body
    fields: dict[str, Any] = reply.body["fields"]
    return fields


async def test_the_mcp_client_remembers_through_the_service_and_the_drop_ins_end_persists_it(
    api: Api, shop: dict[str, str], llm: FakeLLM, tmp_path: Path, every_log_line: list[str]
) -> None:
    async with MemoryClient(
        api.base_url,
        token=shop["agent"],
        project=PROJECT,
        read_budget=2.0,
        outbox_path=tmp_path / "outbox.db",
    ) as client:
        memory = CallerMemory(client, conversation_id="call-mcp-1", caller=CALLER)
        mcp = caller_memory_mcp(api.base_url, shop["agent"], memory)
        try:
            # The order of docs/mcp.md: tools() connects (initialize, tools/list) before the pipeline runs,
            # so before the drop-in's first read starts the conversation; the service lists the tools all
            # the same, and finds the call at each tool call.
            listed = await mcp.tools()
            not_yet = await api.call(
                "GET", f"/v1/projects/{PROJECT}/conversations/call-mcp-1/history", token=shop["admin"]
            )
            assert not_yet.status == 404, not_yet.body  # the call has not started yet
            call = call_with_tools(memory, llm.base_url, LLMContext(tools=listed))
            await call.start()
            assert await call.greet() == "Hello! What's your name?"
            # A key the project does not keep: the service's tool error is what the model gets.
            assert await call.says("My favourite cheese is gouda.") == NOT_KEPT
            # One of its state keys: remembered by the service, for the end to persist.
            assert await call.says("Call me Ada.") == NOTED_NAME
            assert await memory_fields(api, shop["admin"]) == {}  # not before the end
            await call.bot_hangs_up()
            ended = await call.ended()
            assert ended is not None and not ended.queued and ended.persisted == ("caller_name",)
            said = [text_of(m) for m in llm.requests[-1]["messages"] if m.get("role") == "tool"]
        finally:
            # Pipecat closes it at the pipeline's teardown too; a test that failed may not get there.
            await mcp.close()

        history = await api.call(
            "GET", f"/v1/projects/{PROJECT}/conversations/call-mcp-1/history", token=shop["admin"]
        )
        # The pipeline's first read started the conversation: the greeting is turn 1.
        assert [(m["role"], m["turn_id"]) for m in history.body["contents"]] == [
            ("assistant", 1),
            ("user", 2),
            ("assistant", 2),
            ("user", 3),
            ("assistant", 3),
        ]
        # The end persisted what the model remembered, and nothing the service refused.
        assert (await memory_fields(api, shop["admin"])).keys() == {"caller_name"}
        read = await client.read_memory(CALLER)
        assert read.available and read["caller_name"] == "Ada"

        # The next call from the number is greeted by name from the memory the drop-in reads: no tool.
        second = Call.build(CallerMemory(client, conversation_id="call-mcp-2", caller=CALLER), llm.base_url)
        await second.start()
        assert await second.greet() == "Welcome back, Ada!"
        await second.bot_hangs_up()
        assert await second.ended() is not None

    # The model was offered the one tool allowed, which takes no caller: the connection names it.
    [offered] = [tool["function"] for tool in llm.requests[0]["tools"]]
    assert offered["name"] == "remember" and set(offered["parameters"]["required"]) == {"key", "value"}
    assert set(offered["parameters"]["properties"]) == {"key", "value"}
    # What the tool answered the model, in order: the service's refusal, then the name remembered.
    assert "not one of the project's state_keys" in said[0] and tool_answer(said[0]) == {}
    assert tool_answer(said[1])["remembered"] == "caller_name"
    # No number reached the model, whatever went through the tools (the log lines: every_log_line).
    assert "4155550100" not in json.dumps(llm.requests)
    assert any("Calling mcp tool 'remember'" in line for line in every_log_line)
