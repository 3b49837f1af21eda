"""Issue 27, item 13: two spellings of one mailbox (a trailing dot, the case, an internationalised domain as
punycode or Unicode) are one caller through the HTTP API on every backend: memory written through one reads
through the other, a blacklist entry in one spelling blocks the other, and an erasure through one erases the
other (and drops an end delivered after it)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest

from tests.conftest import Api

BASE = "/v1/projects/shop"
CONFIG: dict[str, Any] = {
    "state_keys": ["caller_name", "language"],
    "identity_linking": True,
    "identifier_blacklist": ["email:blocked@example.com.", "email:someone@xn--bcher-kva.example"],
}

#: (one spelling, another spelling of the same mailbox)
PAIRS = [
    ("email:ada@example.com.", "email:ada@example.com"),
    ("email:Ada@Example.COM", "email:ada@example.com."),
    ("email:ada@xn--bcher-kva.example", "email:ADA@B\u00dcCHER.example."),
    ("email:ada@example\u3002com", "email:ada@example.com"),
]


def memory(identifier: str) -> str:
    return f"{BASE}/callers/{quote(identifier, safe=':@')}/memory"


async def end(api: Api, token: str, conversation_id: str, caller: str, state: dict[str, Any]) -> Any:
    body = {"caller": caller, "state": state, "ended_at": "2030-01-01T00:00:00Z"}
    reply = await api.call("POST", f"{BASE}/conversations/{conversation_id}/end", token=token, json=body)
    assert reply.status == 200, reply.body
    return reply.body


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("shop", CONFIG)


@pytest.mark.parametrize(("one", "other"), PAIRS)
async def test_memory_written_through_one_spelling_reads_through_the_other(
    api: Api, shop: dict[str, str], one: str, other: str
) -> None:
    await end(api, shop["agent"], "c1", one, {"caller_name": "Ada"})
    read = await api.call("GET", memory(other), token=shop["agent"])
    assert read.status == 200, read.body
    assert read.body["fields"] == {"caller_name": "Ada"}


@pytest.mark.parametrize(
    "written",
    ["email:blocked@example.com", "email:BLOCKED@example.com.", "email:someone@B\u00fccher.example."],
)
async def test_a_blacklist_entry_in_one_spelling_blocks_the_others(
    api: Api, shop: dict[str, str], written: str
) -> None:
    ended = await end(api, shop["agent"], "c1", written, {"caller_name": "Tester"})
    assert ended["blacklisted"] is True and ended["persisted"] == []
    read = await api.call("GET", memory(written), token=shop["agent"])
    assert read.body["blacklisted"] is True and read.body["fields"] == {}


@pytest.mark.parametrize(("one", "other"), PAIRS)
async def test_an_erasure_through_one_spelling_erases_the_other(
    api: Api, shop: dict[str, str], one: str, other: str
) -> None:
    await end(api, shop["agent"], "c1", other, {"caller_name": "Ada", "language": "fr"})
    receipt = await api.call("DELETE", f"{BASE}/callers/{quote(one, safe=':@')}", token=shop["admin"])
    assert receipt.status == 200, receipt.body
    assert receipt.body["removed"]["fields"] == 2
    for written in (one, other):
        read = await api.call("GET", memory(written), token=shop["agent"])
        assert read.body["fields"] == {}, written
    # An end made before the erasure and delivered after it, in the other spelling, is dropped.
    late = {"caller": other, "state": {"caller_name": "Ada"}, "ended_at": "2000-01-01T00:00:00Z"}
    reply = await api.call("POST", f"{BASE}/conversations/late/end", token=shop["agent"], json=late)
    assert reply.status == 200 and reply.body["erased"] is True, reply.body
