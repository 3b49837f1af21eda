"""Platform connections through a real server on every backend (SPEC section 15): put, read and delete, the
secret sealed and never answered, the per-platform options and the project's state keys checked, every
change audited; bad input a 422 naming what is wrong, changing nothing."""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.http.platform_routes import PLATFORMS
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import assert_problem

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}/platforms"
SECRET_KEY = secrets.token_bytes(32)
SECRET = "agora-webhook-secret-" + secrets.token_hex(8)
REPEAT_CALLER = {"state_keys": ["caller_name", "booking_day"], "retention": "P30D"}
AGORA = {"secret": SECRET, "state_map": {"name": "caller_name", "analysis.day": "booking_day"}}


def telnyx_key() -> str:
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


@pytest.fixture
async def api(store_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    async with running_api(store_url, clock, secret_key=SECRET_KEY) as api:
        yield api


@pytest.fixture
async def admin(api: Api) -> str:
    reply = await api.put_project(PROJECT, REPEAT_CALLER)
    assert reply.status in (200, 201), reply.body
    return await api.mint(PROJECT, "admin")


async def audit_actions(api: Api, admin: str) -> list[str]:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/audit", token=admin)
    assert reply.status == 200, reply.body
    return [r["action"] for r in reply.body["records"] if r["action"].startswith("platform.")]


async def test_a_connection_is_put_read_and_deleted_and_its_secret_never_answered(
    api: Api, admin: str
) -> None:
    reply = await api.call("PUT", f"{BASE}/agora", token=admin, json=AGORA)
    assert reply.status == 201, reply.body
    assert reply.headers["Cache-Control"] == "no-store"
    made = reply.body
    assert made == {
        "platform": "agora",
        "state_map": AGORA["state_map"],
        "channel": "phone",
        "analysis_qa_key": None,
        "end_grace": "PT2H",
        "options": {},
        "secret_set": True,
        "secret_updated_at": made["secret_updated_at"],
        "updated_at": made["updated_at"],
    }
    got = await api.call("GET", f"{BASE}/agora", token=admin)
    assert got.status == 200 and got.body == made
    # The store holds it sealed; the use case opens it for the adapters.
    stored = await api.app[SERVICES].store.get_platform_connection(PROJECT, "agora")
    assert stored is not None and SECRET.encode() not in stored
    connection = await api.app[PLATFORMS].get(await api.app[SERVICES].projects.get(PROJECT), "agora")
    assert api.app[PLATFORMS].secret(connection) == SECRET

    # A PUT without the secret keeps it (and when it was set); other settings are replaced.
    api.clock.advance(60)
    changed = {"channel": "sip", "end_grace": "PT90M", "analysis_qa_key": "call_successful"}
    reply = await api.call("PUT", f"{BASE}/agora", token=admin, json=changed)
    assert reply.status == 200, reply.body
    assert reply.body["secret_set"] is True
    assert reply.body["secret_updated_at"] == made["secret_updated_at"]
    assert reply.body["updated_at"] != made["updated_at"]
    assert reply.body["end_grace"] == "PT1H30M" and reply.body["state_map"] == {}
    connection = await api.app[PLATFORMS].get(await api.app[SERVICES].projects.get(PROJECT), "agora")
    assert api.app[PLATFORMS].secret(connection) == SECRET
    # A new secret replaces it.
    reply = await api.call("PUT", f"{BASE}/agora", token=admin, json={"secret": "another-secret"})
    assert reply.status == 200 and reply.body["secret_updated_at"] != made["secret_updated_at"]

    assert (await api.call("DELETE", f"{BASE}/agora", token=admin)).status == 204
    assert_problem(await api.call("GET", f"{BASE}/agora", token=admin), 404, mentions="agora")
    assert_problem(await api.call("DELETE", f"{BASE}/agora", token=admin), 404)
    assert await api.app[SERVICES].store.get_platform_connection(PROJECT, "agora") is None
    assert await audit_actions(api, admin) == [
        "platform.disconnected",
        "platform.updated",
        "platform.updated",
        "platform.connected",
    ]
    records = (await api.call("GET", f"/v1/projects/{PROJECT}/audit", token=admin)).body["records"]
    assert SECRET not in orjson.dumps(records).decode()


async def test_each_platforms_options(api: Api, admin: str) -> None:
    vapi = {"secret": "s" * 32, "options": {"auth": "hmac", "assistant_id": "asst_123"}}
    assert (await api.call("PUT", f"{BASE}/vapi", token=admin, json=vapi)).status == 201
    # Vapi in bearer mode and Telnyx (its public key) need no secret.
    bearer = {"options": {"auth": "bearer", "assistant_id": "asst_123"}}
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}/platforms/vapi", token=admin, json=bearer)
    assert reply.status == 200 and reply.body["options"] == bearer["options"]
    telnyx = {"options": {"public_key": telnyx_key()}}
    reply = await api.call("PUT", f"{BASE}/telnyx", token=admin, json=telnyx)
    assert (
        reply.status == 201 and reply.body["secret_set"] is False and reply.body["secret_updated_at"] is None
    )
    eleven = {"secret": "wsec_x", "options": {"agent_variables": ["customer_name", "plan"]}}
    reply = await api.call("PUT", f"{BASE}/elevenlabs", token=admin, json=eleven)
    assert reply.status == 201 and reply.body["options"] == eleven["options"]
    assert (await api.call("PUT", f"{BASE}/retell", token=admin, json={"secret": "key_x"})).status == 201


