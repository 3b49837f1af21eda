"""The transport: stateless, so a session's requests may land on any process (an erasure's confirmation
included: its sealed state opens on every process of a deployment); the ASGI bridge streams a body as it
comes, keeping the event loop free while a client sends it slowly; a handshake-era client is told plainly
that the erasure needs a newer one."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import orjson
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import ElicitResult

from tests.conftest import OPERATOR_TOKEN
from tests.mcp.conftest import BASE, CALLER, CONFIG, CONVERSATION, PROJECT, Shop
from tests.mcp.test_agent_tools import result_of, text_of
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, http


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next of ``ports`` in turn (two replicas behind a round-robin balancer)."""

    def __init__(self, ports: list[int]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.ports = itertools.cycle(ports)
        self.sent: list[int] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = next(self.ports)
        self.sent.append(port)
        request.url = request.url.copy_with(port=port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
def replicas(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with redis_server.client() as client:
        client.flushall()
    with (
        ServiceProcess(redis_server.url, tmp_path) as one,
        ServiceProcess(redis_server.url, tmp_path) as two,
    ):
        yield one, two


def mint(url: str, role: str) -> str:
    token: str = http("POST", f"{url}{BASE}/tokens", OPERATOR_TOKEN, {"role": role})["token"]
    return token


async def test_a_sessions_requests_on_two_processes_remember_and_erase(
    replicas: tuple[ServiceProcess, ServiceProcess],
) -> None:
    one, two = replicas
    http("PUT", one.url + BASE, OPERATOR_TOKEN, CONFIG)
    agent, staff = mint(one.url, "agent"), mint(two.url, "staff")
    http(
        "POST",
        f"{one.url}{BASE}/conversations/{CONVERSATION}/start",
        agent,
        {"caller": CALLER, "channel": "phone"},
    )
    balancer = Alternating([one.port, two.port])
    headers = {"Authorization": f"Bearer {agent}", "X-Caller-Memory-Conversation": CONVERSATION}
    async with (
        httpx2.AsyncClient(headers=headers, transport=balancer, timeout=10) as client_http,
        Client(streamable_http_client(one.url + BASE + "/mcp", http_client=client_http)) as client,
    ):
        for value in ("brie", "gouda", "stilton"):
            result_of(await client.call_tool("remember", {"key": "cheese", "value": value}))
        result_of(await client.call_tool("remember", {"key": "caller_name", "value": "Ada"}))
    assert {one.port, two.port} <= set(balancer.sent)
    http("POST", f"{two.url}{BASE}/conversations/{CONVERSATION}/end", agent, {"caller": CALLER, "state": {}})
    memory = http("GET", f"{one.url}{BASE}/callers/{CALLER}/memory", agent)["fields"]
    assert memory == {"caller_name": "Ada", "cheese": "stilton"}

    async def confirm(context: Any, params: Any) -> ElicitResult:
        return ElicitResult(action="accept", content={"erase": True})

    balancer = Alternating([one.port, two.port])
    headers = {"Authorization": f"Bearer {staff}", "X-Caller-Memory-Erasure": "allow"}
    async with (
        httpx2.AsyncClient(headers=headers, transport=balancer, timeout=10) as client_http,
        Client(
            streamable_http_client(one.url + BASE + "/mcp", http_client=client_http),
            elicitation_callback=confirm,
        ) as client,
    ):
        sent_before = len(balancer.sent)
        receipt = result_of(await client.call_tool("erase_caller", {"identifier": CALLER}))
        # The question and the confirmed call: two requests, on the two processes.
        assert set(balancer.sent[sent_before:]) == {one.port, two.port}
    assert receipt["erased"] is True
    assert http("GET", f"{two.url}{BASE}/callers/{CALLER}/memory", agent)["fields"] == {}


async def test_the_loop_serves_others_while_a_client_sends_its_body_slowly(shop: Shop) -> None:
    host, port = shop.api.base_url.removeprefix("http://").split(":")
    body = orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    head = (
        f"POST {BASE}/mcp HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {shop.agent}\r\n"
        f"X-Caller-Memory-Conversation: {CONVERSATION}\r\nContent-Type: application/json\r\n"
        f"Accept: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def slow_client() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head)
        for i in range(0, len(body), 4):  # the body a few bytes at a time, over about a second
            writer.write(body[i : i + 4])
            await writer.drain()
            await asyncio.sleep(1.0 / (len(body) / 4))
        answer = await reader.read()
        writer.close()
        return answer

    ticking = asyncio.create_task(ticker())
    slow = asyncio.create_task(slow_client())
    await asyncio.sleep(0.2)
    assert not slow.done()
    started = time.monotonic()
    async with shop.client() as client:  # another client meanwhile: answered at once
        result_of(await client.call_tool("get_caller_memory", {}))
    assert time.monotonic() - started < 2.0 and not slow.done()
    answer = await asyncio.wait_for(slow, 10)
    done.set()
    await ticking
    assert answer.startswith(b"HTTP/1.1 200") and b'"get_caller_memory"' in answer
    assert max(gaps) < 0.25, max(gaps)


async def test_a_handshake_era_client_is_told_the_erasure_needs_a_newer_one(shop: Shop) -> None:
    await shop.remember(caller_name="Ada")

    async def confirm(context: Any, params: Any) -> ElicitResult:
        return ElicitResult(action="accept", content={"erase": True})

    async with shop.client(
        shop.staff,
        conversation=None,
        headers={"X-Caller-Memory-Erasure": "allow"},
        mode="legacy",
        elicitation_callback=confirm,
    ) as client:
        refused = await client.call_tool("erase_caller", {"identifier": CALLER})
        found = result_of(await client.call_tool("lookup_caller", {"identifier": CALLER}))
    assert refused.is_error and "2026-07-28" in text_of(refused)
    assert found["fields"] == {"caller_name": "Ada"}
    assert PROJECT in shop.url
