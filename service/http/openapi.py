"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``: its operations, their
descriptions and examples.

Written next to ``routes.py``; tests/http/test_openapi.py checks that both list the same operations. Nothing
about a body's shape is written here: ``components.schemas`` is generated from the typed bodies
(components.py), and the query parameters from the query models (queries.py).
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

from ..domain.limits import (
    CONVERSATION_ID_PATTERN,
    FIELD_NAME_PATTERN,
    MAX_BODY_BYTES,
    MAX_IDENTIFIER_CHARS,
    MAX_VALUE_BYTES,
    PROJECT_ID_PATTERN,
    TOKEN_ID_PATTERN,
)
from .components import component_schemas
from .dashboard import ASSETS, CONTENT_SECURITY_POLICY
from .queries import (
    AuditQuery,
    ConversationsQuery,
    QueryModel,
    RepeatCallersQuery,
    SweepsQuery,
    query_parameters,
)

Json = dict[str, Any]

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
PROBLEM = "application/problem+json"

ROLE_TEXT = {
    "operator": "Role: **operator** (the operator token only; a project token, whatever its role, gets 403).",
    "admin": "Role: **admin** (a token with role `admin` in this project, or the operator token).",
    "agent": "Role: **agent** (a token with role `agent` or `admin` in this project, or the operator token).",
    "analytics": "Role: **analytics** (a token with role `analytics` or `admin` in this project, or the operator "
    "token).",
}

AUTH_TEXT = (
    "`Authorization: Bearer <token>`. The **operator token** is set in the service's environment "
    "(`CALLER_MEMORY_OPERATOR_TOKEN`); it manages projects and may do anything a project admin may do in "
    "every project (so it can mint a project's first admin token). **Project tokens** "
    "(`cm_<token_id>_<secret>`) are minted per project and carry one role: `agent` (read memory), "
    "`analytics` (for the analytics endpoints) or `admin` (everything in the project). "
    "A project token sees nothing of another project: that project is reported as not found (404)."
)


def _version() -> str:
    try:
        return importlib.metadata.version("caller-memory")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def _ref(name: str, kind: str = "schemas") -> Json:
    return {"$ref": f"#/components/{kind}/{name}"}


# Parameters, headers, responses ---------------------------------------------------------------------------


def _parameters() -> dict[str, Json]:
    def path(name: str, description: str, schema: Json) -> Json:
        return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}

    def header(name: str, description: str) -> Json:
        return {"name": name, "in": "header", "description": description, "schema": {"type": "string"}}

    return {
        "project": path(
            "project",
            "Project id: 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit.",
            {"type": "string", "pattern": PROJECT_ID_PATTERN, "examples": ["cheese-shop"]},
        ),
        "identifier": path(
            "identifier",
            "The caller's phone number, percent-encoded: E.164 (`+14155550100`) or any form libphonenumber "
            "reads, national numbers with the project's `default_region`.",
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_IDENTIFIER_CHARS,
                "examples": ["+14155550100"],
            },
        ),
        "field": path(
            "field",
            "A field name.",
            {"type": "string", "pattern": FIELD_NAME_PATTERN, "examples": ["caller_name"]},
        ),
        "token_id": path("token_id", "A token id.", {"type": "string", "pattern": TOKEN_ID_PATTERN}),
        "conversation_id": path(
            "conversation_id",
            "The conversation id given by the voice platform; the end of a conversation is applied once per id.",
            {"type": "string", "pattern": CONVERSATION_ID_PATTERN, "examples": ["call-1"]},
        ),
        "asset": path(
            "asset",
            "A file of the dashboard page; only these names exist.",
            {"type": "string", "enum": sorted(ASSETS)},
        ),
        "If-Match": header(
            "If-Match",
            "Write only if the memory's ETag is one of these (`*`: if it has live fields); else 412.",
        ),
        "If-None-Match": header(
            "If-None-Match", "ETags the client holds: 304 without a body if one matches."
        ),
    }


