"""``caller-memory mcp``: the stdio relay as a real process, driven by the official MCP client, in front of the
service as a real process (SPEC section 17).

What the relay must show: the tools of an agent connection listed and called through it, in both protocol
eras (the ``initialize`` handshake, and 2026's per-request envelope whose HTTP headers the relay derives from
each message); no token, before anything starts; the service down, then back, each request answering an
error that names it unreachable while the process serves on; a refused token, answered as such. Nothing it
logs holds the token, the conversation id or the caller's number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import anyio
import pytest
from caller_memory.service.mcp.stdio import SERVICE_UNREACHABLE, TOKEN_REFUSED
from mcp import Client, MCPError, StdioServerParameters, stdio_client, types
from mcp.client._transport import ReadStream, WriteStream
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCError, JSONRPCRequest, JSONRPCResponse

from tests.conftest import OPERATOR_TOKEN
from tests.support.service_process import ServiceProcess, http

PROJECT = "cheese-shop"
CALLER = "+14155550100"
DIGITS = "4155550100"
#: The caller the staff connection erases (the other tests read CALLER's memory).
ERASED = "+14155550123"
#: A conversation id distinctive enough to be searched for in the relay's output.
CONVERSATION = "stdio-call-7f3a"
CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name", "cheese"], "default_region": "US"},
        "conversation": {"enabled": True},
    }
}
INITIALIZE = {
    "protocolVersion": "2025-11-25",
    "capabilities": {},
    "clientInfo": {"name": "test_stdio", "version": "1"},
}


@dataclass(frozen=True)
class Service:
    url: str
    agent: str
    analytics: str
    staff: str


def set_up(url: str) -> str:
    """A project, a caller it remembers and that caller's conversation started; an agent token of it."""
    base = f"{url}/v1/projects/{PROJECT}"
    http("PUT", base, OPERATOR_TOKEN, CONFIG)
    agent: str = http("POST", f"{base}/tokens", OPERATOR_TOKEN, {"role": "agent"})["token"]
    http("PATCH", f"{base}/callers/{CALLER}/memory", OPERATOR_TOKEN, {"caller_name": "Ada"})
    http("POST", f"{base}/conversations/{CONVERSATION}/start", agent, {"caller": CALLER, "channel": "phone"})
    return agent


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    workdir = tmp_path_factory.mktemp("service")
    with ServiceProcess(f"sqlite:///{workdir}/store.db", workdir) as process:
        agent = set_up(process.url)
        tokens = f"{process.url}/v1/projects/{PROJECT}/tokens"
        analytics = http("POST", tokens, OPERATOR_TOKEN, {"role": "analytics"})["token"]
        staff = http("POST", tokens, OPERATOR_TOKEN, {"role": "staff"})["token"]
        yield Service(process.url, agent, analytics, staff)


def relay_command(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "caller_memory.service", "mcp", "--url", url, "--project", PROJECT, *args]


def parameters(url: str, token: str | None, *args: str) -> StdioServerParameters:
    command = relay_command(url, *args)
    # The client gives the process a bare environment (PATH, HOME, ...): the token is all it adds here.
    env = {"CALLER_MEMORY_TOKEN": token} if token is not None else {}
    return StdioServerParameters(command=command[0], args=command[1:], env=env)


@asynccontextmanager
async def relay_streams(
    params: StdioServerParameters, errlog: TextIO
) -> AsyncIterator[tuple[ReadStream[SessionMessage | Exception], WriteStream[SessionMessage]]]:
    async with stdio_client(params, errlog=errlog) as (read, write):
        yield read, write


def assert_nothing_secret(text: str, *secrets: str) -> None:
    for secret in (*secrets, DIGITS, ERASED[2:], CONVERSATION):
        assert secret not in text


