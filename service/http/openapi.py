"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``.

Written by hand next to ``routes.py`` (tests/http/test_openapi.py checks that both list the same operations);
the configuration and token request schemas come from the pydantic models, so they cannot drift.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from ..domain.limits import (
    FIELD_NAME_PATTERN,
    MAX_BODY_BYTES,
    MAX_IDENTIFIER_CHARS,
    MAX_STATE_KEYS,
    MAX_TTL_SECONDS,
    MAX_VALUE_BYTES,
    MIN_TTL_SECONDS,
    PROJECT_ID_PATTERN,
)
from ..domain.projects import PSEUDONYM_PREFIX, ProjectConfig
from .schemas import TokenCreate

Json = dict[str, Any]

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
PROBLEM = "application/problem+json"
TOKEN_ID_PATTERN = r"^[0-9a-f]{12}$"
E164_PATTERN = r"^\+[1-9][0-9]{1,14}$"

ROLES = {
    "operator": "Needs the operator token; a project token, whatever its role, gets 403.",
    "admin": "Needs a token with role `admin` in this project, or the operator token.",
    "agent": "Needs a token with role `agent` or `admin` in this project, or the operator token.",
}

AUTH_DESCRIPTION = (
    "`Authorization: Bearer <token>`. The **operator token** comes from the service's environment "
    "(`CALLER_MEMORY_OPERATOR_TOKEN`): it manages projects and may do anything a project admin may do in every "
    "project (so it can mint a new project's first admin token). **Project tokens** (`cm_<token_id>_<secret>`) "
    "are minted per project and carry one role: `agent` (read memory, end conversations), `analytics` (read "
    "analytics and the dashboard) or `admin` (everything in the project). A project token sees nothing of "
    "another project: the project is reported as not found (404)."
)


def _version() -> str:
    try:
        return importlib.metadata.version("caller-memory")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def _ref(name: str) -> Json:
    return {"$ref": f"#/components/schemas/{name}"}


def _model_schemas(
    model: type[BaseModel], *, prefix: str = "", mode: JsonSchemaMode = "validation"
) -> dict[str, Json]:
    """The model's JSON Schema and its ``$defs``, as entries of ``components/schemas`` (names get ``prefix``)."""
    schema = model.model_json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}", mode=mode)
    defs: dict[str, Json] = schema.pop("$defs", {})
    out = {prefix + name: {**body, "title": prefix + name} for name, body in defs.items()}
    out[prefix + model.__name__] = {**schema, "title": prefix + model.__name__}
    return out


def _durations_accept_seconds(node: Any) -> None:
    """Input durations are an ISO 8601 string or a whole number of seconds (pydantic only says 'string')."""
    if isinstance(node, dict):
        if node.get("format") == "duration":
            del node["format"], node["type"]
            node["anyOf"] = [
                {"type": "string", "format": "duration", "examples": ["P90D", "PT12H"]},
                {"type": "integer", "minimum": MIN_TTL_SECONDS, "maximum": MAX_TTL_SECONDS},
            ]
            node["description"] = (
                f"An ISO 8601 duration or a whole number of seconds, from {MIN_TTL_SECONDS} s "
                f"to {MAX_TTL_SECONDS // 86400} days."
            )
        for value in node.values():
            _durations_accept_seconds(value)
    elif isinstance(node, list):
        for item in node:
            _durations_accept_seconds(item)


