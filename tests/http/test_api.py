"""The HTTP API through a real server, on SQLite and on a real redis-server."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from datetime import UTC, datetime

import pytest
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.support.redis_server import RedisServer

CALLER = "+14155550100"
CONFIG = {
    "state_keys": ["caller_name", "booking_day", "verified", "cheese_type", "profile"],
    "field_ttls": {"verified": "PT1H"},
    "identifier_blacklist": ["+440000000000", "020 7946 0000"],
    "retention": "P30D",
    "default_region": "GB",
}


def memory_path(project: str, identifier: str = CALLER) -> str:
    return f"/v1/projects/{project}/callers/{identifier}/memory"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("cheese-shop", CONFIG)


def assert_problem(reply: object, status: int, *, mentions: str | None = None) -> None:
    assert reply.status == status, reply.body  # type: ignore[attr-defined]
    assert reply.content_type == "application/problem+json"  # type: ignore[attr-defined]
    body = reply.body  # type: ignore[attr-defined]
    assert body["status"] == status and body["title"] and body["detail"]
    if mentions is not None:
        assert mentions in body["detail"], body["detail"]


# Health -------------------------------------------------------------------------------------------------


async def test_health_and_readiness(api: Api) -> None:
    assert (await api.call("GET", "/healthz")).body == {"status": "ok"}
    ready = await api.call("GET", "/readyz")
    assert ready.status == 200 and ready.body == {"status": "ready"}


async def test_unknown_route_and_method_are_problems(api: Api) -> None:
    assert_problem(await api.call("GET", "/v1/nothing-here"), 404, mentions="openapi")
    reply = await api.call("POST", "/healthz")
    assert_problem(reply, 405)
    assert "GET" in reply.headers["Allow"]


# Projects -----------------------------------------------------------------------------------------------


async def test_put_project_creates_then_replaces_and_hides_blacklisted_numbers(api: Api) -> None:
    created = await api.put_project("cheese-shop", CONFIG)
    assert created.status == 201
    rc = created.body["memory"]["repeat_caller"]
    assert rc["retention"] == "P30D" and rc["field_ttls"] == {"verified": "PT1H"}
    assert len(rc["identifier_blacklist"]) == 2
    assert all(re.fullmatch(r"pseudonym:[0-9a-f]{32}", e) for e in rc["identifier_blacklist"])
    replaced = await api.put_project("cheese-shop", {**CONFIG, "analytics_enabled": True})
    assert replaced.status == 200 and replaced.body["memory"]["repeat_caller"]["analytics_enabled"] is True
    shown = await api.call("GET", "/v1/projects/cheese-shop", token=OPERATOR_TOKEN)
    assert shown.body == replaced.body
    # The document read back can be applied again unchanged (pseudonym entries are accepted).
    again = await api.call("PUT", "/v1/projects/cheese-shop", token=OPERATOR_TOKEN, json=shown.body)
    assert again.status == 200 and again.body == shown.body


async def test_defaults_for_an_empty_configuration(api: Api) -> None:
    reply = await api.call("PUT", "/v1/projects/minimal", token=OPERATOR_TOKEN, json={})
    assert reply.status == 201
    assert reply.body["memory"]["repeat_caller"] == {
        "analytics_enabled": False,
        "state_keys": [],
        "identifier_blacklist": [],
        "retention": "P90D",
        "field_ttls": {},
        "default_region": None,
        "identity_linking": False,
        "field_classes": {},
        "trust": {},
        "unknown_attestation": "C",
    }


# One refused configuration per backend, for the mapping (422, problem document, field, nothing stored): every
# kind of refusal is in tests/domain/test_projects.py (parsed) and test_use_cases.py (nothing stored).
async def test_invalid_configuration_is_refused_naming_the_field_and_changes_nothing(api: Api) -> None:
    repeat_caller = {"identifier_blacklist": ["+14155550100", "not a number"]}
    field = "memory.repeat_caller.identifier_blacklist[1]"
    before = await api.put_project("cheese-shop", CONFIG)
    reply = await api.put_project("cheese-shop", repeat_caller)
    assert_problem(reply, 422, mentions=field)
    assert reply.body["errors"][0]["field"] == field
    assert "+1415" not in reply.body["detail"] and "07700" not in reply.body["detail"]
    after = await api.call("GET", "/v1/projects/cheese-shop", token=OPERATOR_TOKEN)
    assert after.body == before.body


async def test_configuration_body_errors(api: Api) -> None:
    path = "/v1/projects/cheese-shop"
    assert_problem(
        await api.call(
            "PUT", path, token=OPERATOR_TOKEN, data=b"{not json", headers={"Content-Type": "application/json"}
        ),
        400,
        mentions="not valid JSON",
    )
    assert_problem(
        await api.call(
            "PUT", path, token=OPERATOR_TOKEN, data=b"", headers={"Content-Type": "application/json"}
        ),
        400,
        mentions="empty",
    )
    assert_problem(
        await api.call("PUT", path, token=OPERATOR_TOKEN, json=[1, 2]), 422, mentions="JSON object"
    )
    assert_problem(
        await api.call("PUT", path, token=OPERATOR_TOKEN, data=b"{}", headers={"Content-Type": "text/plain"}),
        415,
    )
    huge = b'{"memory": {"repeat_caller": {"state_keys": ["' + b"a" * 70_000 + b'"]}}}'
    assert_problem(
        await api.call(
            "PUT", path, token=OPERATOR_TOKEN, data=huge, headers={"Content-Type": "application/json"}
        ),
        413,
    )
    assert_problem(
        await api.call("PUT", "/v1/projects/Bad_Project!", token=OPERATOR_TOKEN, json={}),
        422,
        mentions="project id",
    )
    assert (await api.call("GET", path, token=OPERATOR_TOKEN)).status == 404


async def test_only_the_operator_may_put_a_project(api: Api, shop: dict[str, str]) -> None:
    for role in ("agent", "analytics", "admin"):
        assert_problem(
            await api.call("PUT", "/v1/projects/cheese-shop", token=shop[role], json={}),
            403,
            mentions="operator",
        )
    assert_problem(await api.call("PUT", "/v1/projects/cheese-shop", json={}), 401, mentions="Authorization")


async def test_reading_configuration_needs_admin(api: Api, shop: dict[str, str]) -> None:
    assert (await api.call("GET", "/v1/projects/cheese-shop", token=shop["admin"])).status == 200
    assert_problem(
        await api.call("GET", "/v1/projects/cheese-shop", token=shop["agent"]), 403, mentions="admin"
    )
    assert_problem(await api.call("GET", "/v1/projects/cheese-shop", token=shop["analytics"]), 403)


# Authentication and tenancy -------------------------------------------------------------------------------


# No header, and a token the backend is asked about; every kind of bad credential is in
# tests/domain/test_use_cases.py.
@pytest.mark.parametrize("authorization", [None, "Bearer cm_000000000000_wrongsecret"])
async def test_missing_or_bad_credentials_are_401(
    api: Api, shop: dict[str, str], authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    reply = await api.call("GET", memory_path("cheese-shop"), headers=headers)
    assert_problem(reply, 401)
    assert reply.headers["WWW-Authenticate"].startswith("Bearer")


async def test_a_tampered_secret_is_refused(api: Api, shop: dict[str, str]) -> None:
    good = shop["agent"]
    bad = good[:-1] + ("A" if good[-1] != "A" else "B")
    assert_problem(await api.call("GET", memory_path("cheese-shop"), token=bad), 401)
    assert (await api.call("GET", memory_path("cheese-shop"), token=good)).status == 200


async def test_another_projects_token_sees_nothing(api: Api, shop: dict[str, str]) -> None:
    other = await api.project_with_tokens("bakery", {"state_keys": ["caller_name"]})
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"caller_name": "Ada"})
    attempts = [
        ("GET", "/v1/projects/cheese-shop", None),
        ("POST", "/v1/projects/cheese-shop/tokens", {"role": "admin"}),
        ("GET", "/v1/projects/cheese-shop/tokens", None),
        ("DELETE", f"/v1/projects/cheese-shop/tokens/{shop['agent'].split('_')[1]}", None),
        ("GET", memory_path("cheese-shop"), None),
        ("PATCH", memory_path("cheese-shop"), {"caller_name": "Eve"}),
        ("DELETE", memory_path("cheese-shop") + "/caller_name", None),
        ("DELETE", f"/v1/projects/cheese-shop/callers/{CALLER}", None),
    ]
    for method, path, body in attempts:
        for role in ("agent", "analytics", "admin"):
            reply = await api.call(method, path, token=other[role], json=body)
            assert_problem(reply, 404, mentions="project 'cheese-shop' not found")
    # The same answer as for a project that does not exist at all: existence is not revealed.
    missing = await api.call("GET", "/v1/projects/nowhere", token=other["admin"])
    assert missing.body["detail"] == "project 'nowhere' not found"
    still = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert still.body["fields"] == {"caller_name": "Ada"}
    assert (
        len((await api.call("GET", "/v1/projects/cheese-shop/tokens", token=shop["admin"])).body["tokens"])
        == 3
    )


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", memory_path("cheese-shop"), {"agent", "admin"}),
        ("PATCH", memory_path("cheese-shop"), {"admin"}),
        ("DELETE", memory_path("cheese-shop") + "/caller_name", {"admin"}),
        ("DELETE", f"/v1/projects/cheese-shop/callers/{CALLER}", {"admin"}),
        ("GET", "/v1/projects/cheese-shop/tokens", {"admin"}),
        ("POST", "/v1/projects/cheese-shop/tokens", {"admin"}),
        ("GET", "/v1/projects/cheese-shop", {"admin"}),
    ],
)
async def test_roles(api: Api, shop: dict[str, str], method: str, path: str, allowed: set[str]) -> None:
    body = {"caller_name": "Ada"} if method == "PATCH" else {"role": "agent"} if method == "POST" else None
    for role in ("agent", "analytics", "admin"):
        reply = await api.call(method, path, token=shop[role], json=body)
        if role in allowed:
            assert reply.status in (200, 201), (role, reply.body)
        else:
            assert_problem(reply, 403, mentions=f"role '{role}'")
    assert (await api.call(method, path, token=OPERATOR_TOKEN, json=body)).status in (200, 201)


# Tokens -------------------------------------------------------------------------------------------------


async def test_token_lifecycle(api: Api, shop: dict[str, str]) -> None:
    minted = await api.call(
        "POST",
        "/v1/projects/cheese-shop/tokens",
        token=shop["admin"],
        json={"role": "agent", "label": "prod agent"},
    )
    assert minted.status == 201 and minted.headers["Cache-Control"] == "no-store"
    secret = minted.body["token"]
    token_id = minted.body["token_id"]
    assert secret.startswith(f"cm_{token_id}_") and minted.body["role"] == "agent"
    listed = await api.call("GET", "/v1/projects/cheese-shop/tokens", token=shop["admin"])
    entry = next(t for t in listed.body["tokens"] if t["token_id"] == token_id)
    assert entry == {k: v for k, v in minted.body.items() if k != "token"}
    assert secret.split("_", 2)[2] not in str(listed.body)
    assert (await api.call("GET", memory_path("cheese-shop"), token=secret)).status == 200
    revoked = await api.call("DELETE", f"/v1/projects/cheese-shop/tokens/{token_id}", token=shop["admin"])
    assert revoked.status == 204
    assert_problem(await api.call("GET", memory_path("cheese-shop"), token=secret), 401)
    assert_problem(
        await api.call("DELETE", f"/v1/projects/cheese-shop/tokens/{token_id}", token=shop["admin"]), 404
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"role": "superuser"}, "role"),
        ({}, "role"),
        ({"role": "agent", "scope": "all"}, "scope"),
        ({"role": "agent", "label": "x" * 101}, "label"),
    ],
)
async def test_bad_token_requests(
    api: Api, shop: dict[str, str], body: dict[str, object], field: str
) -> None:
    reply = await api.call("POST", "/v1/projects/cheese-shop/tokens", token=shop["admin"], json=body)
    assert_problem(reply, 422, mentions=field)
    assert reply.body["errors"][0]["field"] == field
    assert (
        len((await api.call("GET", "/v1/projects/cheese-shop/tokens", token=shop["admin"])).body["tokens"])
        == 3
    )


async def test_tokens_of_a_missing_project(api: Api) -> None:
    assert_problem(
        await api.call("POST", "/v1/projects/ghost/tokens", token=OPERATOR_TOKEN, json={"role": "admin"}), 404
    )


# Memory -------------------------------------------------------------------------------------------------


async def test_patch_is_a_merge_and_null_deletes(api: Api, shop: dict[str, str]) -> None:
    first = await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"cheese_type": "gouda"}
    )
    assert first.status == 200 and first.body["fields"] == {"cheese_type": "gouda"}
    second = await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"booking_day": "Friday"}
    )
    assert second.body["fields"] == {"cheese_type": "gouda", "booking_day": "Friday"}
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    # An agent's read is a call's (its attestation shown: unknown here); the memory is the same.
    assert read.body == {**second.body, "attestation": "unknown"}
    assert read.headers["ETag"] == second.headers["ETag"]
    latest = await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"cheese_type": "brie"}
    )
    assert latest.body["fields"]["cheese_type"] == "brie"
    deleted = await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"cheese_type": None}
    )
    assert deleted.body["fields"] == {"booking_day": "Friday"}


async def test_structured_values_round_trip(api: Api, shop: dict[str, str]) -> None:
    profile = {
        "allergies": ["nuts"],
        "vip": True,
        "visits": 3,
        "note": "ünïcødé ☎",
        "score": 1.5,
        "none": None,
    }
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"profile": profile})
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"]["profile"] == profile


async def test_identifier_forms_are_one_caller(api: Api) -> None:
    tokens = await api.project_with_tokens("us-shop", {"state_keys": ["caller_name"], "default_region": "US"})
    await api.call(
        "PATCH",
        memory_path("us-shop", "+1 (415) 555-0100"),
        token=tokens["admin"],
        json={"caller_name": "Ada"},
    )
    for form in ("+14155550100", "(415) 555-0100", "415-555-0100", "%2B1%20415%20555%200100"):
        read = await api.call("GET", memory_path("us-shop", form), token=tokens["agent"])
        assert read.body["fields"] == {"caller_name": "Ada"}, form
        assert read.body["identifier"] == "+14155550100"


async def test_national_number_without_region_is_refused(api: Api) -> None:
    tokens = await api.project_with_tokens("no-region", {"state_keys": ["caller_name"]})
    reply = await api.call("GET", memory_path("no-region", "(415) 555-0100"), token=tokens["agent"])
    assert_problem(reply, 422, mentions="default_region")


async def test_bad_identifiers_are_422_without_echo(api: Api, shop: dict[str, str]) -> None:
    # Every route that takes an identifier, with one sent percent-encoded (decoded before it is read); every
    # kind of bad identifier is in tests/domain/test_identifiers.py.
    identifier = "+14155550100%20ext.%205"
    for method, body in (("GET", None), ("PATCH", {"caller_name": "Ada"}), ("DELETE", None)):
        path = (
            memory_path("cheese-shop", identifier)
            if method != "DELETE"
            else f"/v1/projects/cheese-shop/callers/{identifier}"
        )
        reply = await api.call(method, path, token=shop["admin"], json=body)
        assert_problem(reply, 422, mentions="identifier")
        assert reply.body["errors"][0]["field"] == "identifier"
        assert identifier not in reply.body["detail"] and "4155550100" not in str(reply.body)


async def test_unknown_caller_has_empty_memory(api: Api, shop: dict[str, str]) -> None:
    read = await api.call("GET", memory_path("cheese-shop", "+447700900123"), token=shop["agent"])
    assert read.status == 200
    assert read.body == {
        "identifier": "+447700900123",
        "fields": {},
        "expires_at": None,
        "valid_until": None,
        "blacklisted": False,
        "withheld": [],
        "attestation": "unknown",
    }


async def test_refused_patches_change_nothing(api: Api, shop: dict[str, str]) -> None:
    # One refused patch per backend (a good field beside a bad name: nothing of it is written); every kind of
    # refused patch is in tests/domain/test_use_cases.py.
    patch, field, mentions = {"caller_name": "Ada", "not-a-name": 1}, "not-a-name", "field names"
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"booking_day": "Monday"})
    before = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    reply = await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json=patch)
    assert_problem(reply, 422, mentions=mentions)
    assert reply.body["errors"][0]["field"] == field
    after = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert after.body == before.body and after.headers["ETag"] == before.headers["ETag"]


async def test_error_messages_never_repeat_a_number(api: Api, shop: dict[str, str]) -> None:
    reply = await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"+14155550100": 1})
    assert_problem(reply, 422, mentions="field names")
    assert "4155550100" not in str(reply.body)
    missing = await api.call("GET", "/v1/projects/4155550100", token=OPERATOR_TOKEN)
    assert_problem(missing, 404)
    assert "4155550100" not in str(missing.body)


async def test_a_malformed_project_id_is_422_everywhere(api: Api, shop: dict[str, str]) -> None:
    for method, path in (("GET", "/v1/projects/Cheese-Shop"), ("GET", memory_path("Cheese-Shop"))):
        for token in (OPERATOR_TOKEN, shop["admin"]):
            assert_problem(await api.call(method, path, token=token), 422, mentions="project id")


async def test_patch_body_errors(api: Api, shop: dict[str, str]) -> None:
    path = memory_path("cheese-shop")
    json_type = {"Content-Type": "application/json"}
    assert_problem(await api.call("PATCH", path, token=shop["admin"], data=b'{"a": ', headers=json_type), 400)
    assert_problem(
        await api.call("PATCH", path, token=shop["admin"], json=["caller_name"]), 422, mentions="JSON object"
    )
    assert_problem(await api.call("PATCH", path, token=shop["admin"], json="Ada"), 422)
    assert_problem(
        await api.call(
            "PATCH",
            path,
            token=shop["admin"],
            data=b"caller_name=Ada",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        ),
        415,
    )
    big = {"caller_name": "x" * 70_000}
    assert_problem(await api.call("PATCH", path, token=shop["admin"], json=big), 413)
    merge = await api.call(
        "PATCH",
        path,
        token=shop["admin"],
        data=b'{"caller_name": "Ada"}',
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert merge.status == 200 and merge.body["fields"] == {"caller_name": "Ada"}


async def test_field_ttl_expiry_and_renewal(api: Api, shop: dict[str, str]) -> None:
    await api.call(
        "PATCH",
        memory_path("cheese-shop"),
        token=shop["admin"],
        json={"verified": True, "caller_name": "Ada"},
    )
    api.clock.advance(3599)
    assert (await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])).body["fields"][
        "verified"
    ] is True
    await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"verified": True}
    )  # renews
    api.clock.advance(3599)
    assert (
        "verified" in (await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])).body["fields"]
    )
    api.clock.advance(2)
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"caller_name": "Ada"}
    api.clock.advance(30 * 86400)  # retention
    gone = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert gone.body["fields"] == {} and gone.body["expires_at"] is None


async def test_shortening_retention_applies_to_stored_fields_at_once(api: Api, shop: dict[str, str]) -> None:
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"caller_name": "Ada"})
    api.clock.advance(2 * 86400)
    await api.put_project("cheese-shop", {**CONFIG, "retention": "P1D"})
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {}

    await api.put_project("cheese-shop", CONFIG)
    await api.call(
        "PATCH",
        memory_path("cheese-shop"),
        token=shop["admin"],
        json={"booking_day": "Friday", "caller_name": "Bo"},
    )
    await api.put_project("cheese-shop", {**CONFIG, "state_keys": ["booking_day"], "field_ttls": {}})
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"booking_day": "Friday"}


async def test_expires_at_is_hour_rounded(api: Api, shop: dict[str, str]) -> None:
    api.clock.advance(1234.567)
    written_at = api.clock.now_ms()
    reply = await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"caller_name": "Ada"}
    )
    expires = reply.body["expires_at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:00:00Z", expires)
    expires_ms = int(datetime.strptime(expires, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp() * 1000)
    exact = written_at + 30 * 86400 * 1000
    assert exact <= expires_ms < exact + 3_600_000


async def test_valid_until_is_the_first_expiry_rounded_down(api: Api, shop: dict[str, str]) -> None:
    """``valid_until`` (how long a client may serve this memory after a failed read) is never later than any
    field's expiry: the earliest one, rounded down to the hour; ``expires_at`` is the latest, rounded up."""

    def ms(stamp: str) -> int:
        return int(datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp() * 1000)

    api.clock.advance(1234.567)
    first = api.clock.now_ms()
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"caller_name": "Ada"})
    api.clock.advance(5 * 3600 + 17)
    last = api.clock.now_ms()
    await api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"booking_day": "Friday"})
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    ttl = 30 * 86400 * 1000
    valid_until, expires_at = ms(read.body["valid_until"]), ms(read.body["expires_at"])
    assert first + ttl - 3_600_000 < valid_until <= first + ttl
    assert last + ttl <= expires_at < last + ttl + 3_600_000
    api.clock.advance(30 * 86400 - 5 * 3600)  # caller_name has expired, booking_day not
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {"booking_day": "Friday"}
    assert last + ttl - 3_600_000 < ms(read.body["valid_until"]) <= last + ttl


