"""The OpenAPI document: valid 3.1, in step with the routes the app registers, and true to what it answers."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from caller_memory.service.app import create_app
from caller_memory.service.config import Settings
from caller_memory.service.domain.limits import MAX_BODY_BYTES
from caller_memory.service.http.access_log import RouteAccessLogger
from caller_memory.service.http.openapi import build_openapi
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
PUBLIC = {
    "/healthz",
    "/readyz",
    "/openapi.json",
    "/metrics",
    "/dashboard",
    "/dashboard/{asset}",
    "/favicon.ico",
}
OPERATOR = "operator-token-for-openapi-tests"
CALLER = "/v1/projects/shop/callers/+14155550100"


@pytest.fixture
def doc() -> dict[str, Any]:
    return build_openapi()


def make_app(tmp_path: Path) -> web.Application:
    return create_app(
        Settings(pseudonym_key=b"x" * 32, store_url=f"sqlite:///{tmp_path}/t.db", operator_token=OPERATOR)
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
        assert op["x-required-role"] in {"operator", "admin", "agent", "analytics"}
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
            if status.startswith(("4", "5")) and path != "/readyz":
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
    """Sends requests and checks each answer against the document: status, content type, headers, body."""

    def __init__(self, client: TestClient[web.Request, web.Application], doc: dict[str, Any]) -> None:
        self.client = client
        self.doc = doc
        self.seen: set[tuple[str, str, str]] = set()

    async def __call__(
        self, method: str, template: str, path: str, status: int, *, token: str | None = OPERATOR, **kw: Any
    ) -> Any:
        headers = kw.pop("headers", {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with self.client.request(method, path, headers=headers, **kw) as resp:
            raw = await resp.read()
            assert resp.status == status, raw
            op = self.doc["paths"][template][method.lower()]
            documented = resolve(self.doc, op["responses"][str(status)])
            for name in documented.get("headers", {}):
                assert name in resp.headers, (method, template, status, name)
            body = await resp.json(content_type=None) if raw else None
            if "content" not in documented:
                assert not raw
                return body
            media = documented["content"][resp.content_type]
            schema = {**media["schema"], "components": self.doc["components"]}
            Draft202012Validator(schema).validate(body)
            self.seen.add((method, template, str(status)))
            return body


async def current_etag(client: TestClient[web.Request, web.Application]) -> str:
    async with client.get(CALLER + "/memory", headers={"Authorization": f"Bearer {OPERATOR}"}) as resp:
        return resp.headers["ETag"]


async def test_answers_match_the_document(
    client: TestClient[web.Request, web.Application], doc: dict[str, Any]
) -> None:
    check = Checker(client, doc)
    project, tokens, memory, field = (
        "/v1/projects/{project}",
        "/v1/projects/{project}/tokens",
        "/v1/projects/{project}/callers/{identifier}/memory",
        "/v1/projects/{project}/callers/{identifier}/memory/{field}",
    )
    rc: dict[str, Any] = {"state_keys": ["a", "b"], "identifier_blacklist": ["+14155550199"]}
    config = {"memory": {"repeat_caller": rc}}
    await check("GET", "/healthz", "/healthz", 200, token=None)
    await check("GET", "/readyz", "/readyz", 200, token=None)
    await check("PUT", project, "/v1/projects/shop", 201, json=config)
    rc["field_ttls"] = {"a": 3600, "b": "PT2H"}
    await check("PUT", project, "/v1/projects/shop", 200, json=config)
    await check("PUT", project, "/v1/projects/Bad!", 422, json=config)
    as_json = {"Content-Type": "application/json"}
    await check("PUT", project, "/v1/projects/shop", 400, data=b"{", headers=as_json)
    await check("PUT", project, "/v1/projects/shop", 415, data=b"{}", headers={"Content-Type": "text/plain"})
    big = b'{"x": "' + b"y" * MAX_BODY_BYTES + b'"}'
    await check("PUT", project, "/v1/projects/shop", 413, data=big, headers=as_json)
    await check("GET", project, "/v1/projects/shop", 200)
    await check("GET", project, "/v1/projects/nope", 404)
    await check("GET", project, "/v1/projects/shop", 401, token="cm_000000000000_nope")

    minted = await check("POST", tokens, "/v1/projects/shop/tokens", 201, json={"role": "agent"})
    await check("POST", tokens, "/v1/projects/shop/tokens", 422, json={"role": "boss"})
    await check("GET", tokens, "/v1/projects/shop/tokens", 200)
    await check("GET", project, "/v1/projects/shop", 403, token=minted["token"])
    await check("PUT", project, "/v1/projects/shop", 403, token=minted["token"], json=config)

    etag = await current_etag(client)
    await check("PATCH", memory, CALLER + "/memory", 200, json={"a": {"n": 1}, "b": None})
    await check("PATCH", memory, CALLER + "/memory", 412, json={"a": 2}, headers={"If-Match": etag})
    await check("PATCH", memory, CALLER + "/memory", 422, json={"zz": 1})
    await check("GET", memory, "/v1/projects/shop/callers/12/memory", 422)
    body = await check("GET", memory, CALLER + "/memory", 200, token=minted["token"])
    assert body["fields"] == {"a": {"n": 1}} and body["expires_at"] is not None
    etag = await current_etag(client)
    await check("GET", memory, CALLER + "/memory", 304, headers={"If-None-Match": etag})
    await check("GET", memory, "/v1/projects/shop/callers/+14155550199/memory", 200)
    await check("DELETE", field, CALLER + "/memory/a", 200)
    await check("DELETE", field, CALLER + "/memory/9bad", 422)
    await check("DELETE", "/v1/projects/{project}/callers/{identifier}", CALLER, 200)
    await check("DELETE", tokens + "/{token_id}", f"/v1/projects/shop/tokens/{minted['token_id']}", 204)
    await check("DELETE", tokens + "/{token_id}", f"/v1/projects/shop/tokens/{minted['token_id']}", 404)
    assert len(check.seen) >= 20


async def test_every_documented_query_range_is_what_the_api_accepts(
    client: TestClient[web.Request, web.Application], doc: dict[str, Any]
) -> None:
    """For every integer query parameter: its documented minimum and maximum are accepted, one past either
    is refused with 422 naming it (the document is generated from the models that validate the query)."""
    auth = {"Authorization": f"Bearer {OPERATOR}"}
    async with client.put(
        "/v1/projects/shop", json={"memory": {"repeat_caller": {"state_keys": ["a"]}}}, headers=auth
    ):
        pass
    probed = 0
    for method, path, _, op in operations(doc):
        for parameter in op.get("parameters", []):
            parameter = resolve(doc, parameter)
            schema = parameter["schema"]
            if parameter["in"] != "query" or schema.get("type") != "integer":
                continue
            concrete = path.replace("{project}", "shop")
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
    assert probed == 3  # sweeps, audit and the conversation listing each have a limit


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
    assert entry["format"] == "date-time"
