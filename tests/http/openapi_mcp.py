"""The MCP endpoint in tests/http/test_openapi.py's walkthrough: its own outcomes (the shared answers of an
authenticated operation are checked by the walkthrough's loop). The operator token is an admin's, which
grants ``staff``: without a conversation header, a staff connection."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

MCP = "/v1/projects/{project}/mcp"
PATH = "/v1/projects/shop/mcp"
#: A client of the handshake era's protocol (a stateless server answers it without the handshake); the
#: tests of tests/mcp speak 2026-07-28 through the official client.
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


#: The endpoint's own outcomes, which the walkthrough reaches.
OWN = {"200", "202", "400", "403", "406", "413", "415", "422"}


class Check(Protocol):
    async def __call__(
        self, method: str, template: str, path: str, status: int, *, token: str | None = ..., **kw: Any
    ) -> Any: ...


def rpc(method: str, **params: Any) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})


async def walkthrough(check: Check) -> None:
    listed = await check("POST", MCP, PATH, 200, data=rpc("tools/list"), headers=dict(HEADERS))
    assert {t["name"] for t in listed["result"]["tools"]} == {
        "lookup_caller",
        "list_conversations",
        "read_transcript",
    }
    notice = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
    await check("POST", MCP, PATH, 202, data=notice, headers=dict(HEADERS))
    await check("POST", MCP, PATH, 400, data=b"[1, 2]", headers=dict(HEADERS))
    await check("POST", MCP, PATH, 406, data=rpc("tools/list"), headers=HEADERS | {"Accept": "text/plain"})
    await check(
        "POST", MCP, PATH, 413, data=b" " * (64 * 1024 + 1) + rpc("tools/list"), headers=dict(HEADERS)
    )
    await check(
        "POST", MCP, PATH, 415, data=rpc("tools/list"), headers=HEADERS | {"Content-Type": "text/plain"}
    )
    browser = HEADERS | {"Origin": "https://evil.example"}
    await check("POST", MCP, PATH, 403, data=rpc("tools/list"), headers=browser)
    # A conversation not started yet: its tools are listed (each call of one says it has not started).
    agent = HEADERS | {"X-Caller-Memory-Conversation": "not-started-yet"}
    listed = await check("POST", MCP, PATH, 200, data=rpc("tools/list"), headers=agent)
    assert {t["name"] for t in listed["result"]["tools"]} == {
        "get_caller_memory",
        "remember",
        "get_context",
        "get_history",
    }
    bad = HEADERS | {"X-Caller-Memory-Conversation": "no spaces"}
    await check("POST", MCP, PATH, 422, data=rpc("tools/list"), headers=bad)