def _config_schemas() -> dict[str, Json]:
    """``ProjectConfig`` (what PUT accepts) and ``StoredProjectConfig`` (what PUT and GET return)."""
    accepted = _model_schemas(ProjectConfig)
    _durations_accept_seconds(accepted)
    blacklist = accepted["RepeatCallerConfig"]["properties"]["identifier_blacklist"]
    blacklist["description"] = (
        "Phone numbers (read with `default_region` when they have no country code) or "
        f"`{PSEUDONYM_PREFIX}<32 hex digits>` entries as returned by GET; nothing is read, written or counted "
        "for these callers."
    )
    stored = _model_schemas(ProjectConfig, prefix="Stored", mode="serialization")
    for schema in stored.values():  # model_dump writes every field
        schema["required"] = sorted(schema["properties"])
    rc = stored["StoredRepeatCallerConfig"]["properties"]
    rc["identifier_blacklist"]["items"] = {"type": "string", "pattern": f"^{PSEUDONYM_PREFIX}[0-9a-f]{{32}}$"}
    rc["identifier_blacklist"]["description"] = (
        "Stored as keyed pseudonyms: the service keeps no phone number."
    )
    rc["retention"]["description"] = "ISO 8601 duration."
    stored["StoredProjectConfig"]["description"] = (
        "The configuration as stored: durations as ISO 8601 strings, blacklist entries as pseudonyms."
    )
    return accepted | stored


def _schemas() -> dict[str, Json]:
    date_time = {"type": "string", "format": "date-time", "examples": ["2025-01-31T14:00:00Z"]}
    token_props: Json = {
        "token_id": {"type": "string", "pattern": TOKEN_ID_PATTERN},
        "role": {"type": "string", "enum": ["agent", "analytics", "admin"]},
        "label": {"type": "string", "maxLength": 100},
        "created_at": date_time,
    }
    return {
        **_config_schemas(),
        **_model_schemas(TokenCreate),
        "Problem": {
            "type": "object",
            "description": "RFC 9457 problem details.",
            "required": ["type", "title", "status", "detail"],
            "properties": {
                "type": {"type": "string", "format": "uri"},
                "title": {"type": "string"},
                "status": {"type": "integer", "minimum": 400, "maximum": 599},
                "detail": {"type": "string", "description": "What went wrong; never holds a phone number."},
                "errors": {
                    "type": "array",
                    "description": "Validation errors (422), each naming the offending field.",
                    "items": {
                        "type": "object",
                        "required": ["field", "message"],
                        "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
                    },
                },
            },
        },
        "Memory": {
            "type": "object",
            "required": ["identifier", "fields", "expires_at", "blacklisted"],
            "additionalProperties": False,
            "properties": {
                "identifier": {"type": "string", "pattern": E164_PATTERN, "description": "E.164 form."},
                "fields": {
                    "type": "object",
                    "description": "Live fields: name to any JSON value. Expired fields are never returned.",
                    "maxProperties": MAX_STATE_KEYS,
                    "propertyNames": {"pattern": FIELD_NAME_PATTERN},
                    "additionalProperties": True,
                },
                "expires_at": {
                    "type": ["string", "null"],
                    "format": "date-time",
                    "description": "When the last field expires, rounded up to the hour; null when empty.",
                },
                "blacklisted": {
                    "type": "boolean",
                    "description": "The identifier is blacklisted: memory is empty and writes are dropped.",
                },
            },
        },
        "MemoryPatch": {
            "type": "object",
            "description": (
                "JSON Merge Patch (RFC 7396) of the top level: each key sets a field, `null` deletes it, "
                "others are left untouched. Every key must be in the project's `state_keys` (422 otherwise)."
            ),
            "propertyNames": {"pattern": FIELD_NAME_PATTERN},
            "additionalProperties": {
                "description": f"Any JSON value, at most {MAX_VALUE_BYTES} bytes encoded."
            },
        },
        "Token": {
            "type": "object",
            "required": list(token_props),
            "additionalProperties": False,
            "properties": token_props,
        },
        "MintedToken": {
            "type": "object",
            "required": [*token_props, "token"],
            "additionalProperties": False,
            "properties": {
                **token_props,
                "token": {
                    "type": "string",
                    "pattern": r"^cm_[0-9a-f]{12}_\S+$",
                    "description": "The bearer token. It is shown only in this response.",
                },
            },
        },
        "TokenList": {
            "type": "object",
            "required": ["tokens"],
            "additionalProperties": False,
            "properties": {"tokens": {"type": "array", "items": _ref("Token")}},
        },
        "ErasureReceipt": {
            "type": "object",
            "required": ["receipt_id", "project", "erased_at", "removed", "blacklisted"],
            "additionalProperties": False,
            "properties": {
                "receipt_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                "project": {"type": "string", "pattern": PROJECT_ID_PATTERN},
                "erased_at": {**date_time, "description": "Rounded down to the hour."},
                "removed": {
                    "type": "object",
                    "required": ["fields"],
                    "properties": {"fields": {"type": "integer", "minimum": 0}},
                },
                "blacklisted": {"type": "boolean"},
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {
                "status": {"type": "string", "enum": ["ok", "ready", "unready"]},
                "detail": {"type": "string", "description": "Why the service is not ready."},
            },
        },
    }


# Parameters and responses ---------------------------------------------------------------------------------


def _path(name: str, description: str, schema: Json) -> Json:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}