def _headers() -> dict[str, Json]:
    return {
        "ETag": {"description": "Strong ETag of the caller's live memory.", "schema": {"type": "string"}},
        "Cache-Control": {"description": "`no-store`.", "schema": {"type": "string", "const": "no-store"}},
        "WWW-Authenticate": {"description": '`Bearer realm="caller-memory"`.', "schema": {"type": "string"}},
        "Retry-After": {
            "description": "Seconds to wait.",
            "required": True,
            "schema": {"type": "string", "pattern": "^[0-9]+$"},
        },
        "X-Next-Cursor": {
            "description": "The cursor of the next page (absent on the last page): `next_cursor` of the body.",
            "schema": {"type": "string"},
        },
        "Link": {
            "description": 'RFC 8288 link to the next page: `<...?cursor=...>; rel="next"` (absent on the last '
            "page).",
            "schema": {"type": "string"},
        },
        "X-Content-Type-Options": {
            "description": "`nosniff`, on every response.",
            "schema": {"type": "string", "const": "nosniff"},
        },
        "Idempotent-Replayed": {
            "description": "`true` when this answers a retry: nothing was applied again.",
            "schema": {"type": "string", "enum": ["true", "false"]},
        },
    }


def _response(description: str, schema: str | None = None, *headers: str, media: str = JSON) -> Json:
    response: Json = {"description": description}
    if headers:
        response["headers"] = {name: _ref(name, "headers") for name in headers}
    if schema is not None:
        response["content"] = {media: {"schema": _ref(schema)}}
    return response


def _problem(description: str, *headers: str) -> Json:
    return _response(description, "Problem", *headers, media=PROBLEM)


def _authenticated() -> dict[str, Json | None]:
    """What every authenticated operation may answer besides its own outcomes."""
    return {
        "400": _problem(
            "A header value is not valid UTF-8, or `If-Match` / `If-None-Match` is not a list of entity tags."
        ),
        "401": _problem("Missing, malformed or unknown bearer token.", "WWW-Authenticate"),
        "403": _problem("The token's role does not allow this operation."),
        "404": _problem("No such project, or the token belongs to another project."),
        "422": _problem("The project id is malformed."),
        "429": _problem(
            "Too many failed authentications from this address lately (this one failed too), or this "
            "project already has its share of the requests in flight; retry after `Retry-After` seconds. A "
            "valid token is never refused for others' failures.",
            "Retry-After",
        ),
        "500": _problem("Unexpected error (logged), or the store holds data this version cannot read."),
        "503": _problem(
            "The store did not answer in time, or the service has its limit of requests in flight (then "
            "with `Retry-After`)."
        ),
    }


def _body_errors() -> dict[str, Json | None]:
    return {
        "400": _problem("The body is empty or not valid JSON, or a header is malformed."),
        "408": _problem("The body did not arrive within the body timeout (CALLER_MEMORY_BODY_TIMEOUT)."),
        "413": _problem(f"The body is larger than {MAX_BODY_BYTES} bytes."),
        "415": _problem(
            f"The Content-Type is neither `{JSON}` nor `{MERGE_PATCH}`, or names a charset other than UTF-8."
        ),
    }


def _dashboard_file(description: str, *media: str) -> Json:
    """A file of the dashboard page, with the headers that keep the page to itself."""
    text = {"type": "string"}
    return {
        "description": description,
        "headers": {
            "Content-Security-Policy": {
                "description": "Only this origin's scripts, styles and API; no inline script; no form posts.",
                "schema": text | {"const": CONTENT_SECURITY_POLICY},
            },
            "X-Content-Type-Options": {"schema": text | {"const": "nosniff"}},
            "Cache-Control": {
                "description": "Revalidate with the ETag.",
                "schema": text | {"const": "no-cache"},
            },
            "ETag": {"description": "Of the file's content.", "schema": text},
        },
        "content": {m: {"schema": text | {"description": "UTF-8."}} for m in media},
    }