async def test_blacklisted_callers_read_empty_and_writes_are_dropped(api: Api, shop: dict[str, str]) -> None:
    for form in ("+440000000000", "0000000000", "+442079460000", "020 7946 0000"):
        reply = await api.call(
            "PATCH", memory_path("cheese-shop", form), token=shop["admin"], json={"caller_name": "Test"}
        )
        assert reply.status == 200 and reply.body["blacklisted"] is True and reply.body["fields"] == {}, form
        read = await api.call("GET", memory_path("cheese-shop", form), token=shop["agent"])
        assert read.body["fields"] == {} and read.body["blacklisted"] is True
    # Lifting the blacklist shows that nothing was stored meanwhile.
    await api.put_project("cheese-shop", {**CONFIG, "identifier_blacklist": []})
    read = await api.call("GET", memory_path("cheese-shop", "+440000000000"), token=shop["agent"])
    assert read.body == {
        "identifier": "+44000000000",
        "fields": {},
        "expires_at": None,
        "valid_until": None,
        "blacklisted": False,
        "withheld": [],
        "attestation": "unknown",
    }
    # Bad input is still refused for blacklisted callers.
    await api.put_project("cheese-shop", CONFIG)
    reply = await api.call(
        "PATCH", memory_path("cheese-shop", "+440000000000"), token=shop["admin"], json={"nope": 1}
    )
    assert_problem(reply, 422)


