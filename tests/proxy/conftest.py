"""Fixtures of the memory proxy's tests: the service (on SQLite and Redis) with a project whose upstream is a
model on loopback, an agent token, and a started conversation of a caller with memory."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.proxy.upstream import Upstream, upstream

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
CONVERSATION = "call-1"
UPSTREAM_KEY = "sk-upstream-" + "k" * 24
SECRET_KEY = secrets.token_bytes(32)
CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "cheese"],
            "retention": "P30D",
            "default_region": "US",
        },
        "conversation": {"enabled": True},
    }
}


def proxy_settings(**overrides: Any) -> dict[str, Any]:
    return {
        "store_timeout": 5.0,
        "secret_key": SECRET_KEY,
        "webhook_allow_hosts": ("127.0.0.1",),
        **overrides,
    }


@dataclass
class Shop:
    api: Api
    up: Upstream
    agent: str
    admin: str
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    def client(self, conversation: str | None = CONVERSATION, **options: Any) -> openai.AsyncOpenAI:
        headers = {} if conversation is None else {"X-Caller-Memory-Conversation": conversation}
        made = openai.AsyncOpenAI(
            base_url=self.api.base_url + BASE + "/llm",
            api_key=self.agent,
            max_retries=0,
            default_headers=headers,
            **options,
        )
        self.clients.append(made)
        return made

    async def remember(self, **fields: Any) -> None:
        reply = await self.api.call("PATCH", f"{BASE}/callers/{CALLER}/memory", token=self.admin, json=fields)
        assert reply.status == 200, reply.body


async def open_shop(api: Api, up: Upstream, **upstream_options: Any) -> Shop:
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    agent, admin = await api.mint(PROJECT, "agent"), await api.mint(PROJECT, "admin")
    reply = await api.call(
        "PUT",
        BASE + "/llm",
        token=admin,
        json={"base_url": up.url, "api_key": UPSTREAM_KEY, **upstream_options},
    )
    assert reply.status == 201, reply.body
    reply = await api.call(
        "POST",
        f"{BASE}/conversations/{CONVERSATION}/start",
        token=agent,
        json={"caller": CALLER, "channel": "phone"},
    )
    assert reply.status == 200, reply.body
    return Shop(api, up, agent, admin)


@pytest.fixture
async def shop(store_url: str, clock: FakeClock) -> AsyncIterator[Shop]:
    async with upstream() as up, running_api(store_url, clock, **proxy_settings()) as api:
        opened = await open_shop(api, up)
        try:
            yield opened
        finally:
            await opened.close()
