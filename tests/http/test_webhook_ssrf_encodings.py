"""Issue 27, item 12: registration through the real server refuses every IPv6 spelling of an IPv4 address and
the special-purpose ranges Python's tables miss (422 naming why, nothing registered), on every backend; a
public address is still taken."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import assert_problem
from tests.http.test_webhooks import BASE, CONVERSATION, PROJECT, REPEAT_CALLER, webhook_settings


@pytest.fixture
async def admin(store_url: str, clock: FakeClock) -> AsyncIterator[tuple[Api, str]]:
    async with running_api(store_url, clock, **webhook_settings()) as api:
        document = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": CONVERSATION}}
        reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
        assert reply.status in (200, 201), reply.body
        yield api, await api.mint(PROJECT, "admin")


REFUSED = [
    ("::a9fe:a9fe", "IPv4-compatible"),
    ("::127.0.0.1", "IPv4-compatible"),
    ("::ffff:0:a9fe:a9fe", "IPv4-translated"),
    ("64:ff9b::a9fe:a9fe", "NAT64"),
    ("2002:a9fe:a9fe::1", "6to4"),
    ("2001:0:4136:e378:8000:63bf:5601:5601", "Teredo"),
    ("2606:4700::200:5efe:a9fe:a9fe", "ISATAP"),
    ("3fff::1", "special-purpose"),
    ("5f00::1", "special-purpose"),
    ("2620:4f:8000::1", "special-purpose"),
    ("192.0.0.9", "special-purpose"),
    ("192.31.196.1", "special-purpose"),
    ("192.52.193.1", "special-purpose"),
    ("192.175.48.1", "special-purpose"),
]


@pytest.mark.parametrize(("address", "why"), REFUSED)
async def test_registration_refuses_each_encoding(admin: tuple[Api, str], address: str, why: str) -> None:
    api, token = admin
    host = f"[{address}]" if ":" in address else address
    document = {"url": f"https://{host}/hook", "events": ["conversation.ended"]}
    reply = await api.call("POST", f"{BASE}/webhooks", token=token, json=document)
    assert_problem(reply, 422, mentions=why)
    assert (await api.call("GET", f"{BASE}/webhooks", token=token)).body["webhooks"] == []


@pytest.mark.parametrize("address", ["[2606:4700:4700::1111]", "1.1.1.1", "93.184.215.14"])
async def test_registration_takes_a_public_address(admin: tuple[Api, str], address: str) -> None:
    api, token = admin
    document = {"url": f"https://{address}/hook", "events": ["conversation.ended"]}
    reply = await api.call("POST", f"{BASE}/webhooks", token=token, json=document)
    assert reply.status == 201, reply.body