async def test_etag_if_none_match_and_if_match(api: Api, shop: dict[str, str]) -> None:
    path = memory_path("cheese-shop")
    empty = await api.call("GET", path, token=shop["agent"])
    etag0 = empty.headers["ETag"]
    assert re.fullmatch(r'"[0-9a-f]{20}"', etag0)
    assert (await api.call("GET", path, token=shop["agent"], headers={"If-None-Match": etag0})).status == 304
    assert_problem(
        await api.call(
            "PATCH", path, token=shop["admin"], json={"caller_name": "Ada"}, headers={"If-Match": "*"}
        ),
        412,
    )
    written = await api.call(
        "PATCH", path, token=shop["admin"], json={"caller_name": "Ada"}, headers={"If-Match": etag0}
    )
    assert written.status == 200
    etag1 = written.headers["ETag"]
    assert etag1 != etag0
    stale = await api.call(
        "PATCH", path, token=shop["admin"], json={"caller_name": "Eve"}, headers={"If-Match": etag0}
    )
    assert_problem(stale, 412, mentions="changed")
    assert stale.headers["ETag"] == etag1
    assert (await api.call("GET", path, token=shop["agent"])).body["fields"] == {"caller_name": "Ada"}
    not_modified = await api.call("GET", path, token=shop["agent"], headers={"If-None-Match": etag1})
    assert not_modified.status == 304 and not_modified.headers["ETag"] == etag1
    weak = await api.call("GET", path, token=shop["agent"], headers={"If-None-Match": f'"abc", W/{etag1}'})
    assert weak.status == 304
    assert (await api.call("GET", path, token=shop["agent"], headers={"If-None-Match": etag0})).status == 200
    listed = await api.call(
        "PATCH",
        path,
        token=shop["admin"],
        json={"booking_day": "Friday"},
        headers={"If-Match": f'"0000", {etag1}'},
    )
    assert listed.status == 200
    assert (
        await api.call(
            "PATCH", path, token=shop["admin"], json={"caller_name": "Bo"}, headers={"If-Match": "*"}
        )
    ).status == 200


