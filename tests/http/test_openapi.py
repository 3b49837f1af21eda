"""The OpenAPI document: valid 3.1, in step with the routes the app registers, and true to what it answers."""

from __future__ import annotations

import asyncio
import importlib.metadata
import io
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from caller_memory.sdk.testing import ScriptedModel
from caller_memory.service.app import create_app
from caller_memory.service.config import Settings
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.limits import MAX_BODY_BYTES
from caller_memory.service.domain.retention import SWEEP_LEASE
from caller_memory.service.domain.store.webhooks import Delivery, Settlement
from caller_memory.service.domain.tokens import FailureThrottle
from caller_memory.service.domain.webhooks.views import EVENTS
from caller_memory.service.http.access_log import RouteAccessLogger
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.http.openapi import build_openapi
from caller_memory.service.http.operations import documented_operations
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from tests.http import openapi_mcp, openapi_platforms

METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
PUBLIC = {
    "/healthz",
    "/readyz",
    "/openapi.json",
    "/metrics",
    "/dashboard",
    "/dashboard/{asset}",
    "/favicon.ico",
    # Signed by the platform with the connection's secret, no bearer token (tests/http/openapi_platforms.py;
    # Vapi's takes a platform token instead when its connection says `auth: bearer`, as its description says).
    *openapi_platforms.SIGNED,
}
OPERATOR = "operator-token-for-openapi-tests"
CALLER = "/v1/projects/shop/callers/+14155550100"


@pytest.fixture
def doc() -> dict[str, Any]:
    return build_openapi()


def make_app(tmp_path: Path) -> web.Application:
    # A fake clock, which the walkthrough moves to see transcripts expire.
    return create_app(
        Settings(
            pseudonym_key=b"x" * 32,
            store_url=f"sqlite:///{tmp_path}/t.db",
            operator_token=OPERATOR,
            secret_key=b"k" * 32,
            webhook_allow_hosts=("127.0.0.1",),
            webhook_interval=0,  # no delivery worker: the walkthrough makes a failed delivery itself
        ),
        clock=FakeClock(),
    )


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield method, path, item, op


def resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = doc
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def test_document_is_valid_openapi_3_1(doc: dict[str, Any]) -> None:
    validate(doc)
    assert doc["openapi"] == "3.1.0"
    assert doc["info"]["title"] == "Caller Memory"
    assert doc["info"]["version"] == importlib.metadata.version("caller-memory")