#: Request bodies as the README's walkthrough sends them (schemathesis' examples phase sends them too).
BODY_EXAMPLES: dict[str, Json] = {
    "ProjectConfig": {
        "memory": {
            "repeat_caller": {
                "state_keys": ["caller_name", "booking_day", "verified"],
                "retention": "P90D",
                "field_ttls": {"booking_day": "P7D"},
                "analytics_enabled": True,
            }
        }
    },
    "TokenCreate": {"role": "agent", "label": "cheese-shop agent prod"},
    "MemoryPatch": {"caller_name": "Ada", "booking_day": None},
    "EndRequest": {
        "caller": "+14155550100",
        "state": {"caller_name": "Ada", "mood": "happy"},
        "outcome": {"qa": "resolved"},
        "channel": "voice",
    },
}


def _body(schema: str, description: str, *media: str) -> Json:
    example = {"example": BODY_EXAMPLES[schema]} if schema in BODY_EXAMPLES else {}
    content = {m: {"schema": _ref(schema)} | example for m in media or (JSON,)}
    return {"required": True, "description": description, "content": content}


# Operations -----------------------------------------------------------------------------------------------

MEMORY_HEADERS = ("ETag", "Cache-Control")
BAD_CALLER = "The identifier is not a possible phone number"


def _op(
    operation_id: str,
    role: str | None,
    summary: str,
    responses: dict[str, Json | None],
    *,
    parameters: tuple[str, ...] = (),
    query: type[QueryModel] | None = None,
    body: Json | None = None,
    description: str = "",
) -> Json:
    op: Json = {"operationId": operation_id, "summary": summary}
    if role is None:
        op |= {"security": [], "description": description or summary}
    else:
        op["x-required-role"] = role
        op["description"] = f"{ROLE_TEXT[role]} {description}".strip()
        responses = _authenticated() | responses
    if parameters or query is not None:
        op["parameters"] = [_ref(name, "parameters") for name in parameters]
        op["parameters"] += query_parameters(query) if query is not None else []
    if body is not None:
        op["requestBody"] = body
    op["responses"] = {status: r for status, r in sorted(responses.items()) if r is not None}
    return op


