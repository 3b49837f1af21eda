"""Linked identifiers through the HTTP API: link, read and end through any identifier, merge, limits, unlink,
erasure through each kind, who may link, and bad input."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import OPERATOR_TOKEN, Api
from tests.http.test_api import assert_problem

PHONE = "+14155550100"
EMAIL = "email:ada@example.com"
ACCOUNT = "account:A-1234"
BASE = "/v1/projects/shop"
CONFIG: dict[str, Any] = {
    "state_keys": ["caller_name", "booking_day", "language", "n"],
    "analytics_enabled": True,
    "identity_linking": True,
    "identifier_blacklist": ["email:test@example.com"],
}


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("shop", CONFIG)


def memory(identifier: str) -> str:
    return f"{BASE}/callers/{identifier}/memory"


def links(identifier: str) -> str:
    return f"{BASE}/callers/{identifier}/links"


async def end(api: Api, token: str, conversation_id: str, caller: str, state: dict[str, Any]) -> Any:
    body = {"caller": caller, "state": state, "outcome": {"qa": "resolved"}}
    reply = await api.call("POST", f"{BASE}/conversations/{conversation_id}/end", token=token, json=body)
    assert reply.status == 200, reply.body
    return reply.body


async def test_an_identifier_linked_to_a_caller_reaches_the_same_memory(
    api: Api, shop: dict[str, str]
) -> None:
    await end(api, shop["agent"], "c1", PHONE, {"caller_name": "Ada"})
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": EMAIL})
    assert reply.status == 201, reply.body
    link = reply.body["link"]
    assert link["kind"] == "email" and link["link_id"].startswith("lnk_") and link["merging"] is False
    assert link["linked_at"].endswith(":00:00Z") and reply.body["created"] is True
    # Any form of the email (case, spaces, the prefix's case) is the same identifier.
    for form in (EMAIL, "EMAIL:Ada@Example.COM", "email:%20ada@example.com%20", "email:ada%40example.com"):
        read = await api.call("GET", memory(form), token=shop["agent"])
        assert read.status == 200 and read.body["fields"] == {"caller_name": "Ada"}, form
    # An end through the email is the profile's: the phone reads it, and it is a repeat call.
    ended = await end(api, shop["agent"], "c2", EMAIL, {"booking_day": "Friday"})
    assert ended["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "c1"
    read = await api.call("GET", memory(PHONE), token=shop["agent"])
    assert read.body["fields"] == {"caller_name": "Ada", "booking_day": "Friday"}
    # A patch through it too; and the list shows kind and link id, never the identifier.
    await api.call("PATCH", memory(EMAIL), token=shop["admin"], json={"language": "en"})
    listed = await api.call("GET", links(EMAIL), token=shop["admin"])
    assert listed.body == {"links": [link]}
    assert "ada" not in str(listed.body).lower()
    # Linking it again renews it (same id), and is audited both times, without the identifier.
    again = await api.call(
        "POST", links(PHONE), token=shop["admin"], json={"identifier": "email:ADA@example.com"}
    )
    assert (
        again.status == 200 and again.body["link"]["link_id"] == link["link_id"] and not again.body["created"]
    )
    audit = await api.call("GET", f"{BASE}/audit", token=shop["admin"])
    actions = [e["action"] for e in audit.body["records"]]
    assert actions.count("link.created") == 1 and actions.count("link.renewed") == 1
    assert "ada" not in str(audit.body).lower() and "4155550100" not in str(audit.body)


async def test_linking_two_callers_with_memory_needs_merge(api: Api, shop: dict[str, str]) -> None:
    api.clock.advance(3600)
    await end(api, shop["agent"], "email-first", EMAIL, {"caller_name": "Ada L.", "language": "fr"})
    api.clock.advance(3600)
    await end(api, shop["agent"], "phone-first", PHONE, {"caller_name": "Ada", "booking_day": "Friday"})
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": EMAIL})
    assert_problem(reply, 409, mentions='"merge": true')
    assert (await api.call("GET", memory(EMAIL), token=shop["agent"])).body["fields"] == {
        "caller_name": "Ada L.",
        "language": "fr",
    }  # nothing changed
    reply = await api.call(
        "POST", links(PHONE), token=shop["admin"], json={"identifier": EMAIL, "merge": True}
    )
    assert reply.status == 201, reply.body
    # Per field the later write wins (the phone's name); the email's language joins; its first
    # interaction is the earlier one, so it is the profile's now.
    assert reply.body["merged"] == {"fields": 1, "first_interaction": True}
    for identifier in (PHONE, EMAIL):
        read = await api.call("GET", memory(identifier), token=shop["agent"])
        assert read.body["fields"] == {"caller_name": "Ada", "booking_day": "Friday", "language": "fr"}
    ended = await end(api, shop["agent"], "later", PHONE, {})
    assert ended["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "email-first"


async def test_calls_ending_while_their_identifiers_merge_lose_nothing(
    api: Api, shop: dict[str, str]
) -> None:
    await end(api, shop["agent"], "p0", PHONE, {"caller_name": "Ada"})
    await end(api, shop["agent"], "e0", EMAIL, {"language": "fr"})
    states = {f"p{i}": (PHONE, {"n": i}) for i in range(1, 6)} | {
        f"e{i}": (EMAIL, {"booking_day": f"day {i}"}) for i in range(1, 6)
    }

    async def link() -> Any:
        return await api.call(
            "POST", links(PHONE), token=shop["admin"], json={"identifier": EMAIL, "merge": True}
        )

    results = await asyncio.gather(
        *(end(api, shop["agent"], cid, caller, state) for cid, (caller, state) in states.items()), link()
    )
    assert results[-1].status == 201, results[-1].body
    read = await api.call("GET", memory(EMAIL), token=shop["agent"])
    fields = read.body["fields"]
    assert fields["caller_name"] == "Ada" and fields["language"] == "fr"  # nobody's field was lost
    assert fields["n"] in range(1, 6) and fields["booking_day"].startswith("day ")
    # Every conversation was recorded once; the profile has one first interaction from now on.
    listed = await api.call("GET", f"{BASE}/analytics/conversations", token=shop["analytics"])
    ids = [row["conversation_id"] for row in listed.body["conversations"]]
    assert sorted(ids) == sorted(["p0", "e0", *states])
    ended = await end(api, shop["agent"], "after", EMAIL, {})
    first = ended["repeat_caller"]["REPEAT_CALLER_CONV_ID"]
    assert first in ("p0", "e0")
    assert (await end(api, shop["agent"], "after-2", PHONE, {}))["repeat_caller"][
        "REPEAT_CALLER_CONV_ID"
    ] == first


async def test_limits_and_refusals_change_nothing(api: Api, shop: dict[str, str]) -> None:
    others = ["email:b@example.com", "account:B-1", "+447700900123", "account:B-2"]
    for other in others:
        reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": other})
        assert reply.status == 201, reply.body
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": "account:B-3"})
    assert_problem(reply, 409, mentions="at most 5 identifiers")
    # Linked elsewhere, the caller itself, a blacklisted identifier.
    reply = await api.call("POST", links(EMAIL), token=shop["admin"], json={"identifier": "account:B-1"})
    assert_problem(reply, 409, mentions="linked to another caller")
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": "(415) 555-0100"})
    assert_problem(reply, 422)  # no default_region: a national number is no identifier here
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": "+1 415 555 0100"})
    assert_problem(reply, 422, mentions="own identifier")
    reply = await api.call(
        "POST", links(EMAIL), token=shop["admin"], json={"identifier": "email:test@example.com"}
    )
    assert_problem(reply, 422, mentions="blacklisted")
    # An identifier with links of its own is not linked to another caller.
    reply = await api.call("POST", links(EMAIL), token=shop["admin"], json={"identifier": PHONE})
    assert_problem(reply, 409, mentions="other identifiers are linked to it")
    listed = await api.call("GET", links("account:B-2"), token=shop["admin"])  # through any of them
    assert sorted(link["kind"] for link in listed.body["links"]) == ["account", "account", "email", "phone"]


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"identifier": "email:no-at-sign"}, "email"),
        ({"identifier": "email:ada@localhost"}, "email"),
        ({"identifier": "email:a b@example.com"}, "email"),
        ({"identifier": "account:"}, "account"),
        ({"identifier": "account:has space"}, "account"),
        ({"identifier": "account:" + "x" * 65}, "account"),
        ({"identifier": "fax:123"}, "identifier"),
        ({"identifier": EMAIL, "merge": "yes"}, "merge"),
        ({"identifier": EMAIL, "extra": 1}, "extra"),
        ({}, "identifier"),
        ([EMAIL], "body"),
    ],
)
async def test_bad_link_requests_are_refused_naming_what_is_wrong(
    api: Api, shop: dict[str, str], body: Any, mentions: str
) -> None:
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json=body)
    assert_problem(reply, 422, mentions=mentions)
    assert "no-at-sign" not in reply.body["detail"] and "has space" not in reply.body["detail"]
    assert (await api.call("GET", links(PHONE), token=shop["admin"])).body == {"links": []}


async def test_bad_identifiers_in_paths_are_refused(api: Api, shop: dict[str, str]) -> None:
    for path in ("email:nope", "account:bad!id", "email:ada@@example.com"):
        reply = await api.call("GET", memory(path), token=shop["agent"])
        assert_problem(reply, 422, mentions="identifier")
        assert "nope" not in reply.body["detail"] and "bad!id" not in reply.body["detail"]


async def test_who_may_link(api: Api, shop: dict[str, str]) -> None:
    body = {"identifier": EMAIL}
    assert_problem(
        await api.call("POST", links(PHONE), token=shop["agent"], json=body), 403, mentions="step-up"
    )
    assert_problem(await api.call("POST", links(PHONE), token=shop["analytics"], json=body), 403)
    assert_problem(await api.call("GET", links(PHONE), token=shop["agent"]), 403)
    reply = await api.call("POST", links(PHONE), token=shop["agent"], json={**body, "step_up": True})
    assert reply.status == 201
    audit = await api.call("GET", f"{BASE}/audit", token=shop["admin"])
    entry = next(e for e in audit.body["records"] if e["action"] == "link.created")
    assert entry["details"]["by_agent_after_step_up"] is True and entry["actor"].startswith("token:")
    # A project that has not opted in links nothing.
    await api.put_project("shop", {**CONFIG, "identity_linking": False})
    reply = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": "account:Z-9"})
    assert_problem(reply, 403, mentions="identity_linking")


async def test_unlink_by_identifier_or_link_id(api: Api, shop: dict[str, str]) -> None:
    await end(api, shop["agent"], "c1", PHONE, {"caller_name": "Ada"})
    made = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": EMAIL})
    account = await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": ACCOUNT})
    reply = await api.call("DELETE", f"{links(PHONE)}/{account.body['link']['link_id']}", token=shop["admin"])
    assert reply.status == 200 and reply.body["unlinked"]["kind"] == "account"
    reply = await api.call("DELETE", f"{links(EMAIL)}/{EMAIL}", token=shop["admin"])
    assert reply.status == 200 and reply.body["unlinked"]["link_id"] == made.body["link"]["link_id"]
    # Unlinked: each is a caller of its own again (empty), the phone keeps its memory.
    assert (await api.call("GET", memory(EMAIL), token=shop["agent"])).body["fields"] == {}
    assert (await api.call("GET", memory(ACCOUNT), token=shop["agent"])).body["fields"] == {}
    assert (await api.call("GET", memory(PHONE), token=shop["agent"])).body["fields"] == {
        "caller_name": "Ada"
    }
    assert_problem(await api.call("DELETE", f"{links(PHONE)}/{EMAIL}", token=shop["admin"]), 404)
    assert_problem(await api.call("DELETE", f"{links(PHONE)}/lnk_nope", token=shop["admin"]), 422)


@pytest.mark.parametrize("through", [PHONE, EMAIL, ACCOUNT])
async def test_erasure_through_any_identifier_erases_the_profile_and_every_link(
    api: Api, shop: dict[str, str], through: str
) -> None:
    await end(api, shop["agent"], "phone-call", PHONE, {"caller_name": "Ada"})
    await end(api, shop["agent"], "email-call", EMAIL, {"language": "fr"})
    await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": EMAIL, "merge": True})
    await api.call("POST", links(PHONE), token=shop["admin"], json={"identifier": ACCOUNT})
    await end(api, shop["agent"], "account-call", ACCOUNT, {"booking_day": "Friday"})
    receipt = await api.call("DELETE", f"{BASE}/callers/{through}", token=shop["admin"])
    assert receipt.status == 200, receipt.body
    removed = receipt.body["removed"]
    assert removed["links"] >= 2 and removed["fields"] == 3
    assert removed["conversation_links"] == 3 and removed["analytics_conversations"] == 3
    for identifier in (PHONE, EMAIL, ACCOUNT):
        assert (await api.call("GET", memory(identifier), token=shop["agent"])).body["fields"] == {}
        assert (await api.call("GET", links(identifier), token=shop["admin"])).body == {"links": []}
    listed = await api.call("GET", f"{BASE}/analytics/conversations", token=shop["analytics"])
    assert listed.body["conversations"] == []
    # An end made before the erasure and delivered after it, through any identifier, is dropped.
    body = {"caller": EMAIL, "state": {"caller_name": "Ada"}, "ended_at": "2000-01-01T00:00:00Z"}
    late = await api.call("POST", f"{BASE}/conversations/late/end", token=shop["agent"], json=body)
    assert late.body["erased"] is True


async def test_a_blacklisted_email_reads_empty_and_is_never_stored(api: Api, shop: dict[str, str]) -> None:
    ended = await end(api, shop["agent"], "c1", "email:TEST@example.com", {"caller_name": "Tester"})
    assert ended["blacklisted"] is True and ended["persisted"] == []
    read = await api.call("GET", memory("email:test@example.com"), token=shop["agent"])
    assert read.body["blacklisted"] is True and read.body["fields"] == {}
    shown = await api.call("GET", BASE, token=OPERATOR_TOKEN)
    assert "test@example.com" not in str(shown.body)  # the configuration keeps its pseudonym


async def test_a_call_started_before_its_identifier_was_linked_reads_the_profile(api: Api) -> None:
    config = {"memory": {"repeat_caller": CONFIG, "conversation": {"enabled": True}}}
    await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=config)
    agent, admin = await api.mint("shop", "agent"), await api.mint("shop", "admin")
    await end(api, agent, "phone-call", PHONE, {"caller_name": "Ada"})
    start = {"caller": EMAIL, "channel": "chat"}
    assert (
        await api.call("POST", f"{BASE}/conversations/chat-1/start", token=agent, json=start)
    ).status == 200
    # Mid-call, an admin links the email to the phone's profile: the call's context shows the profile.
    linked = await api.call("POST", links(PHONE), token=admin, json={"identifier": EMAIL})
    assert linked.status == 201, linked.body
    context = await api.call("GET", f"{BASE}/conversations/chat-1/context", token=agent)
    assert context.body["sections"]["profile"]["fields"] == {"caller_name": "Ada"}
    ended = await end(api, agent, "chat-1", EMAIL, {"language": "en"})
    assert ended["persisted"] == ["language"]
    read = await api.call("GET", memory(PHONE), token=agent)
    assert read.body["fields"] == {"caller_name": "Ada", "language": "en"}
