"""Tenant isolation and roles for every endpoint, derived from the served OpenAPI document (so a new
endpoint is covered as soon as it is documented)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from caller_memory.service.domain.tokens import FailureThrottle
from caller_memory.service.http.app_keys import SERVICES

from tests.conftest import OPERATOR_TOKEN, Api, Reply
from tests.http.test_api import assert_problem as assert_problem_document

CALLER = "+14155550100"
GRANTS = {
    "agent": {"agent"},
    "analytics": {"analytics"},
    "admin": {"admin", "agent", "analytics", "platform"},
}
BODIES: dict[tuple[str, str], Any] = {
    ("put", "/v1/projects/{project}"): {"memory": {"repeat_caller": {"state_keys": ["a"]}}},
    ("post", "/v1/projects/{project}/tokens"): {"role": "agent"},
    ("patch", "/v1/projects/{project}/callers/{identifier}/memory"): {"a": 1},
    ("post", "/v1/projects/{project}/conversations/{conversation_id}/end"): {
        "caller": CALLER,
        "state": {"a": 2},
    },
}


async def operations(api: Api) -> list[tuple[str, str, str | None]]:
    """(method, path template, required role or None for public) of every documented operation."""
    doc = (await api.call("GET", "/openapi.json")).body
    out = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            out.append((method, path, op.get("x-required-role")))
    return out


def concrete(path: str, token_id: str) -> str:
    values = {
        "project": "victim",
        "identifier": CALLER,
        "field": "a",
        "token_id": token_id,
        "conversation_id": "conv-1",
        "asset": "dashboard.js",
        "webhook_id": "wh_0123456789abcdef",
        "delivery_id": "msg_nothing",
        "other": "email:ada@example.com",
        "platform": "agora",
    }
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)


def assert_problem(reply: Reply, status: int, *, mentions: str | None = None) -> None:
    """A problem document; the MCP endpoint's, as the data of a JSON-RPC error at the same status (what MCP
    clients read)."""
    if reply.content_type == "application/json" and isinstance(reply.body, dict) and "jsonrpc" in reply.body:
        error = reply.body["error"]
        assert reply.status == status and error["message"] == error["data"]["detail"], reply.body
        reply = Reply(reply.status, reply.headers, error["data"], "application/problem+json")
    assert_problem_document(reply, status, mentions=mentions)


@pytest.fixture
async def tenants(api: Api) -> dict[str, dict[str, str]]:
    victim = await api.project_with_tokens("victim", {"state_keys": ["a"], "analytics_enabled": True})
    other = await api.project_with_tokens("other", {"state_keys": ["a"], "analytics_enabled": True})
    body = {"caller": CALLER, "state": {"a": 1}}
    await api.call("POST", "/v1/projects/victim/conversations/seed/end", token=victim["agent"], json=body)
    return {"victim": victim, "other": other}


async def test_every_endpoint_hides_a_project_from_other_projects_tokens(
    api: Api, tenants: dict[str, dict[str, str]]
) -> None:
    token_id = tenants["victim"]["agent"].split("_")[1]
    checked = 0
    for method, path, role in await operations(api):
        if role is None or "{project}" not in path:
            continue
        for token in tenants["other"].values():
            reply = await api.call(
                method.upper(), concrete(path, token_id), token=token, json=BODIES.get((method, path))
            )
            if role == "operator":
                assert_problem(reply, 403)  # operator-only: refused before any project is looked at
            else:
                assert_problem(reply, 404, mentions="project 'victim' not found")
            checked += 1
    assert checked >= 13 * 3  # every project endpoint, with each role of the other project
    # Nothing of the victim's changed: its memory, tokens and configuration are as they were.
    memory = await api.call(
        "GET", f"/v1/projects/victim/callers/{CALLER}/memory", token=tenants["victim"]["admin"]
    )
    assert memory.body["fields"] == {"a": 1}
    tokens = await api.call("GET", "/v1/projects/victim/tokens", token=tenants["victim"]["admin"])
    assert len(tokens.body["tokens"]) == 3


async def test_every_endpoint_checks_the_role(api: Api, tenants: dict[str, dict[str, str]]) -> None:
    token_id = tenants["victim"]["analytics"].split("_")[1]  # revoking it last would not matter
    for method, path, role in await operations(api):
        if role is None:
            continue
        for own_role in ("agent", "analytics", "admin"):
            if role != "operator" and role in GRANTS[own_role]:
                continue
            if method == "delete" and "tokens" in path:
                continue  # an allowed revoke would change the fixture; refusals are checked below
            reply = await api.call(
                method.upper(),
                concrete(path, token_id),
                token=tenants["victim"][own_role],
                json=BODIES.get((method, path)),
            )
            assert_problem(reply, 403)
        # Each operation's unauthenticated request is judged on its own: there are more operations than the
        # failed authentications one address may make in a minute (tests/http/test_api.py covers that).
        api.app[SERVICES].tokens.throttle = FailureThrottle()
        missing = await api.call(method.upper(), concrete(path, token_id), json=BODIES.get((method, path)))
        assert_problem(missing, 401)
    for own_role in ("agent", "analytics"):
        revoke = await api.call(
            "DELETE", f"/v1/projects/victim/tokens/{token_id}", token=tenants["victim"][own_role]
        )
        assert_problem(revoke, 403)


async def test_token_secrets_are_never_stored(
    api: Api, tenants: dict[str, dict[str, str]], store_url: str, request: pytest.FixtureRequest
) -> None:
    from tests.test_privacy import redis_blobs, sqlite_blobs

    if store_url.startswith("sqlite"):
        from pathlib import Path

        blobs, _ = sqlite_blobs(Path(store_url.removeprefix("sqlite:///")))
    elif store_url.startswith("redis+cluster"):
        blobs = {}
        for node in request.getfixturevalue("redis_cluster").primaries():
            blobs.update(redis_blobs(node)[0])
        assert any(key.startswith("cm:t:") for key in blobs)  # every primary was dumped, tokens included
    else:
        blobs, _ = redis_blobs(request.getfixturevalue("redis_server"))
    everything = b"\n".join(blobs.values())
    for tokens in tenants.values():
        for token in tokens.values():
            secret = token.split("_", 2)[2]
            assert secret.encode() not in everything and token.encode() not in everything
    assert OPERATOR_TOKEN.encode() not in everything