def test_every_registered_route_is_documented_and_nothing_else(tmp_path: Path, doc: dict[str, Any]) -> None:
    app = make_app(tmp_path)
    registered = {
        (route.method.lower(), route.resource.canonical): route.handler.__name__
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    documented = {(method, path): op["operationId"] for method, path, _, op in operations(doc)}
    assert set(registered) == set(documented)
    assert registered == documented, "operationId is the handler's name"


def test_authentication_and_roles_are_documented(doc: dict[str, Any]) -> None:
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": doc["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    for method, path, _, op in operations(doc):
        security = op.get("security", doc["security"])
        if path in PUBLIC:
            assert security == [], (method, path)
            continue
        assert security == [{"bearerAuth": []}], (method, path)
        assert {"401", "403"} <= set(op["responses"]), (method, path)
        assert op["x-required-role"] in {"operator", "admin", "agent", "analytics", "platform"}
        assert f"**{op['x-required-role']}**" in op["description"]
        unauthenticated = resolve(doc, op["responses"]["401"])
        assert "WWW-Authenticate" in unauthenticated["headers"]


def test_every_path_parameter_is_declared(doc: dict[str, Any]) -> None:
    for method, path, item, op in operations(doc):
        declared = [resolve(doc, p) for p in item.get("parameters", []) + op.get("parameters", [])]
        in_path = {p["name"] for p in declared if p["in"] == "path"}
        assert in_path == set(re.findall(r"\{(\w+)\}", path)), (method, path)
        assert all(p["required"] for p in declared if p["in"] == "path")


def test_errors_are_problem_documents_and_refs_resolve(doc: dict[str, Any]) -> None:
    for method, path, _, op in operations(doc):
        for status, response in op["responses"].items():
            content = resolve(doc, response).get("content", {})
            # The memory proxy's 502 is OpenAI's error shape, which OpenAI clients read (docs/proxy.md).
            openai_shaped = path.endswith("/chat/completions") and status == "502"
            # The MCP endpoint answers its errors as JSON-RPC error objects, which MCP clients read.
            json_rpc = path.endswith("/mcp")
            if status.startswith(("4", "5")) and path != "/readyz" and not openai_shaped and not json_rpc:
                assert list(content) == ["application/problem+json"], (method, path, status)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                resolve(doc, node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)


# Against a real server --------------------------------------------------------------------------------------


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    server = TestServer(make_app(tmp_path))
    # Started here so that the runner gets the service's access logger (aiohttp's own logs full paths).
    await server.start_server(access_log_class=RouteAccessLogger)
    async with TestClient(server) as client:
        yield client


async def test_served_document_is_build_openapi(client: TestClient[web.Request, web.Application]) -> None:
    resp = await client.get("/openapi.json")
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert await resp.json() == build_openapi()


class Checker:
    """Sends requests and checks each answer against the document: status, content type, headers (present,
    and of their schema), body (of its schema). Records which (operationId, status) pairs it has seen."""

    def __init__(
        self,
        client: TestClient[web.Request, web.Application],
        doc: dict[str, Any],
        seen: set[tuple[str, str]] | None = None,
    ) -> None:
        self.client = client
        self.doc = doc
        self.seen: set[tuple[str, str]] = set() if seen is None else seen

    async def __call__(
        self, method: str, template: str, path: str, status: int, *, token: str | None = OPERATOR, **kw: Any
    ) -> Any:
        headers = kw.pop("headers", {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with self.client.request(method, path, headers=headers, **kw) as resp:
            raw = await resp.read()
            assert resp.status == status, (method, path, raw)
            op = self.doc["paths"][template][method.lower()]
            documented = resolve(self.doc, op["responses"][str(status)])
            for name, header in documented.get("headers", {}).items():
                if name in OPTIONAL_HEADERS and name not in resp.headers:
                    continue
                assert name in resp.headers, (method, template, status, name)
                Draft202012Validator(resolve(self.doc, header)["schema"]).validate(resp.headers[name])
            self.seen.add((op["operationId"], str(status)))
            if "content" not in documented:
                assert not raw
                return None
            media = documented["content"][resp.content_type]
            schema = {**media["schema"], "components": self.doc["components"]}
            json_like = resp.content_type.endswith("json")
            body = await resp.json(content_type=None) if json_like else raw.decode()
            Draft202012Validator(schema, format_checker=FORMATS).validate(body)
            return body


#: Headers the document declares for an answer that some answers of that status do not carry (the last page).
OPTIONAL_HEADERS = {"X-Next-Cursor", "Link"}
FORMATS = Draft202012Validator.FORMAT_CHECKER
PATH_VALUES = {
    "project": "shop",
    "identifier": "+14155550100",
    "field": "a",
    "token_id": "0123456789ab",
    "conversation_id": "call-1",
    "asset": "dashboard.js",
    "webhook_id": "wh_0123456789abcdef",
    "delivery_id": "msg_nothing",
    "other": "email:ada@example.com",
    "platform": "agora",
}
#: A body each operation that takes one accepts.
BODIES: dict[str, Any] = {
    "put_project": {"memory": {"repeat_caller": {"state_keys": ["a", "b"]}}},
    "create_token": {"role": "agent"},
    "mcp_post": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
    "patch_memory": {"a": 1},
    "end_conversation": {"caller": "+14155550100"},
    "start_conversation": {"caller": "+14155550100", "channel": "voice"},
    "append_messages": {"messages": []},
    "put_summary": {"text": "A summary.", "through_turn": 0},
    "raise_trust": {"step_up": True},
    "create_webhook": {"url": "http://127.0.0.1:9/hook", "events": ["caller.erased"]},
    "rotate_webhook": {},
    "create_link": {"identifier": "email:ada@example.com"},
    "put_connection": {"secret": "s3cret", "state_map": {"name": "a"}},
    "put_llm": {"base_url": "http://127.0.0.1:9/v1", "api_key": "k"},
    "chat_completions": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    "chat_completions_doubled": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    "elevenlabs_initiation": {"caller_id": "+14155550100", "agent_id": "agent-1", "call_sid": "CA1"},
}


async def link_walkthrough(check: Checker, config: dict[str, Any]) -> None:
    """Linked identifiers: off (403), on; linked, renewed, refused (409, 422); listed; unlinked (and 404)."""
    links, link = (
        "/v1/projects/{project}/callers/{identifier}/links",
        "/v1/projects/{project}/callers/{identifier}/links/{other}",
    )
    email = {"identifier": "email:ada@example.com"}
    await check("POST", links, CALLER + "/links", 403, json=email)
    config["memory"]["repeat_caller"]["identity_linking"] = True
    await check("PUT", "/v1/projects/{project}", "/v1/projects/shop", 200, json=config)
    await check("POST", links, CALLER + "/links", 201, json=email)
    await check("POST", links, CALLER + "/links", 200, json=email)
    await check("POST", links, CALLER + "/links", 422, json={"identifier": "email:nobody"})
    with_memory = {"caller": "account:B-7", "state": {"a": 1}}
    await check(
        "POST", "/v1/projects/{project}/conversations/{conversation_id}/end",
        "/v1/projects/shop/conversations/acct-1/end", 200, json=with_memory,
    )  # fmt: skip
    await check("POST", links, CALLER + "/links", 409, json={"identifier": "account:B-7"})
    await check("GET", links, CALLER + "/links", 200)
    await check("GET", links, "/v1/projects/shop/callers/12/links", 422)
    await check("DELETE", link, CALLER + "/links/email:ada@example.com", 200)
    await check("DELETE", link, CALLER + "/links/email:ada@example.com", 404)
    await check("DELETE", link, CALLER + "/links/email:nobody", 422)


def concrete(template: str, **values: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m[1], PATH_VALUES[m[1]]), template)


async def current_etag(client: TestClient[web.Request, web.Application]) -> str:
    async with client.get(CALLER + "/memory", headers={"Authorization": f"Bearer {OPERATOR}"}) as resp:
        return resp.headers["ETag"]


async def mint(client: TestClient[web.Request, web.Application], role: str) -> str:
    async with client.post(
        "/v1/projects/shop/tokens", json={"role": role}, headers={"Authorization": f"Bearer {OPERATOR}"}
    ) as resp:
        assert resp.status == 201
        token: str = (await resp.json())["token"]
        return token


async def test_answers_match_the_document(
    client: TestClient[web.Request, web.Application], doc: dict[str, Any], tmp_path: Path
) -> None:
    """Every documented answer of every operation that a client can provoke, checked against its schema:
    each operation's own outcomes through a walkthrough of the API, then the answers all authenticated
    operations share on every one of them, then overload and slow bodies. What no test here can reach is
    listed in UNREACHED, and nothing else is left out."""
    check = Checker(client, doc)
    await walkthrough(check, client)
    await check_shared_answers(check, client)
    await check_overloaded_and_slow(check.seen, doc, tmp_path)
    documented = {(op["operationId"], status) for *_, op in operations(doc) for status in op["responses"]}
    assert documented - check.seen == unreached(doc)
    assert check.seen >= {
        (op["operationId"], s) for *_, op in operations(doc) for s in OWN[op["operationId"]]
    }


def unreached(doc: dict[str, Any]) -> set[tuple[str, str]]:
    """What the test above cannot provoke: an unexpected error or a store holding data this version cannot
    read (500); a store that does not answer (readyz's 503); a header value that is not UTF-8 on an
    operation with neither a body nor an entity-tag header (400: aiohttp's client sends only UTF-8, and
    tests/http/test_bad_input.py sends such headers on a raw socket)."""
    out = {("readyz", "503")} | {(name, "503") for name in PROXY_STREAMS}
    for _, _, op in authenticated(doc):
        out.add((op["operationId"], "500"))
        if op["operationId"] not in BODIES and op["operationId"] not in ENTITY_TAGS:
            out.add((op["operationId"], "400"))
    return out


#: The memory proxy's completions: never counted among the requests in flight (their 503 is a store that does
#: not answer while authenticating, which no test here provokes).
PROXY_STREAMS = {"chat_completions", "chat_completions_doubled"}
#: Operations whose body may be as large as CALLER_MEMORY_PLATFORM_MAX_BODY allows.
PLATFORM_BODIES = PROXY_STREAMS | {"elevenlabs_initiation"}
#: Operations that read If-Match or If-None-Match (a malformed one is a 400).
ENTITY_TAGS = {"read_memory", "patch_memory", "delete_field", "conversation_history"}


async def walkthrough(check: Checker, client: TestClient[web.Request, web.Application]) -> None:
    project, tokens, memory, field = (
        "/v1/projects/{project}",
        "/v1/projects/{project}/tokens",
        "/v1/projects/{project}/callers/{identifier}/memory",
        "/v1/projects/{project}/callers/{identifier}/memory/{field}",
    )
    end, conversations, report, audit, sweeps = (
        "/v1/projects/{project}/conversations/{conversation_id}/end",
        "/v1/projects/{project}/analytics/conversations",
        "/v1/projects/{project}/analytics/repeat-callers",
        "/v1/projects/{project}/audit",
        "/v1/admin/sweeps",
    )
    rc: dict[str, Any] = {
        "state_keys": ["a", "b"],
        "identifier_blacklist": ["+14155550199"],
        "analytics_enabled": True,
    }
    config = {"memory": {"repeat_caller": rc, "conversation": {"enabled": True, "transcript_retention": 60}}}
    await check("GET", "/healthz", "/healthz", 200, token=None)
    await check("GET", "/readyz", "/readyz", 200, token=None)
    await check("GET", "/openapi.json", "/openapi.json", 200, token=None)
    await check("GET", "/metrics", "/metrics", 200, token=None)
    await check("PUT", project, "/v1/projects/shop", 201, json=config)
    rc["field_ttls"] = {"a": 3600, "b": "PT2H"}
    await check("PUT", project, "/v1/projects/shop", 200, json=config)
    await check("GET", project, "/v1/projects/shop", 200)

    minted = await check("POST", tokens, "/v1/projects/shop/tokens", 201, json={"role": "agent"})
    await check("POST", tokens, "/v1/projects/shop/tokens", 422, json={"role": "boss"})
    await check("GET", tokens, "/v1/projects/shop/tokens", 200)

    etag = await current_etag(client)
    await check("PATCH", memory, CALLER + "/memory", 200, json={"a": {"n": 1}, "b": None})
    await check("PATCH", memory, CALLER + "/memory", 412, json={"a": 2}, headers={"If-Match": etag})
    await check("PATCH", memory, CALLER + "/memory", 422, json={"zz": 1})
    await check("GET", memory, "/v1/projects/shop/callers/12/memory", 422)
    body = await check("GET", memory, CALLER + "/memory", 200, token=minted["token"])
    assert body["fields"] == {"a": {"n": 1}} and body["expires_at"] is not None
    etag = await current_etag(client)
    await check("GET", memory, CALLER + "/memory", 304, headers={"If-None-Match": etag})
    await check("GET", memory, CALLER + "/memory", 400, headers={"If-None-Match": "not-a-tag"})
    await check("PATCH", memory, CALLER + "/memory", 400, json={"a": 1}, headers={"If-Match": "x"})
    await check("GET", memory, "/v1/projects/shop/callers/+14155550199/memory", 200)
    await check("DELETE", field, CALLER + "/memory/a", 412, headers={"If-Match": '"stale"'})
    await check("DELETE", field, CALLER + "/memory/a", 400, headers={"If-Match": "x"})
    await check("DELETE", field, CALLER + "/memory/a", 200)
    await check("DELETE", field, CALLER + "/memory/9bad", 422)

    # Conversations: a first call, a repeat, a replay, a conflicting retry; the listing in pages and as CSV.
    first = {"caller": "+14155550100", "state": {"a": 1, "other": 2}, "outcome": {"qa": "resolved"}}
    ended = await check("POST", end, "/v1/projects/shop/conversations/call-1/end", 200, json=first)
    assert ended["repeat_caller"] == {} and ended["ignored"] == ["other"]
    ended = await check("POST", end, "/v1/projects/shop/conversations/call-2/end", 200, json=first)
    assert ended["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "call-1"
    await check("POST", end, "/v1/projects/shop/conversations/call-2/end", 200, json=first)
    await check(
        "POST", end, "/v1/projects/shop/conversations/call-2/end", 409, json={"caller": "+14155550101"}
    )
    await check("POST", end, "/v1/projects/shop/conversations/call-3/end", 422, json={"caller": "12"})
    page = await check("GET", conversations, "/v1/projects/shop/analytics/conversations?limit=1", 200)
    assert page["next_cursor"] is not None and page["conversations"][0]["repeat"] is True
    last = await check(
        "GET", conversations, f"/v1/projects/shop/analytics/conversations?cursor={page['next_cursor']}", 200
    )
    assert last["next_cursor"] is None and last["conversations"][0]["REPEAT_CALLER_DATETIME"] is None
    as_csv = {"Accept": "text/csv"}
    text = await check("GET", conversations, "/v1/projects/shop/analytics/conversations", 200, headers=as_csv)
    assert text.splitlines()[0].startswith("conversation_id,ended_at,")
    await check("GET", conversations, "/v1/projects/shop/analytics/conversations?order=up", 422)
    summary = await check("GET", report, "/v1/projects/shop/analytics/repeat-callers?interval=hour", 200)
    assert summary["totals"]["repeat_conversations"] == 1
    await check("GET", report, "/v1/projects/shop/analytics/repeat-callers?interval=year", 422)

    await transcript_walkthrough(check, client)
    await webhook_walkthrough(check, client)
    await link_walkthrough(check, config)
    await platform_walkthrough(check)
    await openapi_platforms.walkthrough(
        check, client.app[SERVICES].clock.now_ms(), client.app[SERVICES].settings.platform_max_body
    )
    await llm_walkthrough(check)
    await openapi_mcp.walkthrough(check)

    await check("DELETE", "/v1/projects/{project}/callers/{identifier}", CALLER, 200)
    records = await check("GET", audit, "/v1/projects/shop/audit?limit=1", 200)
    assert records["next_cursor"] is not None
    await check("GET", audit, "/v1/projects/shop/audit?before=x", 422)
    await check("DELETE", tokens + "/{token_id}", f"/v1/projects/shop/tokens/{minted['token_id']}", 204)
    await check("DELETE", tokens + "/{token_id}", f"/v1/projects/shop/tokens/{minted['token_id']}", 404)

    await check("POST", sweeps, sweeps, 200)
    await check("GET", sweeps, sweeps, 200)
    await check("GET", sweeps, f"{sweeps}?limit=0", 422)
    services = client.app[SERVICES]
    assert await services.store.acquire_lease(SWEEP_LEASE, "another-replica", services.clock.now_ms(), 60_000)
    await check("POST", sweeps, sweeps, 409)

    for template, path in (
        ("/dashboard", "/dashboard"),
        ("/favicon.ico", "/favicon.ico"),
        ("/dashboard/{asset}", "/dashboard/dashboard.js"),
    ):
        async with client.get(path) as resp:
            tag = resp.headers["ETag"]
        await check("GET", template, path, 200, token=None)
        await check("GET", template, path, 304, token=None, headers={"If-None-Match": tag})
    await check("GET", "/dashboard/{asset}", "/dashboard/nope.js", 404, token=None)


async def transcript_walkthrough(check: Checker, client: TestClient[web.Request, web.Application]) -> None:
    """Conversation memory's operations, each to its own outcomes (the project has it on, with a transcript
    retention of a minute: the clock is moved past it to see 410s)."""
    one = "/v1/projects/{project}/conversations/{conversation_id}"
    start, append, history, summary, context = (
        one + suffix for suffix in ("/start", "/messages", "/history", "/summary", "/context")
    )
    listing = "/v1/projects/{project}/callers/{identifier}/conversations"
    base = "/v1/projects/shop/conversations/"
    who = {"caller": "+14155550100", "channel": "voice"}
    other = {"caller": "+14155550101", "channel": "voice"}
    hello = {"role": "user", "content": "Hello", "turn_id": 1}
    await check("POST", start, base + "t-1/start", 200, json={**who, "agent": "booking"})
    await check("POST", start, base + "t-1/start", 409, json=other)
    await check("POST", start, base + "t-1/start", 422, json={"caller": "+14155550100"})
    await check("POST", append, base + "t-1/messages", 200, json={"messages": [hello], "state": {"a": 1}})
    await check("POST", append, base + "t-0/messages", 404, json={"messages": [hello]})
    await check("POST", append, base + "t-1/messages", 409, json={**other, "messages": [hello]})
    await check(
        "POST", append, base + "t-1/messages", 413, json={"messages": [{**hello, "content": "x" * 20_000}]}
    )
    await check("POST", append, base + "t-1/messages", 422, json={"messages": [{**hello, "turn_id": 0}]})
    await check("GET", one, base + "t-1", 200)
    await check("GET", one, base + "t-0", 404)
    await check("GET", one, base + "bad!", 422)
    await check("GET", history, base + "t-1/history", 200)
    await check("GET", history, base + "t-1/history?format=openai", 200)
    async with client.get(base + "t-1/history", headers={"Authorization": f"Bearer {OPERATOR}"}) as resp:
        tag = resp.headers["ETag"]
    await check("GET", history, base + "t-1/history", 304, headers={"If-None-Match": tag})
    await check("GET", history, base + "t-1/history", 400, headers={"If-None-Match": "nope"})
    await check("GET", history, base + "t-0/history", 404)
    await check("GET", history, base + "t-1/history?limit=0", 422)
    await check("PUT", summary, base + "t-1/summary", 200, json={"text": "Said hello.", "through_turn": 1})
    await check("PUT", summary, base + "t-0/summary", 404, json={"text": "x", "through_turn": 0})
    await check("PUT", summary, base + "t-1/summary", 422, json={"text": "x", "through_turn": 5})
    trust = one + "/trust"
    await check("POST", trust, base + "t-1/trust", 204, json={"step_up": True})
    await check("POST", trust, base + "t-0/trust", 404, json={"step_up": True})
    await check("POST", trust, base + "t-1/trust", 422, json={"step_up": False})
    await check("GET", context, base + "t-1/context?max_tokens=100", 200)
    await check("GET", context, base + "t-0/context", 404)
    await check("GET", context, base + "t-1/context?max_tokens=0", 422)
    await check("GET", listing, CALLER + "/conversations", 200)
    await check("GET", listing, "/v1/projects/shop/callers/12/conversations", 422)
    end = {"caller": "+14155550100", "end_reason": "dropped"}
    ended = await check("POST", one + "/end", base + "t-1/end", 200, json=end)
    assert ended["late"] is False
    await check("POST", append, base + "t-1/messages", 409, json={"messages": [{**hello, "turn_id": 2}]})
    await check("POST", one + "/trust", base + "t-1/trust", 409, json={"step_up": True})
    # A callback is offered the dropped call.
    resumed = await check("POST", start, base + "t-2/start", 200, json=who)
    assert resumed["resume"]["conversation_id"] == "t-1"
    await check("DELETE", one, base + "t-2", 204)
    await check("DELETE", one, base + "t-2", 404)
    await check("DELETE", one, base + "bad!", 422)
    client.app[SERVICES].clock.advance(61)  # type: ignore[attr-defined]
    for method, template, what, body in (
        ("POST", start, "start", who),
        ("POST", append, "messages", {"messages": [hello]}),
        ("GET", one, "", None),
        ("GET", history, "history", None),
        ("PUT", summary, "summary", {"text": "x", "through_turn": 0}),
        ("GET", context, "context", None),
    ):
        await check(method, template, base + "t-1" + (f"/{what}" if what else ""), 410, json=body)
    # A project at its bound for transcripts.
    small = {
        "memory": {
            "repeat_caller": {"state_keys": ["a"]},
            "conversation": {"enabled": True, "max_transcript_bytes": 1024},
        }
    }
    await check("PUT", "/v1/projects/{project}", "/v1/projects/full", 201, json=small)
    big = {**who, "messages": [{**hello, "content": "x" * 1100}]}
    await check("POST", append, "/v1/projects/full/conversations/f-1/messages", 200, json=big)
    await check(
        "POST",
        append,
        "/v1/projects/full/conversations/f-1/messages",
        507,
        json={"messages": [{**hello, "turn_id": 2}]},
    )


async def webhook_walkthrough(check: Checker, client: TestClient[web.Request, web.Application]) -> None:
    """The webhook operations, each to its own outcomes (a failed delivery is made through the store: this
    app runs no delivery worker)."""
    hooks, one = "/v1/projects/{project}/webhooks", "/v1/projects/{project}/webhooks/{webhook_id}"
    deliveries = hooks + "/deliveries"
    redeliver = deliveries + "/{delivery_id}/redeliver"
    base = "/v1/projects/shop/webhooks"
    body = {"url": "http://127.0.0.1:9/hook", "events": ["conversation.ended"]}
    created = await check("POST", hooks, base, 201, json=body)
    await check("POST", hooks, base, 422, json={**body, "url": "https://169.254.169.254/"})
    for n in range(9):
        await check("POST", hooks, base, 201, json={**body, "description": f"n{n}"})
    await check("POST", hooks, base, 409, json=body)
    await check("GET", hooks, base, 200)
    path = f"{base}/{created['webhook_id']}"
    missing = f"{base}/wh_0000000000000000"
    await check("GET", one, path, 200)
    await check("GET", one, missing, 404)
    await check("POST", one + "/rotate", path + "/rotate", 200, json={"grace_seconds": 60})
    await check("POST", one + "/rotate", path + "/rotate", 422, json={"grace_seconds": -1})
    await check("POST", one + "/rotate", missing + "/rotate", 404, json={})
    services = client.app[SERVICES]
    now = services.clock.now_ms()
    delivery = Delivery(
        "shop", "msg_walk", created["webhook_id"], "conversation.ended", b"{}", "", now, now + 60_000_000
    )
    assert await services.store.enqueue_deliveries([delivery], None, now, now)
    [claimed] = await services.store.claim_deliveries(
        "shop", created["webhook_id"], now, 1, owner="me", lease_until=now + 1000
    )
    await services.store.settle_delivery(
        "shop", claimed.delivery_id, "me", Settlement.FAILED, now, error="HTTP 500"
    )
    listed = await check("GET", deliveries, base + "/deliveries", 200)
    assert [d["delivery_id"] for d in listed["deliveries"]] == ["msg_walk"]
    await check("GET", deliveries, base + "/deliveries?webhook_id=wh_0000000000000000", 404)
    await check("GET", deliveries, base + "/deliveries?limit=0", 422)
    await check("POST", redeliver, base + "/deliveries/msg_walk/redeliver", 202)
    await check("POST", redeliver, base + "/deliveries/msg_none/redeliver", 404)
    await check("DELETE", one, path, 204)
    await check("DELETE", one, path, 404)


async def platform_walkthrough(check: Checker) -> None:
    """Platform connections: made (201), changed (200), refused (422: an unknown platform, a state key the
    project lacks), read, deleted; then 404."""
    one, path = "/v1/projects/{project}/platforms/{platform}", "/v1/projects/shop/platforms/agora"
    body = {"secret": "s3cret", "state_map": {"name": "a"}}
    await check("PUT", one, path, 201, json=body)
    await check("PUT", one, path, 200, json={"channel": "sip"})
    await check("PUT", one, path, 422, json={"state_map": {"name": "zz"}})
    await check("PUT", one, "/v1/projects/shop/platforms/twilio", 422, json=body)
    await check("GET", one, path, 200)
    await check("GET", one, "/v1/projects/shop/platforms/twilio", 422)
    await check("DELETE", one, "/v1/projects/shop/platforms/twilio", 422)
    await check("DELETE", one, path, 204)
    await check("DELETE", one, path, 404)
    await check("GET", one, path, 404)


async def llm_walkthrough(check: Checker) -> None:
    """The memory proxy: the upstream set (201, 200, 422), read; completions through it (200), refused (422),
    to an upstream nobody listens on (502), under both paths; the upstream removed (204, 404), then 404."""
    one, completions = "/v1/projects/{project}/llm", "/v1/projects/{project}/llm/chat/completions"
    doubled = completions + "/chat/completions"
    path = "/v1/projects/shop/llm"
    body = BODIES["chat_completions"]
    async with ScriptedModel(["Hello.", "Hello again."]) as model:
        await check("PUT", one, path, 201, json={"base_url": model.base_url, "api_key": "k"})
        await check("PUT", one, path, 200, json={"base_url": model.base_url, "api_key": "k", "timeout": 5})
        await check("PUT", one, path, 422, json={"base_url": "https://10.0.0.1/v1", "api_key": "k"})
        await check("GET", one, path, 200)
        await check("POST", completions, path + "/chat/completions", 200, json=body)
        await check("POST", doubled, path + "/chat/completions/chat/completions", 200, json=body)
        await check("POST", completions, path + "/chat/completions", 422, json={"messages": []})
    await check("PUT", one, path, 200, json=BODIES["put_llm"])
    await check("POST", completions, path + "/chat/completions", 502, json=body)
    await check("POST", doubled, path + "/chat/completions/chat/completions", 502, json=body)
    await check("DELETE", one, path, 204)
    await check("DELETE", one, path, 404)
    await check("GET", one, path, 404)


#: Each operation's own outcomes (what the walkthrough above must reach); the answers every authenticated
#: operation shares are checked on every operation by check_shared_answers and the overload tests.
OWN: dict[str, set[str]] = {
    "healthz": {"200"},
    "readyz": {"200"},
    "openapi": {"200"},
    "metrics": {"200"},
    "dashboard": {"200", "304"},
    "favicon": {"200", "304"},
    "dashboard_asset": {"200", "304", "404"},
    "put_project": {"200", "201"},
    "get_project": {"200"},
    "create_token": {"201", "422"},
    "list_tokens": {"200"},
    "revoke_token": {"204", "404"},
    "read_memory": {"200", "304", "400", "422"},
    "patch_memory": {"200", "400", "412", "422"},
    "delete_field": {"200", "400", "412", "422"},
    "erase_caller": {"200"},
    "end_conversation": {"200", "409", "422"},
    "start_conversation": {"200", "409", "410", "422"},
    "append_messages": {"200", "404", "409", "410", "413", "422", "507"},
    "conversation_status": {"200", "404", "410", "422"},
    "delete_conversation": {"204", "404", "422"},
    "conversation_history": {"200", "304", "400", "404", "410", "422"},
    "put_summary": {"200", "404", "410", "422"},
    "raise_trust": {"204", "404", "409", "422"},
    "conversation_context": {"200", "404", "410", "422"},
    "caller_conversations": {"200", "422"},
    "list_conversations": {"200", "422"},
    "repeat_callers": {"200", "422"},
    "list_audit": {"200", "422"},
    "run_sweep": {"200", "409"},
    "list_sweeps": {"200", "422"},
    "create_webhook": {"201", "409", "422"},
    "list_webhooks": {"200"},
    "get_webhook": {"200", "404"},
    "rotate_webhook": {"200", "404", "422"},
    "delete_webhook": {"204", "404"},
    "list_deliveries": {"200", "404", "422"},
    "redeliver": {"202", "404"},
    "create_link": {"200", "201", "403", "409", "422"},
    "list_links": {"200", "422"},
    "delete_link": {"200", "404", "422"},
    "put_connection": {"200", "201", "422"},
    "put_llm": {"200", "201", "422"},
    "get_llm": {"200", "404"},
    "delete_llm": {"204", "404"},
    "chat_completions": {"200", "422", "502"},
    "chat_completions_doubled": {"200", "502"},
    "get_connection": {"200", "404", "422"},
    "delete_connection": {"204", "404", "422"},
    **openapi_platforms.OWN,
    "mcp_post": openapi_mcp.OWN,
}
#: Which role a token needs to be refused (403) by an operation that requires a role.
TOO_WEAK = {
    "operator": "admin",
    "admin": "agent",
    "agent": "analytics",
    "analytics": "agent",
    "platform": "agent",
}


def authenticated(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for method, path, _, op in operations(doc):
        if "x-required-role" in op:
            yield method, path, op


async def check_shared_answers(check: Checker, client: TestClient[web.Request, web.Application]) -> None:
    """On every authenticated operation: no token (401), a token of too weak a role (403), an unknown
    project (404), a malformed project id (422); on every operation with a body: not JSON (400), too large
    (413), not JSON's media type (415); then, after too many failed authentications, 429."""
    tokens = {role: await mint(client, role) for role in ("admin", "agent", "analytics")}
    as_json = {"Content-Type": "application/json"}
    big = b'{"x": "' + b"y" * MAX_BODY_BYTES + b'"}'
    # Completions and a platform's hooks carry a call's history: CALLER_MEMORY_PLATFORM_MAX_BODY, 4 MiB by
    # default.
    platform_big = b'{"x": "' + b"y" * (4 * 1024 * 1024) + b'"}'
    for method, template, op in authenticated(check.doc):
        name, responses = op["operationId"], op["responses"]
        path, body = concrete(template), BODIES.get(op["operationId"])
        # Each 401 counts as a failed authentication of this address, and there are more operations than
        # the failures one address may make in a minute: each operation's is judged on its own.
        client.app[SERVICES].tokens.throttle = FailureThrottle()
        await check(method, template, path, 401, token=None, json=body)
        await check(method, template, path, 403, token=tokens[TOO_WEAK[op["x-required-role"]]], json=body)
        if "404" in responses and name != "revoke_token":
            await check(method, template, concrete(template, project="nope"), 404, json=body)
        if "{project}" in template:
            await check(method, template, concrete(template, project="Bad!"), 422, json=body)
        if body is not None:
            await check(method, template, path, 400, data=b"{", headers=dict(as_json))
            too_big = io.BytesIO(platform_big) if name in PLATFORM_BODIES else big
            await check(method, template, path, 413, data=too_big, headers=dict(as_json))
            await check(method, template, path, 415, data=b"{}", headers={"Content-Type": "text/plain"})
    for _ in range(25):  # beyond the failed authentications one address may make in a minute
        async with client.get("/v1/projects/shop", headers={"Authorization": "Bearer cm_000000000000_x"}):
            pass
    for method, template, op in authenticated(check.doc):
        path, body = concrete(template), BODIES.get(op["operationId"])
        await check(method, template, path, 429, token="cm_000000000000_nope", json=body)


def tight_app(tmp_path: Path, **settings: Any) -> web.Application:
    tmp_path.mkdir()
    return create_app(
        Settings(
            pseudonym_key=b"x" * 32,
            store_url=f"sqlite:///{tmp_path}/t.db",
            operator_token=OPERATOR,
            **settings,
        )
    )


async def stalled(release: asyncio.Event) -> AsyncIterator[bytes]:
    """A request body whose first byte comes, and the rest only once ``release`` is set."""
    yield b"{"
    await release.wait()
    yield b"}"


async def hold_a_slot(
    client: TestClient[web.Request, web.Application], project: str, refused: int
) -> tuple[asyncio.Event, asyncio.Future[ClientResponse]]:
    """A request of ``project`` in flight until the event is set: a PUT whose body stalls. The service has no
    signal for "request taken", so a probe checks it (it is refused with ``refused`` while the PUT holds its
    slot; the PUT is sent again if the probe took the slot first)."""
    auth = {"Authorization": f"Bearer {OPERATOR}", "Content-Type": "application/json"}
    probe_path = "/v1/admin/sweeps" if refused == 503 else f"/v1/projects/{project}"
    for _ in range(100):
        release = asyncio.Event()
        holder = asyncio.ensure_future(
            client.put(f"/v1/projects/{project}", data=stalled(release), headers=auth)
        )
        await asyncio.sleep(0.01)  # let the PUT reach the server first
        async with client.get(probe_path, headers=auth) as probe:
            if probe.status == refused and not holder.done():
                return release, holder
        release.set()
        (await holder).release()
    raise AssertionError("the stalled request never took the slot")


async def check_overloaded_and_slow(seen: set[tuple[str, str]], doc: dict[str, Any], tmp_path: Path) -> None:
    """503 on every /v1 operation while the service has its limit of requests in flight (here one, held
    by a body that does not arrive); 429 on the platforms' signed hooks while their project holds its share
    of them (the authenticated operations' 429 is check_shared_answers'); and 408 on every operation with a
    body that does not arrive in time."""
    async with TestClient(TestServer(tight_app(tmp_path / "tight", max_in_flight=1))) as client:
        check = Checker(client, doc, seen)
        release, holder = await hold_a_slot(client, "held", 503)
        for method, template, op in authenticated(doc):
            if op["operationId"] in PROXY_STREAMS:
                continue  # not counted in flight: the proxy's streams have a bound of their own
            await check(method, template, concrete(template), 503, json=BODIES.get(op["operationId"]))
        await openapi_platforms.refused(check, 503)
        release.set()
        async with await holder as resp:
            assert resp.status == 201, await resp.text()  # "{" then "}": an empty configuration
    share = tight_app(tmp_path / "share", max_in_flight=4, max_in_flight_per_project=1)
    async with TestClient(TestServer(share)) as client:
        check = Checker(client, doc, seen)
        release, holder = await hold_a_slot(client, "shop", 429)
        await openapi_platforms.refused(check, 429)
        release.set()
        async with await holder as resp:
            assert resp.status == 201, await resp.text()
    async with TestClient(TestServer(tight_app(tmp_path / "slow", body_timeout=0.2))) as client:
        check = Checker(client, doc, seen)
        await check("PUT", "/v1/projects/{project}", "/v1/projects/shop", 201, json=BODIES["put_project"])
        headers = {"Content-Type": "application/json"}
        for method, template, op in authenticated(doc):
            if op["operationId"] in BODIES:
                never = asyncio.Event()
                await check(
                    method, template, concrete(template), 408, data=stalled(never), headers=dict(headers)
                )
        await openapi_platforms.slow(check, stalled)


async def test_every_documented_query_range_is_what_the_api_accepts(
    client: TestClient[web.Request, web.Application], doc: dict[str, Any]
) -> None:
    """For every integer query parameter: its documented minimum and maximum are accepted, one past either
    is refused with 422 naming it (the document is generated from the models that validate the query)."""
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    config = {"memory": {"repeat_caller": {"state_keys": ["a"]}, "conversation": {"enabled": True}}}
    async with client.put("/v1/projects/shop", json=config, headers=auth):
        pass
    started = {"caller": "+14155550100", "channel": "voice"}
    async with client.post(
        "/v1/projects/shop/conversations/call-1/start", json=started, headers=auth
    ) as resp:
        assert resp.status == 200
    probed = 0
    for method, path, _, op in operations(doc):
        for parameter in op.get("parameters", []):
            parameter = resolve(doc, parameter)
            schema = parameter["schema"]
            if parameter["in"] != "query" or schema.get("type") != "integer":
                continue
            concrete = (
                path.replace("{project}", "shop")
                .replace("{conversation_id}", "call-1")
                .replace("{identifier}", "+14155550100")
            )
            low, high = schema["minimum"], schema["maximum"]
            for value, accepted in ((low, True), (high, True), (low - 1, False), (high + 1, False)):
                async with client.request(
                    method, f"{concrete}?{parameter['name']}={value}", headers=auth
                ) as resp:
                    body = await resp.json(content_type=None)
                    if accepted:
                        assert resp.status == 200, (path, parameter["name"], value, body)
                    else:
                        assert resp.status == 422 and body["errors"][0]["field"] == parameter["name"], body
            probed += 1
    # sweeps, audit, the conversation listing, a caller's conversations and the failed deliveries each have a
    # limit; history a limit and after_turn; context max_tokens
    assert probed == 8


def test_response_headers_and_tags_are_declared(doc: dict[str, Any]) -> None:
    declared_tags = {tag["name"] for tag in doc["tags"]}
    for _, path, _, op in operations(doc):
        assert set(op["tags"]) <= declared_tags, (path, op["tags"])
        for response in op["responses"].values():
            for header in resolve(doc, response).get("headers", {}).values():
                resolve(doc, header)  # every header reference resolves
    listing = doc["paths"]["/v1/projects/{project}/analytics/conversations"]["get"]["responses"]["200"]
    assert {"X-Next-Cursor", "Link"} <= set(listing["headers"])
    assert doc["paths"]["/v1/admin/sweeps"]["get"]["tags"] == ["operator"]
    entry = doc["components"]["schemas"]["ConversationRow"]["properties"]["REPEAT_CALLER_DATETIME"]
    assert [kind.get("format") for kind in entry["anyOf"]] == ["date-time", None]


def test_every_webhook_event_type_is_documented_once(doc: dict[str, Any]) -> None:
    assert list(doc["webhooks"]) == list(EVENTS)
    registration = doc["paths"]["/v1/projects/{project}/webhooks"]["post"]
    assert all(f"`{event}`" in registration["description"] for event in EVENTS)


def test_a_route_without_its_description_is_refused() -> None:
    table = web.RouteTableDef()

    @table.get("/undocumented")
    async def undocumented(request: web.Request) -> web.Response:
        raise AssertionError("never called")

    with pytest.raises(LookupError, match="GET /undocumented"):
        list(documented_operations([table]))