def _operations() -> dict[tuple[str, str], Json]:
    stored = "StoredProjectConfig"
    precondition = _problem("If-Match did not match; `ETag` holds the current one.", "ETag")
    return {
        ("get", "/healthz"): _op("healthz", None, "Liveness", {"200": _response("Alive: `ok`.", "Health")}),
        ("get", "/metrics"): _op(
            "metrics",
            None,
            "Prometheus metrics",
            {
                "200": {
                    "description": "Requests by route template, method and status; latency histograms; store "
                    "errors; sweeps and what they removed; erasures. No label holds an identifier.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        ),
        ("post", "/v1/admin/sweeps"): _op(
            "run_sweep",
            "operator",
            "Run an expiry sweep now",
            {
                "200": _response("What the sweep removed and how long it took.", "SweepReport"),
                "404": None,
                "409": _problem("Another sweep holds the lease (on this or another replica)."),
                "422": None,
            },
            description="Removes expired fields, callers left empty, expired first-interaction records, "
            "conversation records and analytics entries, in bounded batches, for at most 30 seconds.",
        ),
        ("get", "/v1/admin/sweeps"): _op(
            "list_sweeps",
            "operator",
            "Recent sweeps",
            {
                "200": _response("The latest sweeps, newest first (at most 100 are kept).", "SweepList"),
                "404": None,
                "422": _problem("A malformed `limit`."),
            },
            query=SweepsQuery,
        ),
        ("get", "/v1/projects/{project}/audit"): _op(
            "list_audit",
            "admin",
            "Audit records: erasures, configuration and token changes",
            {
                "200": _response("Audit records, newest first.", "AuditList"),
                "422": _problem("A malformed `limit` or `before`."),
            },
            query=AuditQuery,
        ),
        ("get", "/readyz"): _op(
            "readyz",
            None,
            "Readiness: the store answers",
            {
                "200": _response("Ready.", "Health"),
                "503": _response("Not ready: `unready`, with a `detail` (not a problem document).", "Health"),
            },
        ),
        ("get", "/openapi.json"): _op(
            "openapi",
            None,
            "This API description",
            {"200": {"description": "This document.", "content": {JSON: {"schema": {"type": "object"}}}}},
        ),
        ("get", "/dashboard"): _op(
            "dashboard",
            None,
            "The repeat-caller dashboard page",
            {
                "200": _dashboard_file("The page.", "text/html"),
                "304": _response("Unchanged since the ETag given in If-None-Match."),
            },
            parameters=("If-None-Match",),
            description="Static; it holds no data. The page asks for a project id and a token with the "
            "`analytics` or `admin` role, keeps the token in the browser tab's session storage, and calls the "
            "analytics endpoints with it. Nothing is loaded from outside the service.",
        ),
        ("get", "/favicon.ico"): _op(
            "favicon",
            None,
            "The service's icon (the dashboard's), which browsers ask for by themselves",
            {
                "200": _dashboard_file("The icon, as SVG.", "image/svg+xml"),
                "304": _response("Unchanged since the ETag given in If-None-Match."),
            },
            parameters=("If-None-Match",),
        ),
        ("get", "/dashboard/{asset}"): _op(
            "dashboard_asset",
            None,
            "A script or style sheet of the dashboard page",
            {
                "200": _dashboard_file("The file.", *sorted(set(ASSETS.values()))),
                "304": _response("Unchanged since the ETag given in If-None-Match."),
                "404": _problem("No such file."),
            },
            parameters=("If-None-Match",),
        ),
        ("put", "/v1/projects/{project}"): _op(
            "put_project",
            "operator",
            "Create or replace a project's configuration",
            {
                "200": _response("Replaced; the configuration as stored.", stored),
                "201": _response("Created; the configuration as stored.", stored),
                "404": None,  # the operator sees every project; a project token gets 403 first
                "422": _problem("Invalid project id or configuration; `errors` names each offending field."),
                **_body_errors(),
            },
            body=_body("ProjectConfig", "The whole configuration document; missing members take defaults."),
        ),
        ("get", "/v1/projects/{project}"): _op(
            "get_project",
            "admin",
            "Read a project's configuration",
            {"200": _response("The configuration.", stored)},
        ),
        ("post", "/v1/projects/{project}/tokens"): _op(
            "create_token",
            "admin",
            "Mint a project token",
            {
                "201": _response(
                    "The new token with its secret, shown once.", "MintedToken", "Cache-Control"
                ),
                "422": _problem("Unknown role or member, or a label too long; `errors` names the field."),
                **_body_errors(),
            },
            body=_body("TokenCreate", "The role of the new token, and a label for people."),
        ),
        ("get", "/v1/projects/{project}/tokens"): _op(
            "list_tokens",
            "admin",
            "List the project's tokens",
            {"200": _response("No secrets.", "TokenList")},
        ),
        ("delete", "/v1/projects/{project}/tokens/{token_id}"): _op(
            "revoke_token",
            "admin",
            "Revoke a token",
            {
                "204": _response("Revoked; other replicas refuse it within their token cache time."),
                "404": _problem("No such project, or no such token in it."),
            },
        ),
        ("get", "/v1/projects/{project}/callers/{identifier}/memory"): _op(
            "read_memory",
            "agent",
            "Read a caller's memory",
            {
                "200": _response(
                    "Live memory; empty for unknown or blacklisted callers.", "Memory", *MEMORY_HEADERS
                ),
                "304": _response("Unchanged since an ETag given in If-None-Match.", None, *MEMORY_HEADERS),
                "422": _problem(f"{BAD_CALLER}."),
            },
            parameters=("If-None-Match",),
        ),
        ("patch", "/v1/projects/{project}/callers/{identifier}/memory"): _op(
            "patch_memory",
            "admin",
            "Merge-patch a caller's fields",
            {
                "200": _response(
                    "The memory after the write; dropped for blacklisted callers.", "Memory", *MEMORY_HEADERS
                ),
                "412": precondition,
                "422": _problem(
                    f"{BAD_CALLER}, the body is not an object, a name is not a valid field name or not in "
                    f"`state_keys`, or a value is over {MAX_VALUE_BYTES} bytes. Nothing is changed."
                ),
                **_body_errors(),
            },
            parameters=("If-Match",),
            body=_body("MemoryPatch", "Fields to set; `null` deletes.", JSON, MERGE_PATCH),
        ),
        ("delete", "/v1/projects/{project}/callers/{identifier}/memory/{field}"): _op(
            "delete_field",
            "admin",
            "Delete one field of a caller's memory",
            {
                "200": _response(
                    "The memory after the delete (an absent field is no error).", "Memory", *MEMORY_HEADERS
                ),
                "412": precondition,
                "422": _problem(f"{BAD_CALLER}, or the field name is not valid."),
            },
            parameters=("If-Match",),
        ),
        ("delete", "/v1/projects/{project}/callers/{identifier}"): _op(
            "erase_caller",
            "admin",
            "Erase everything about a caller",
            {
                "200": _response("The erasure receipt; it holds no phone number.", "ErasureReceipt"),
                "422": _problem(f"{BAD_CALLER}."),
            },
        ),
        ("post", "/v1/projects/{project}/conversations/{conversation_id}/end"): _op(
            "end_conversation",
            "agent",
            "End a conversation: persist its state and record its outcome",
            {
                "200": _response(
                    "What was persisted and ignored; a retry gets the same answer.",
                    "ConversationEnded",
                    "Idempotent-Replayed",
                ),
                "409": _problem("This conversation id was already ended with a different request."),
                "422": _problem(
                    "Malformed conversation id, caller that is not a possible phone number, invalid state key "
                    "or value, or unknown member; `errors` names the field."
                ),
                **_body_errors(),
            },
            body=_body(
                "EndRequest",
                "The caller, the conversation's state (`conv.state`), its outcome and channel.",
            ),
            description="Idempotent on the conversation id: a retry with the same body applies nothing twice.",
        ),
        ("get", "/v1/projects/{project}/analytics/conversations"): _op(
            "list_conversations",
            "analytics",
            "Conversations with their repeat-caller metrics",
            {
                "200": {
                    "description": "A page of conversations. With `Accept: text/csv`, the same columns as CSV "
                    "(cells that a spreadsheet would run as formulas are prefixed with `'`); the next page is "
                    "in `X-Next-Cursor` and `Link`.",
                    "headers": {
                        name: _ref(name, "headers") for name in ("Cache-Control", "X-Next-Cursor", "Link")
                    },
                    "content": {
                        JSON: {"schema": _ref("ConversationList")},
                        "text/csv": {"schema": {"type": "string"}},
                    },
                },
                "422": _problem("A malformed query parameter; `errors` names it."),
            },
            query=ConversationsQuery,
        ),
        ("get", "/v1/projects/{project}/analytics/repeat-callers"): _op(
            "repeat_callers",
            "analytics",
            "Repeat-caller rate over time, time to callback, and breakdowns by the first interaction",
            {
                "200": _response(
                    "The report, computed from per-bucket counters.", "RepeatCallerReport", "Cache-Control"
                ),
                "422": _problem("A malformed query parameter, or too many buckets; `errors` names it."),
            },
            query=RepeatCallersQuery,
        ),
    }


def _tag(path: str) -> str:
    if path.startswith("/dashboard") or path == "/favicon.ico":
        return "dashboard"
    if not path.startswith("/v1/"):
        return "service"
    if path.startswith("/v1/admin/"):
        return "operator"
    if path.endswith("/audit"):
        return "audit"
    if "/analytics/" in path:
        return "analytics"
    if "/conversations/" in path:
        return "conversation"
    return "memory" if "/callers/" in path else "token" if "/tokens" in path else "project"


def _links() -> dict[tuple[str, str], Json]:
    """What a response lets a client do next, as OpenAPI links by (operationId, status); schemathesis follows
    them in its stateful tests."""
    project = {"project": "$request.path.project"}
    caller = project | {"identifier": "$request.path.identifier"}

    def to(operation_id: str, parameters: Json, **extra: Any) -> Json:
        return {"operationId": operation_id, "parameters": parameters} | extra

    configured = {
        "GetProject": to("get_project", project),
        "CreateToken": to("create_token", project),
        "ListTokens": to("list_tokens", project),
    }
    memory = {
        "ReadMemory": to("read_memory", caller),
        "ReadMemoryIfChanged": to("read_memory", caller | {"header.If-None-Match": "$response.header.ETag"}),
        "PatchMemoryIfUnchanged": to("patch_memory", caller | {"header.If-Match": "$response.header.ETag"}),
        "EraseCaller": to("erase_caller", caller),
    }
    return {
        ("put_project", "200"): configured,
        ("put_project", "201"): configured,
        ("create_token", "201"): {
            "RevokeToken": to("revoke_token", project | {"token_id": "$response.body#/token_id"}),
        },
        ("read_memory", "200"): memory,
        ("patch_memory", "200"): memory,
        ("delete_field", "200"): memory,
        ("erase_caller", "200"): {"ReadMemory": memory["ReadMemory"], "ListAudit": to("list_audit", project)},
        ("end_conversation", "200"): {
            "ReadCallerMemory": to("read_memory", project | {"identifier": "$request.body#/caller"}),
            "Retry": to(
                "end_conversation",
                project | {"conversation_id": "$response.body#/conversation_id"},
                requestBody="$request.body",
            ),
            "ListConversations": to("list_conversations", project),
            "RepeatCallers": to("repeat_callers", project),
        },
        ("list_conversations", "200"): {
            "NextPage": to("list_conversations", project | {"query.cursor": "$response.body#/next_cursor"}),
        },
        ("list_audit", "200"): {
            "NextPage": to("list_audit", project | {"query.before": "$response.body#/next_cursor"}),
        },
    }


def _paths() -> dict[str, Json]:
    paths: dict[str, Json] = {}
    links = _links()
    for (method, path), op in _operations().items():
        op["tags"] = [_tag(path)]
        for status, response in op["responses"].items():
            if (op["operationId"], status) in links:
                op["responses"][status] = response | {"links": links[op["operationId"], status]}
        item = paths.setdefault(path, {})
        if "{" in path and "parameters" not in item:
            item["parameters"] = [_ref(name, "parameters") for name in re.findall(r"\{(\w+)\}", path)]
        item[method] = op
    return paths


def build_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of every route in ``routes.py`` (a new dict on each call)."""
    description = (
        "Key-value memory attached to a caller's phone number, kept for a bounded retention period. Errors "
        "are RFC 9457 problem details (`application/problem+json`); unknown paths answer 404, and methods a "
        "path does not support 405 with `Allow`.\n\n" + AUTH_TEXT
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "Caller Memory", "version": _version(), "description": description},
        "tags": [
            {"name": "service", "description": "Probes and this description; no authentication."},
            {"name": "project", "description": "Project configuration."},
            {"name": "token", "description": "Project tokens."},
            {"name": "memory", "description": "Caller memory, addressed by phone number."},
            {
                "name": "conversation",
                "description": "The end of a conversation, as the agent's SDK sends it.",
            },
            {"name": "analytics", "description": "Repeat-caller analytics: conversations and the report."},
            {"name": "operator", "description": "Expiry sweeps; the operator token only."},
            {"name": "audit", "description": "The project's audit log."},
            {
                "name": "dashboard",
                "description": "The dashboard page and its files; the data calls need a token.",
            },
        ],
        "security": [{"bearerAuth": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer", "description": AUTH_TEXT}},
            "schemas": component_schemas(),
            "parameters": _parameters(),
            "headers": _headers(),
        },
    }
