"""POST /v1/projects/{project}/conversations/{id}/end through a real server, on SQLite and Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import Api
from tests.http.test_api import CALLER, CONFIG, assert_problem, memory_path


def end_path(conversation_id: str, project: str = "cheese-shop") -> str:
    return f"/v1/projects/{project}/conversations/{conversation_id}/end"


def end_body(state: dict[str, Any], caller: str = CALLER, **outcome: Any) -> dict[str, Any]:
    return {"caller": caller, "state": state, "outcome": outcome, "channel": "voice"}


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("cheese-shop", CONFIG)


async def test_end_persists_state_keys_and_reports_the_rest(api: Api, shop: dict[str, str]) -> None:
    body = end_body({"booking_day": "Friday", "caller_name": "Ada", "mood": "happy"}, qa="resolved")
    reply = await api.call("POST", end_path("conv-1"), token=shop["agent"], json=body)
    assert reply.status == 200, reply.body
    assert reply.body == {
        "conversation_id": "conv-1",
        "persisted": ["booking_day", "caller_name"],
        "ignored": ["mood"],
        "blacklisted": False,
        "erased": False,
        "repeat_caller": {},
        "late": False,
        "withheld": [],
    }
    assert reply.headers["Idempotent-Replayed"] == "false"
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"booking_day": "Friday", "caller_name": "Ada"}


async def test_a_retry_applies_nothing_twice(api: Api, shop: dict[str, str]) -> None:
    body = end_body({"booking_day": "Friday"})
    first = await api.call("POST", end_path("conv-1"), token=shop["agent"], json=body)
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"booking_day": "Monday"})
    # The same caller written another way is the same request.
    retry = await api.call(
        "POST", end_path("conv-1"), token=shop["agent"], json={**body, "caller": "+1 (415) 555-0100"}
    )
    assert retry.status == 200 and retry.body == first.body
    assert retry.headers["Idempotent-Replayed"] == "true"
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"booking_day": "Monday"}


async def test_the_same_id_with_another_body_is_409(api: Api, shop: dict[str, str]) -> None:
    await api.call("POST", end_path("conv-1"), token=shop["agent"], json=end_body({"booking_day": "Friday"}))
    for body in (
        end_body({"booking_day": "Saturday"}),
        end_body({"booking_day": "Friday"}, qa="unresolved"),
        end_body({"booking_day": "Friday"}, caller="+447700900123"),
    ):
        reply = await api.call("POST", end_path("conv-1"), token=shop["agent"], json=body)
        assert_problem(reply, 409, mentions="conv-1")
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"booking_day": "Friday"}
    other = await api.call("GET", memory_path("cheese-shop", "+447700900123"), token=shop["agent"])
    assert other.body["fields"] == {}


async def test_null_deletes_and_an_empty_state_is_fine(api: Api, shop: dict[str, str]) -> None:
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"booking_day": "Friday"})
    reply = await api.call(
        "POST", end_path("conv-2"), token=shop["agent"], json=end_body({"booking_day": None})
    )
    assert reply.body["persisted"] == ["booking_day"]
    assert (await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])).body["fields"] == {}
    empty = await api.call("POST", end_path("conv-3"), token=shop["agent"], json={"caller": CALLER})
    assert empty.status == 200 and empty.body["persisted"] == [] and empty.body["ignored"] == []


async def test_blacklisted_callers_store_nothing(api: Api, shop: dict[str, str]) -> None:
    reply = await api.call(
        "POST",
        end_path("conv-1"),
        token=shop["agent"],
        json=end_body({"caller_name": "Test"}, caller="+440000000000"),
    )
    assert reply.status == 200
    assert (
        reply.body["blacklisted"] is True
        and reply.body["persisted"] == []
        and reply.body["ignored"] == ["caller_name"]
    )
    await api.put_project("cheese-shop", {**CONFIG, "identifier_blacklist": []})
    read = await api.call("GET", memory_path("cheese-shop", "+440000000000"), token=shop["agent"])
    assert read.body["fields"] == {}


async def test_callers_ending_at_the_same_moment_both_land(api: Api, shop: dict[str, str]) -> None:
    replies = await asyncio.gather(
        api.call("POST", end_path("conv-a"), token=shop["agent"], json=end_body({"caller_name": "Ada"})),
        api.call("POST", end_path("conv-b"), token=shop["agent"], json=end_body({"booking_day": "Friday"})),
    )
    assert [r.status for r in replies] == [200, 200]
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"booking_day": "Friday", "caller_name": "Ada"}


@pytest.mark.parametrize(
    ("conversation_id", "body", "field"),
    [
        ("bad id!", end_body({}), "conversation_id"),
        ("-starts-with-dash", end_body({}), "conversation_id"),
        ("conv-1", end_body({}, caller="hello"), "caller"),
        ("conv-1", {"state": {}}, "caller"),
        ("conv-1", end_body({"bad-name": 1}), "state.bad-name"),
        ("conv-1", end_body({"caller_name": "x" * 3000}), "state.caller_name"),
        ("conv-1", {**end_body({}), "colour": "blue"}, "colour"),
        ("conv-1", end_body({}, qa="x" * 200), "outcome.qa"),
        ("conv-1", end_body({}, rating=5), "outcome.rating"),
        ("conv-1", {**end_body({}), "state": ["caller_name"]}, "state"),
    ],
)
async def test_bad_requests_are_422_and_change_nothing(
    api: Api, shop: dict[str, str], conversation_id: str, body: dict[str, Any], field: str
) -> None:
    full = dict(body)  # with a valid key added: a refused request must not persist even that
    if isinstance(full.get("state"), dict):
        full["state"] = {**full["state"], "booking_day": "Friday"}
    reply = await api.call("POST", end_path(conversation_id), token=shop["agent"], json=full)
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == field, reply.body
    assert (await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])).body["fields"] == {}


async def test_roles_and_tenancy(api: Api, shop: dict[str, str]) -> None:
    body = end_body({"booking_day": "Friday"})
    assert_problem(await api.call("POST", end_path("conv-1"), token=shop["analytics"], json=body), 403)
    other = await api.project_with_tokens("bakery", {"state_keys": ["booking_day"]})
    assert_problem(await api.call("POST", end_path("conv-1"), token=other["agent"], json=body), 404)
    assert_problem(await api.call("POST", end_path("conv-1"), json=body), 401)
    assert (await api.call("POST", end_path("conv-1"), token=shop["admin"], json=body)).status == 200


#: Vanity numbers and other spellings with letters: libphonenumber would read the letters as keypad digits
#: (``+1 415 555 CALL`` as +14155552255); the README's contract refuses them.
LETTERED = [
    "+1 415 555 CALL",
    "+1-800-FLOWERS",
    "+1 415 555 01OO",
    "tel:+14155550100",
    "+1 415 555 \uff10\uff11\uff2f\uff10",
]


@pytest.mark.parametrize("identifier", LETTERED)
async def test_identifiers_with_letters_are_refused_everywhere(
    api: Api, shop: dict[str, str], identifier: str
) -> None:
    """In a path, in the body of an end, and in a blacklist entry: the same clear 422, and nothing changes."""
    from urllib.parse import quote

    path = memory_path("cheese-shop", quote(identifier, safe=""))
    for method, body in (("GET", None), ("PATCH", {"caller_name": "Ada"})):
        reply = await api.call(method, path, token=shop["admin"], json=body)
        assert_problem(reply, 422, mentions="letters")
        assert reply.body["errors"][0]["field"] == "identifier"
    erase = await api.call(
        "DELETE", f"/v1/projects/cheese-shop/callers/{quote(identifier, safe='')}", token=shop["admin"]
    )
    assert_problem(erase, 422, mentions="letters")
    ended = await api.call(
        "POST",
        end_path("conv-1"),
        token=shop["agent"],
        json=end_body({"booking_day": "Friday"}, caller=identifier),
    )
    assert_problem(ended, 422, mentions="letters")
    assert ended.body["errors"][0]["field"] == "caller"
    configured = await api.put_project(
        "cheese-shop", {**CONFIG, "identifier_blacklist": ["+440000000000", identifier]}
    )
    assert_problem(configured, 422, mentions="letters")
    assert configured.body["errors"][0]["field"] == "memory.repeat_caller.identifier_blacklist[1]"
    # Nothing changed: not the number the letters spell, not the blacklist.
    spelled = await api.call("GET", memory_path("cheese-shop", "+14155552255"), token=shop["agent"])
    assert spelled.body["fields"] == {}
    stored = await api.call("GET", "/v1/projects/cheese-shop", token=shop["admin"])
    assert len(stored.body["memory"]["repeat_caller"]["identifier_blacklist"]) == 2  # CONFIG's two entries
    # The digits of the same number are a caller as usual.
    fine = await api.call(
        "POST", end_path("conv-2"), token=shop["agent"], json=end_body({}, caller="+1 415 555 2255")
    )
    assert fine.status == 200, fine.body