async def test_expiry_changes_the_etag(api: Api, shop: dict[str, str]) -> None:
    path = memory_path("cheese-shop")
    written = await api.call(
        "PATCH", path, token=shop["admin"], json={"verified": True, "caller_name": "Ada"}
    )
    api.clock.advance(3601)
    read = await api.call(
        "GET", path, token=shop["agent"], headers={"If-None-Match": written.headers["ETag"]}
    )
    assert read.status == 200 and read.body["fields"] == {"caller_name": "Ada"}


async def test_delete_one_field(api: Api, shop: dict[str, str]) -> None:
    path = memory_path("cheese-shop")
    written = await api.call(
        "PATCH", path, token=shop["admin"], json={"caller_name": "Ada", "booking_day": "Friday"}
    )
    stale = await api.call(
        "DELETE", path + "/caller_name", token=shop["admin"], headers={"If-Match": '"0123"'}
    )
    assert_problem(stale, 412)
    reply = await api.call(
        "DELETE", path + "/caller_name", token=shop["admin"], headers={"If-Match": written.headers["ETag"]}
    )
    assert reply.status == 200 and reply.body["fields"] == {"booking_day": "Friday"}
    again = await api.call("DELETE", path + "/caller_name", token=shop["admin"])
    assert again.status == 200 and again.body["fields"] == {"booking_day": "Friday"}
    assert_problem(
        await api.call("DELETE", path + "/bad-name", token=shop["admin"]), 422, mentions="field names"
    )