def _parameters() -> dict[str, Json]:
    return {
        "project": _path(
            "project",
            "Project id: 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit.",
            {"type": "string", "pattern": PROJECT_ID_PATTERN},
        ),
        "identifier": _path(
            "identifier",
            "The caller's phone number, percent-encoded; any form libphonenumber reads (E.164 such as "
            "`+14155550100`, or a national number with the project's `default_region`).",
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_IDENTIFIER_CHARS,
                "examples": ["+14155550100"],
            },
        ),
        "field": _path("field", "A field name.", {"type": "string", "pattern": FIELD_NAME_PATTERN}),
        "token_id": _path(
            "token_id", "The token id (12 hex digits).", {"type": "string", "pattern": TOKEN_ID_PATTERN}
        ),
        "If-Match": {
            "name": "If-Match",
            "in": "header",
            "required": False,
            "description": "Apply the write only if the memory's ETag is one of these (or `*`: the caller has "
            "live fields); 412 otherwise.",
            "schema": {"type": "string"},
        },
        "If-None-Match": {
            "name": "If-None-Match",
            "in": "header",
            "required": False,
            "description": "ETags already held by the client: 304 without a body when one matches.",
            "schema": {"type": "string"},
        },
    }


def _headers() -> dict[str, Json]:
    return {
        "ETag": {"description": "Strong ETag of the caller's live memory.", "schema": {"type": "string"}},
        "Cache-Control": {
            "description": "Always `no-store`.",
            "schema": {"type": "string", "const": "no-store"},
        },
        "WWW-Authenticate": {"description": 'Bearer realm="caller-memory"', "schema": {"type": "string"}},
    }


def _param(name: str) -> Json:
    return {"$ref": f"#/components/parameters/{name}"}


def _header(name: str) -> Json:
    return {"$ref": f"#/components/headers/{name}"}


def _json(description: str, schema: str, *, headers: tuple[str, ...] = ()) -> Json:
    response: Json = {"description": description, "content": {JSON: {"schema": _ref(schema)}}}
    if headers:
        response["headers"] = {name: _header(name) for name in headers}
    return response


def _problem(description: str, *, headers: tuple[str, ...] = ()) -> Json:
    response: Json = {"description": description, "content": {PROBLEM: {"schema": _ref("Problem")}}}
    if headers:
        response["headers"] = {name: _header(name) for name in headers}
    return response


def _auth() -> dict[str, Json | None]:
    """What every authenticated operation may answer besides its own outcomes."""
    return {
        "401": _problem("Missing, malformed or invalid bearer token.", headers=("WWW-Authenticate",)),
        "403": _problem("The token's role does not allow this operation."),
        "404": _problem("No such project, or the token belongs to another project."),
        "500": _problem("Unexpected error (logged), or the store holds data this version cannot read."),
        "503": _problem("The store did not answer in time."),
    }


