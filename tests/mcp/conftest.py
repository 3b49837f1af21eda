"""Fixtures of the MCP tests: the service (on SQLite and Redis) with a project, its tokens, a started
conversation of a caller with memory, and the official ``mcp`` client over Streamable HTTP."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from caller_memory.service.domain.clock import FakeClock
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import OPERATOR_TOKEN, Api, Reply, running_api

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
OTHER_CALLER = "+14155550199"
CONVERSATION = "call-1"
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "cheese", "booking"],
            "retention": "P30D",
            "default_region": "US",
        },
        "conversation": {"enabled": True},
    }
}


@dataclass
class Shop:
    api: Api
    agent: str
    admin: str
    staff: str
    platform: str

    @property
    def url(self) -> str:
        return self.api.base_url + BASE + "/mcp"

    async def remember(self, caller: str = CALLER, **fields: Any) -> None:
        reply = await self.api.call("PATCH", f"{BASE}/callers/{caller}/memory", token=self.admin, json=fields)
        assert reply.status == 200, reply.body

    async def memory(self, caller: str = CALLER) -> dict[str, Any]:
        reply = await self.api.call("GET", f"{BASE}/callers/{caller}/memory", token=self.admin)
        assert reply.status == 200, reply.body
        fields: dict[str, Any] = reply.body["fields"]
        return fields

    async def start(self, conversation: str, caller: str = CALLER, **extra: Any) -> None:
        reply = await self.api.call(
            "POST",
            f"{BASE}/conversations/{conversation}/start",
            token=self.agent,
            json={"caller": caller, "channel": "phone", **extra},
        )
        assert reply.status == 200, reply.body

    async def list_raw(
        self,
        token: str,
        *,
        project: str = PROJECT,
        conversation: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One ``tools/list`` POSTed as plain JSON-RPC (no MCP client): for what the endpoint answers before
        any tool runs (refusals). ``headers``: more request headers."""
        sent = {"Content-Type": "application/json", "Accept": "application/json"}
        if conversation is not None:
            sent["X-Caller-Memory-Conversation"] = conversation
        sent |= headers or {}
        return await self.api.call(
            "POST",
            f"/v1/projects/{project}/mcp",
            token=token,
            data=b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}',
            headers=sent,
        )

    @asynccontextmanager
    async def client(
        self,
        token: str | None = None,
        conversation: str | None = CONVERSATION,
        *,
        url: str | None = None,
        **options: Any,
    ) -> AsyncIterator[Client]:
        headers = {"Authorization": f"Bearer {token or self.agent}"}
        if conversation is not None:
            headers["X-Caller-Memory-Conversation"] = conversation
        headers |= options.pop("headers", {})
        async with (
            httpx2.AsyncClient(headers=headers, timeout=10) as http,
            Client(streamable_http_client(url or self.url, http_client=http), **options) as client,
        ):
            yield client


async def open_shop(api: Api) -> Shop:
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    shop = Shop(
        api,
        agent=await api.mint(PROJECT, "agent"),
        admin=await api.mint(PROJECT, "admin"),
        staff=await api.mint(PROJECT, "staff"),
        platform=await api.mint(PROJECT, "platform"),
    )
    await shop.start(CONVERSATION)
    return shop


@pytest.fixture(autouse=True)
def quiet_client() -> Iterator[None]:
    """The official client logs every message it sends at DEBUG, a staff lookup's identifier and what a test
    smuggles into arguments included: that is the test's own process as a client, not the service, whose
    every log line the suite's check still sees."""
    client = logging.getLogger("mcp.client")
    level = client.level
    client.setLevel(logging.INFO)
    yield
    client.setLevel(level)


@pytest.fixture
async def shop(store_url: str, clock: FakeClock) -> AsyncIterator[Shop]:
    async with running_api(store_url, clock, store_timeout=5.0) as api:
        yield await open_shop(api)