async def test_erase_caller(api: Api, shop: dict[str, str]) -> None:
    await api.call(
        "PATCH",
        memory_path("cheese-shop"),
        token=shop["admin"],
        json={"caller_name": "Ada", "booking_day": "Friday"},
    )
    other = "+447700900123"
    await api.call(
        "PATCH", memory_path("cheese-shop", other), token=shop["admin"], json={"caller_name": "Bo"}
    )
    receipt = await api.call("DELETE", f"/v1/projects/cheese-shop/callers/{CALLER}", token=shop["admin"])
    assert receipt.status == 200
    assert re.fullmatch(r"[0-9a-f]{32}", receipt.body["receipt_id"])
    assert receipt.body["project"] == "cheese-shop"
    assert receipt.body["removed"] == {
        "fields": 2,
        "first_interaction": False,
        "conversation_links": 0,
        "analytics_conversations": 0,
        "transcripts": 0,
        "webhook_deliveries": 0,
        "archived_conversations": 0,
        "links": 0,
    }
    assert receipt.body["erased_at"].endswith(":00:00Z")
    assert CALLER not in str(receipt.body) and "4155550100" not in str(receipt.body)
    assert (await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])).body["fields"] == {}
    assert (await api.call("GET", memory_path("cheese-shop", other), token=shop["agent"])).body["fields"] == {
        "caller_name": "Bo"
    }
    again = await api.call("DELETE", f"/v1/projects/cheese-shop/callers/{CALLER}", token=shop["admin"])
    assert again.body["removed"]["fields"] == 0