def _body_errors() -> dict[str, Json | None]:
    return {
        "400": _problem("The body is empty or not valid JSON."),
        "413": _problem(f"The body is larger than {MAX_BODY_BYTES} bytes."),
        "415": _problem(f"The Content-Type is not `{JSON}` (or `{MERGE_PATCH}`)."),
    }


def _op(
    operation_id: str,
    tag: str,
    summary: str,
    role: str | None,
    responses: dict[str, Json | None],
    *,
    description: str = "",
    parameters: tuple[str, ...] = (),
    body: Json | None = None,
) -> Json:
    op: Json = {"operationId": operation_id, "tags": [tag], "summary": summary}
    if role is None:
        op["security"] = []
        op["description"] = description or summary
    else:
        op["x-required-role"] = role
        op["description"] = f"{ROLES[role]} {description}".strip()
        responses = {**_auth(), **responses}
    if parameters:
        op["parameters"] = [_param(name) for name in parameters]
    if body is not None:
        op["requestBody"] = body
    op["responses"] = {status: r for status, r in sorted(responses.items()) if r is not None}
    return op


def _body(schema: str, *content_types: str, description: str) -> Json:
    types = content_types or (JSON,)
    return {
        "required": True,
        "description": description,
        "content": {t: {"schema": _ref(schema)} for t in types},
    }


