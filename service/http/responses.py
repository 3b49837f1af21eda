"""JSON and problem+json responses, serialised with orjson."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..logs import mask_text
from .bodies import Problem

PROBLEM_CONTENT_TYPE = "application/problem+json"


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, headers=headers, content_type="application/json"
    )


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v) for v in value]
    return value


def problem_response(
    status: int, title: str, detail: str, *, slug: str, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    """A problem document. Anything shaped like a phone number in it is masked: error messages may quote
    what the client sent (a field name, a project id), and what it sent may be a number."""
    problem: Problem = {
        "type": f"https://caller-memory.dev/problems/{slug}",
        "title": title,
        "status": status,
        "detail": detail,
    }
    body: dict[str, Any] = {**problem, **extra}  # extra: the members a problem type adds (``errors``)
    response = web.Response(body=orjson.dumps(_masked(body)), status=status, headers=headers)
    response.content_type = PROBLEM_CONTENT_TYPE
    return response


#: The JSON-RPC error code of a refusal by the service before MCP's server saw the request (JSON-RPC's range
#: for implementation-defined server errors).
SERVICE_REFUSED = -32001
#: The headers of a problem that its JSON-RPC form keeps.
_KEPT = ("WWW-Authenticate", "Retry-After", "Allow")


def json_rpc_error(problem: web.Response) -> web.Response:
    """A problem document as a JSON-RPC error object, at the same status with the same headers: what an MCP
    client reads (and shows) of an HTTP error; the problem itself is the error's ``data``."""
    document = orjson.loads(problem.body) if isinstance(problem.body, bytes) else {}
    error = {
        "code": SERVICE_REFUSED,
        "message": str(document.get("detail", problem.reason)),
        "data": document,
    }
    response = web.Response(
        body=orjson.dumps({"jsonrpc": "2.0", "id": None, "error": error}),
        status=problem.status,
        headers={name: problem.headers[name] for name in _KEPT if name in problem.headers},
        content_type="application/json",
    )
    if problem.keep_alive is False:
        response.force_close()
    return response