async def test_concurrent_writers_lose_no_field(api: Api, shop: dict[str, str]) -> None:
    await api.put_project("cheese-shop", {"state_keys": [f"k{i}" for i in range(40)]})
    replies = await asyncio.gather(
        *(
            api.call("PATCH", memory_path("cheese-shop"), token=shop["admin"], json={f"k{i}": i})
            for i in range(40)
        )
    )
    assert all(r.status == 200 for r in replies)
    read = await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    assert read.body["fields"] == {f"k{i}": i for i in range(40)}


async def test_a_hung_redis_gives_503_quickly_and_recovers(
    redis_server: RedisServer, clock: FakeClock
) -> None:
    with redis_server.client() as client:
        client.flushall()
    async with running_api(redis_server.url, clock) as api:
        shop = await api.project_with_tokens("cheese-shop", CONFIG)
        path = memory_path("cheese-shop")
        await api.call("PATCH", path, token=shop["admin"], json={"caller_name": "Ada"})
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            reply = await api.call("GET", path, token=shop["agent"])
            elapsed = time.monotonic() - started
            assert_problem(reply, 503, mentions="Redis")
            assert elapsed < 2.0, elapsed
            assert (await api.call("GET", "/readyz")).status == 503
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        assert (await api.call("GET", "/readyz")).status == 200
        assert (await api.call("GET", path, token=shop["agent"])).body["fields"] == {"caller_name": "Ada"}