def _paths() -> dict[str, Json]:
    memory_ok = ("ETag", "Cache-Control")
    bad_caller = "The identifier is not a possible phone number"
    return {
        "/healthz": {
            "get": _op("healthz", "health", "Liveness", None, {"200": _json("The process is up.", "Health")}),
        },
        "/readyz": {
            "get": _op(
                "readyz",
                "health",
                "Readiness: the store answers",
                None,
                {
                    "200": _json("Ready (`status: ready`).", "Health"),
                    "503": _json("Not ready (`status: unready`, with a `detail`).", "Health"),
                },
            ),
        },
        "/openapi.json": {
            "get": _op(
                "openapi",
                "health",
                "This API description",
                None,
                {
                    "200": {
                        "description": "The OpenAPI 3.1 document.",
                        "content": {JSON: {"schema": {"type": "object"}}},
                    }
                },
            ),
        },
        "/v1/projects/{project}": {
            "parameters": [_param("project")],
            "put": _op(
                "put_project",
                "projects",
                "Create or replace a project's configuration",
                "operator",
                {
                    "200": _json("Replaced; the configuration as stored.", "StoredProjectConfig"),
                    "201": _json("Created; the configuration as stored.", "StoredProjectConfig"),
                    "404": None,  # only the operator may call it, and it sees every project
                    "422": _problem(
                        "Invalid project id or configuration; `errors` names each offending field."
                    ),
                    **_body_errors(),
                },
                body=_body("ProjectConfig", description="The whole configuration document."),
            ),
            "get": _op(
                "get_project",
                "projects",
                "Read a project's configuration",
                "admin",
                {"200": _json("The configuration as stored.", "StoredProjectConfig")},
            ),
        },
        "/v1/projects/{project}/tokens": {
            "parameters": [_param("project")],
            "post": _op(
                "create_token",
                "tokens",
                "Mint a project token",
                "admin",
                {
                    "201": _json(
                        "The new token, with its secret (shown once).",
                        "MintedToken",
                        headers=("Cache-Control",),
                    ),
                    "422": _problem(
                        "Unknown role, label too long or unknown member; `errors` names the field."
                    ),
                    **_body_errors(),
                },
                body=_body("TokenCreate", description="The role of the new token and a label for people."),
            ),
            "get": _op(
                "list_tokens",
                "tokens",
                "List the project's tokens (never their secrets)",
                "admin",
                {"200": _json("The project's tokens.", "TokenList")},
            ),
        },
        "/v1/projects/{project}/tokens/{token_id}": {
            "parameters": [_param("project"), _param("token_id")],
            "delete": _op(
                "revoke_token",
                "tokens",
                "Revoke a token",
                "admin",
                {
                    "204": {
                        "description": "Revoked. Other replicas stop accepting it within their token cache time."
                    },
                    "404": _problem("No such project, or no such token in it."),
                },
            ),
        },
        "/v1/projects/{project}/callers/{identifier}/memory": {
            "parameters": [_param("project"), _param("identifier")],
            "get": _op(
                "read_memory",
                "memory",
                "Read a caller's memory",
                "agent",
                {
                    "200": _json(
                        "The caller's live memory (empty for unknown or blacklisted callers).",
                        "Memory",
                        headers=memory_ok,
                    ),
                    "304": {
                        "description": "Unchanged since the ETag given in If-None-Match.",
                        "headers": {name: _header(name) for name in memory_ok},
                    },
                    "422": _problem(f"{bad_caller}."),
                },
                parameters=("If-None-Match",),
            ),
            "patch": _op(
                "patch_memory",
                "memory",
                "Merge-patch a caller's fields",
                "admin",
                {
                    "200": _json(
                        "The memory after the write (unchanged, `blacklisted: true`, when dropped).",
                        "Memory",
                        headers=memory_ok,
                    ),
                    "412": _problem(
                        "If-Match did not match; ETag carries the current one.", headers=("ETag",)
                    ),
                    "422": _problem(
                        f"{bad_caller}, the body is not an object, a key is not a valid field name or not in "
                        f"`state_keys`, or a value is over {MAX_VALUE_BYTES} bytes."
                    ),
                    **_body_errors(),
                },
                parameters=("If-Match",),
                body=_body("MemoryPatch", JSON, MERGE_PATCH, description="Fields to set; `null` deletes."),
            ),
        },
        "/v1/projects/{project}/callers/{identifier}/memory/{field}": {
            "parameters": [_param("project"), _param("identifier"), _param("field")],
            "delete": _op(
                "delete_field",
                "memory",
                "Delete one field of a caller's memory",
                "admin",
                {
                    "200": _json(
                        "The memory after the delete (deleting an absent field is not an error).",
                        "Memory",
                        headers=memory_ok,
                    ),
                    "412": _problem(
                        "If-Match did not match; ETag carries the current one.", headers=("ETag",)
                    ),
                    "422": _problem(f"{bad_caller}, or the field name is not valid."),
                },
                parameters=("If-Match",),
            ),
        },
        "/v1/projects/{project}/callers/{identifier}": {
            "parameters": [_param("project"), _param("identifier")],
            "delete": _op(
                "erase_caller",
                "memory",
                "Erase everything about a caller",
                "admin",
                {
                    "200": _json("The erasure receipt (it holds no phone number).", "ErasureReceipt"),
                    "422": _problem(f"{bad_caller}."),
                },
            ),
        },
    }


def build_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of every route in ``routes.py`` (a new dict on each call)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Caller Memory",
            "version": _version(),
            "summary": "Repeat-caller memory for voice agents.",
            "description": (
                "Key-value memory attached to a caller's phone number, kept for a bounded retention period. "
                "Errors are RFC 9457 problem details (`application/problem+json`); unknown paths answer 404 and "
                "unsupported methods 405, with an `Allow` header.\n\n" + AUTH_DESCRIPTION
            ),
        },
        "tags": [
            {"name": "health", "description": "Probes and this description; no authentication."},
            {"name": "projects", "description": "Project configuration."},
            {"name": "tokens", "description": "Project tokens."},
            {"name": "memory", "description": "Caller memory, by phone number."},
        ],
        "security": [{"bearerAuth": []}],
        "paths": _paths(),
        "components": {
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer", "description": AUTH_DESCRIPTION},
            },
            "schemas": dict(sorted(_schemas().items())),
            "parameters": _parameters(),
            "headers": _headers(),
        },
    }