def mcp_errors(group: BaseExceptionGroup[MCPError]) -> list[MCPError]:
    errors: list[MCPError] = []
    for error in group.exceptions:
        errors.extend(mcp_errors(error) if isinstance(error, BaseExceptionGroup) else [error])
    return errors


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_an_agent_connection_lists_and_calls_the_tools(
    service: Service, tmp_path: Path, mode: str
) -> None:
    # "legacy" is the initialize handshake (the MCP-Protocol-Version header after it); "auto" probes
    # server/discover first and, if the service speaks 2026-07-28, sends each request with its own
    # envelope, the relay adding the headers that mirror it (MCP-Protocol-Version, Mcp-Method, Mcp-Name).
    errlog = tmp_path / "relay.log"
    with errlog.open("w") as log:
        transport = stdio_client(
            parameters(service.url, service.agent, "--conversation", CONVERSATION), errlog=log
        )
        async with Client(transport, mode=mode) as client:
            listed = await client.list_tools()
            names = {tool.name for tool in listed.tools}
            assert {"get_caller_memory", "remember", "get_context", "get_history"} <= names, names
            # An agent connection has no staff tools.
            assert not names & {"lookup_caller", "list_conversations", "read_transcript", "erase_caller"}
            result = await client.call_tool("get_caller_memory", {})
    assert not result.is_error, result
    answer = json.dumps(result.model_dump(mode="json"))
    assert (
        result.structured_content is not None and result.structured_content["fields"]["caller_name"] == "Ada"
    )
    assert DIGITS not in answer
    output = errlog.read_text()
    assert "relayed to" in output, output
    assert_nothing_secret(output, service.agent)


async def test_an_erasure_asks_its_confirmation_through_the_relay(service: Service, tmp_path: Path) -> None:
    # The confirmation is an elicitation inside the tool call (2026-07-28: an input-required result, and the
    # call again with the answer): two ordinary requests for the relay, passed as they came.
    http(
        "PATCH",
        f"{service.url}/v1/projects/{PROJECT}/callers/{ERASED}/memory",
        OPERATOR_TOKEN,
        {"cheese": "brie"},
    )
    asked: list[str] = []

    async def confirm(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"erase": True})

    errlog = tmp_path / "relay.log"
    with errlog.open("w") as log:
        transport = stdio_client(parameters(service.url, service.staff, "--allow-erasure"), errlog=log)
        async with Client(transport, elicitation_callback=confirm) as client:
            erased = await client.call_tool("erase_caller", {"identifier": ERASED})
            after = await client.call_tool("lookup_caller", {"identifier": ERASED})
    assert len(asked) == 1 and "cannot be undone" in asked[0]
    assert not erased.is_error and erased.structured_content is not None, erased
    assert erased.structured_content["erased"] is True and erased.structured_content["removed"]["fields"] == 1
    assert after.structured_content is not None and after.structured_content["fields"] == {}
    assert_nothing_secret(errlog.read_text(), service.staff)


