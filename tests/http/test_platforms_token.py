"""The ``platform`` token role (SPEC section 15): minted like other roles, it may call only its own project's
endpoints that platforms call (``/platforms/<platform>/<hook>``, ``/llm/chat/completions``); every other
documented operation refuses it (403), the admin-only connection management and memory reads included."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.tokens import platform_may_call

from tests.conftest import Api, running_api
from tests.http.test_api import assert_problem
from tests.http.test_isolation import BODIES, CALLER, concrete, operations


@pytest.fixture
async def api(store_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    async with running_api(store_url, clock, secret_key=b"k" * 32) as api:
        yield api


async def test_a_platform_token_is_refused_everywhere_else(api: Api) -> None:
    reply = await api.put_project("victim", {"state_keys": ["a"], "analytics_enabled": True})
    assert reply.status == 201, reply.body
    admin = await api.mint("victim", "admin")
    minted = await api.call("POST", "/v1/projects/victim/tokens", token=admin, json={"role": "platform"})
    assert minted.status == 201 and minted.body["role"] == "platform"
    platform = minted.body["token"]
    end = {"caller": CALLER, "state": {"a": 1}}
    agent = await api.mint("victim", "agent")
    assert (
        await api.call("POST", "/v1/projects/victim/conversations/seed/end", token=agent, json=end)
    ).status == 200
    refused = allowed = 0
    for method, path, role in await operations(api):
        if role is None:
            continue  # public: the probes, the document, the dashboard's page
        url = concrete(path, minted.body["token_id"])
        # The MCP endpoint takes a platform token on an agent connection (naming a conversation).
        headers = {"X-Caller-Memory-Conversation": "seed"} if path.endswith("/mcp") else None
        reply = await api.call(
            method.upper(), url, token=platform, json=BODIES.get((method, path)), headers=headers
        )
        if platform_may_call(url, "victim"):
            assert reply.status not in (401, 403), (method, path, reply.body)
            allowed += 1
        else:
            assert_problem(reply, 403)
            refused += 1
    assert refused >= 30
    assert (
        allowed >= 2
    )  # the memory proxy's completions and MCP (the platforms' hooks come with their adapters)
    # Nothing was read or changed: memory, tokens and the (absent) connections as they were.
    memory = await api.call("GET", f"/v1/projects/victim/callers/{CALLER}/memory", token=admin)
    assert memory.body["fields"] == {"a": 1}
    assert len((await api.call("GET", "/v1/projects/victim/tokens", token=admin)).body["tokens"]) == 3
    # Another project's platform token does not even learn that the project exists.
    assert (await api.put_project("other", {"state_keys": ["a"]})).status == 201
    stranger = await api.mint("other", "platform")
    assert_problem(await api.call("GET", f"/v1/projects/victim/callers/{CALLER}/memory", token=stranger), 404)


def test_the_path_rule() -> None:
    assert platform_may_call("/v1/projects/shop/platforms/vapi/events", "shop")
    assert platform_may_call("/v1/projects/shop/platforms/elevenlabs/initiation", "shop")
    assert platform_may_call("/v1/projects/shop/llm/chat/completions", "shop")
    # The connection itself (admin), another project's, anything else: no.
    assert not platform_may_call("/v1/projects/shop/platforms/vapi", "shop")
    assert not platform_may_call("/v1/projects/other/platforms/vapi/events", "shop")
    assert not platform_may_call("/v1/projects/shop/platforms/vapi/events/more", "shop")
    assert not platform_may_call("/v1/projects/shop/llm", "shop")
    assert not platform_may_call(f"/v1/projects/shop/callers/{CALLER}/memory", "shop")
    assert not platform_may_call("/v1/projects/shop/platforms/vapi%2Fevents", "shop")
    assert not platform_may_call("/v1/projects/shop/platforms/../callers/x", "shop")