BAD: list[tuple[str, Any, str]] = [
    ("agora", {"state_map": {"name": "caller_name"}}, "secret: required"),
    ("agora", {**AGORA, "state_map": {"name": "mood"}}, "state_map.name: 'mood' is not one of the project's"),
    ("agora", {**AGORA, "state_map": {"a..b": "caller_name"}}, "state_map"),
    ("agora", {**AGORA, "end_grace": "PT1M"}, "end_grace"),
    ("agora", {**AGORA, "end_grace": "P3D"}, "end_grace"),
    ("agora", {**AGORA, "end_grace": "2 hours"}, "end_grace"),
    ("agora", {**AGORA, "channel": "no spaces"}, "channel"),
    ("agora", {**AGORA, "options": {"auth": "hmac"}}, "options.auth: not an option of this platform"),
    ("agora", {**AGORA, "colour": "blue"}, "colour"),
    ("agora", {**AGORA, "secret": 12}, "secret"),
    ("vapi", {"secret": "s", "options": {"auth": "hmac"}}, "options.assistant_id"),
    ("vapi", {"secret": "s", "options": {"auth": "basic", "assistant_id": "a"}}, "options.auth"),
    ("vapi", {"options": {"auth": "hmac", "assistant_id": "a"}}, "secret: required"),
    ("elevenlabs", {"secret": "s", "options": {"agent_variables": ["no-dash"]}}, "options.agent_variables.0"),
    ("telnyx", {"options": {"public_key": "bm90IGEga2V5"}}, "options.public_key"),
    ("telnyx", {"options": {"public_key": "%%%"}}, "options.public_key"),
    ("telnyx", {"options": {}}, "options.public_key"),
    ("twilio", AGORA, "agora, vapi, retell, elevenlabs, telnyx"),
]


@pytest.mark.parametrize(("platform", "body", "mentions"), BAD)
async def test_bad_input_is_422_naming_what_is_wrong_and_changes_nothing(
    api: Api, admin: str, platform: str, body: Any, mentions: str
) -> None:
    reply = await api.call("PUT", f"{BASE}/{platform}", token=admin, json=body)
    assert_problem(reply, 422)
    problem = orjson.dumps(reply.body).decode()
    assert mentions in problem, problem
    assert "bm90IGEga2V5" not in problem  # input is never echoed
    if platform != "twilio":
        assert await api.app[SERVICES].store.get_platform_connection(PROJECT, platform) is None
    assert await audit_actions(api, admin) == []


async def test_a_project_that_does_not_exist_and_the_roles(api: Api, admin: str) -> None:
    assert_problem(
        await api.call("PUT", "/v1/projects/nowhere/platforms/agora", token=OPERATOR_TOKEN, json=AGORA), 404
    )
    assert_problem(await api.call("GET", "/v1/projects/nowhere/platforms/agora", token=OPERATOR_TOKEN), 404)
    assert_problem(await api.call("GET", f"{BASE}/twilio", token=admin), 422, mentions="telnyx")
    agent = await api.mint(PROJECT, "agent")
    assert_problem(await api.call("PUT", f"{BASE}/agora", token=agent, json=AGORA), 403)
    platform = await api.mint(PROJECT, "platform")
    assert_problem(await api.call("PUT", f"{BASE}/agora", token=platform, json=AGORA), 403)
    assert_problem(await api.call("GET", f"{BASE}/agora", token=platform), 403)
    assert await api.app[SERVICES].store.get_platform_connection(PROJECT, "agora") is None


async def test_without_a_secret_key_a_secret_cannot_be_stored(store_url: str, clock: FakeClock) -> None:
    async with running_api(store_url, clock) as api:
        assert (await api.put_project(PROJECT, REPEAT_CALLER)).status == 201
        admin = await api.mint(PROJECT, "admin")
        reply = await api.call("PUT", f"{BASE}/agora", token=admin, json=AGORA)
        assert_problem(reply, 503, mentions="CALLER_MEMORY_SECRET_KEY")
        assert await api.app[SERVICES].store.get_platform_connection(PROJECT, "agora") is None
        # Telnyx needs no secret: it is stored.
        telnyx = {"options": {"public_key": telnyx_key()}}
        assert (await api.call("PUT", f"{BASE}/telnyx", token=admin, json=telnyx)).status == 201