@pytest.mark.parametrize(
    ("env", "args", "says"),
    [
        ({}, (), "CALLER_MEMORY_TOKEN"),
        ({"CALLER_MEMORY_TOKEN": "  "}, (), "CALLER_MEMORY_TOKEN"),
        ({"CALLER_MEMORY_TOKEN": "cm_0123456789ab_secret"}, ("--url", "http://me:pw@127.0.0.1"), "--url"),
    ],
)
def test_what_cannot_work_stops_before_anything_starts(
    env: dict[str, str], args: tuple[str, ...], says: str
) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "CALLER_MEMORY_TOKEN"} | env
    command = relay_command("http://127.0.0.1:9", "--conversation", CONVERSATION) + list(args)
    request = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INITIALIZE}
    done = subprocess.run(
        command, input=json.dumps(request) + "\n", capture_output=True, text=True, env=environment, timeout=30
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # not a word on the protocol's stream
    assert says in done.stderr and done.stderr.startswith("error: ")
    assert_nothing_secret(done.stderr, "secret", "pw")


async def test_with_the_service_down_each_request_answers_an_error_and_the_relay_serves_on(
    tmp_path: Path,
) -> None:
    # The service mints the token and starts the call, then stops; it comes back on the same port and store.
    process = ServiceProcess(f"sqlite:///{tmp_path}/store.db", tmp_path)
    with process:
        token = set_up(process.url)
    url = process.url
    errlog = tmp_path / "relay.log"

    async def ask(
        streams: tuple[ReadStream[SessionMessage | Exception], WriteStream[SessionMessage]],
        request_id: int,
        method: str,
        params: dict[str, Any] | None = None,
    ) -> JSONRPCResponse | JSONRPCError:
        read, write = streams
        request = JSONRPCRequest(jsonrpc="2.0", id=request_id, method=method, params=params)
        await write.send(SessionMessage(request))
        with anyio.fail_after(20):
            answer = await read.receive()
        assert isinstance(answer, SessionMessage), answer
        assert isinstance(answer.message, JSONRPCResponse | JSONRPCError) and answer.message.id == request_id
        return answer.message

    with errlog.open("w") as log:
        async with relay_streams(parameters(url, token, "--conversation", CONVERSATION), log) as streams:
            for request_id, method in enumerate(["initialize", "tools/list", "ping"], start=1):
                down = await ask(streams, request_id, method, INITIALIZE if method == "initialize" else None)
                assert isinstance(down, JSONRPCError), down
                assert down.error.code == SERVICE_UNREACHABLE
                assert f"Caller Memory service unreachable at {url}" in down.error.message
                assert_nothing_secret(down.error.message, token)
            # The same relay process, once the service is back.
            with process:
                up = await ask(streams, 4, "initialize", INITIALIZE)
                listed = await ask(streams, 5, "tools/list")
    assert isinstance(up, JSONRPCResponse), up
    assert up.result["protocolVersion"] == INITIALIZE["protocolVersion"]
    assert isinstance(listed, JSONRPCResponse), listed
    assert "get_caller_memory" in {tool["name"] for tool in listed.result["tools"]}
    output = errlog.read_text()
    assert output.count("is unreachable") == 1, output  # once when it went, not once per request
    assert "answers again" in output
    assert_nothing_secret(output, token)


async def test_a_token_the_service_refuses_answers_an_error_saying_so(
    service: Service, tmp_path: Path
) -> None:
    token = "cm_0123456789ab_" + "x" * 32  # shaped like a token; no such token
    errlog = tmp_path / "relay.log"
    errors: list[MCPError] = []
    with errlog.open("w") as log:
        try:
            async with Client(
                stdio_client(parameters(service.url, token, "--conversation", CONVERSATION), log)
            ):
                pytest.fail("the connection was accepted")
        except* MCPError as group:
            errors = mcp_errors(group)
    assert errors and all(e.code == TOKEN_REFUSED for e in errors), errors
    assert all("refused the token (HTTP 401)" in e.error.message for e in errors), errors
    assert all("CALLER_MEMORY_TOKEN" in e.error.message for e in errors)
    assert_nothing_secret(" ".join(e.error.message for e in errors), token)
    output = errlog.read_text()
    assert "refused the token" in output
    assert_nothing_secret(output, token)


async def test_a_token_without_the_role_of_the_connection_is_refused_for_it(
    service: Service, tmp_path: Path
) -> None:
    # An analytics token is a token of the project, but an agent connection needs an agent or platform one.
    errors: list[MCPError] = []
    with (tmp_path / "relay.log").open("w") as log:
        try:
            async with Client(
                stdio_client(parameters(service.url, service.analytics, "--conversation", CONVERSATION), log),
                mode="legacy",
            ):
                pytest.fail("the connection was accepted")
        except* MCPError as group:
            errors = mcp_errors(group)
    assert [e.code for e in errors] == [TOKEN_REFUSED], errors
    assert "refused the token for this connection (HTTP 403)" in errors[0].error.message
    assert_nothing_secret(errors[0].error.message, service.analytics)
