"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``.

Written next to ``routes.py``; tests/http/test_openapi.py checks that both list the same operations. The
configuration and token request schemas are generated from the pydantic models, so they cannot drift.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from ..domain.limits import (
    CONVERSATION_ID_PATTERN,
    FIELD_NAME_PATTERN,
    MAX_BODY_BYTES,
    MAX_IDENTIFIER_CHARS,
    MAX_STATE_KEYS,
    MAX_TTL_SECONDS,
    MAX_VALUE_BYTES,
    MIN_TTL_SECONDS,
    PROJECT_ID_PATTERN,
    TOKEN_ID_PATTERN,
)
from ..domain.projects import _ISO_DURATION, PSEUDONYM_PREFIX, ProjectConfig
from ..domain.tokens import Role
from .dashboard import ASSETS, CONTENT_SECURITY_POLICY
from .queries import (
    AuditQuery,
    ConversationsQuery,
    QueryModel,
    RepeatCallersQuery,
    SweepsQuery,
    query_parameters,
)
from .schemas import EndRequest, TokenCreate

Json = dict[str, Any]

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
PROBLEM = "application/problem+json"
E164_PATTERN = r"^\+[1-9][0-9]{1,14}$"

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


def _object(properties: Json, *, optional: tuple[str, ...] = (), closed: bool = True, **extra: Any) -> Json:
    schema: Json = {"type": "object", "required": [name for name in properties if name not in optional]}
    schema["properties"] = properties
    if closed:
        schema["additionalProperties"] = False
    return schema | extra


# Schemas --------------------------------------------------------------------------------------------------


def _model_schemas(
    model: type[BaseModel], prefix: str = "", mode: JsonSchemaMode = "validation"
) -> dict[str, Json]:
    """The model's JSON Schema and its ``$defs`` as ``components/schemas`` entries, named with ``prefix``."""
    schema = model.model_json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}", mode=mode)
    defs: dict[str, Json] = schema.pop("$defs", {})
    out = {prefix + name: body | {"title": prefix + name} for name, body in defs.items()}
    return out | {prefix + model.__name__: schema | {"title": prefix + model.__name__}}


YEARS_AND_MONTHS = "A year counts 365 days, a month 30."


def _accept_seconds(node: Any) -> None:
    """Input durations are an ISO 8601 string or a whole number of seconds (pydantic's schema says 'string')."""
    if isinstance(node, list):
        for item in node:
            _accept_seconds(item)
    elif isinstance(node, dict):
        if node.get("format") != "duration":
            for value in node.values():
                _accept_seconds(value)
            return
        del node["format"], node["type"]
        node["anyOf"] = [
            {"type": "string", "format": "duration", "examples": ["P90D", "PT12H"]},
            {"type": "integer", "minimum": MIN_TTL_SECONDS, "maximum": MAX_TTL_SECONDS},
        ]
        node["description"] = (
            f"An ISO 8601 duration or a whole number of seconds, from {MIN_TTL_SECONDS} s "
            f"to {MAX_TTL_SECONDS // 86400} days. {YEARS_AND_MONTHS}"
        )


def _emit_iso(node: Any) -> None:
    """Output durations are ISO 8601 as pydantic writes them: years, then days ('P1Y35D', 'P10Y9DT23H59M59S').
    JSON Schema's ``duration`` format is RFC 3339's grammar, which wants months between years and days and
    so rejects those; describe them with the pattern the service reads (a stored document can be PUT back)."""
    if isinstance(node, list):
        for item in node:
            _emit_iso(item)
    elif isinstance(node, dict):
        if node.get("format") == "duration":
            del node["format"]
            node["pattern"] = _ISO_DURATION.pattern
            node["description"] = f"An ISO 8601 duration. {YEARS_AND_MONTHS}"
        for value in node.values():
            _emit_iso(value)


def _config_schemas() -> dict[str, Json]:
    """``ProjectConfig`` (what PUT accepts) and ``StoredProjectConfig`` (what PUT and GET return)."""
    accepted = _model_schemas(ProjectConfig)
    _accept_seconds(accepted)
    accepted["RepeatCallerConfig"]["properties"]["identifier_blacklist"]["description"] = (
        "Phone numbers (read with `default_region` when they have no country code), or "
        f"`{PSEUDONYM_PREFIX}<32 hex digits>` entries as GET returns them. Nothing is read, written or "
        "counted for these callers."
    )
    stored = _model_schemas(ProjectConfig, "Stored", "serialization")
    _emit_iso(stored)
    for schema in stored.values():  # model_dump writes every field
        schema["required"] = list(schema["properties"])
    rc = stored["StoredRepeatCallerConfig"]["properties"]
    rc["identifier_blacklist"]["items"] = {"type": "string", "pattern": f"^{PSEUDONYM_PREFIX}[0-9a-f]{{32}}$"}
    rc["identifier_blacklist"]["description"] = "Keyed pseudonyms: the service keeps no phone number."
    stored["StoredProjectConfig"]["description"] = (
        "The configuration as stored: durations as ISO 8601 strings, blacklist entries as pseudonyms."
    )
    return accepted | stored


def _schemas() -> dict[str, Json]:
    date_time = {"type": "string", "format": "date-time", "examples": ["2025-01-31T14:00:00Z"]}
    token = {
        "token_id": {"type": "string", "pattern": TOKEN_ID_PATTERN},
        "role": {"type": "string", "enum": [role.value for role in Role]},
        "label": {"type": "string"},
        "created_at": date_time,
    }
    secret = {"type": "string", "pattern": r"^cm_[0-9a-f]{12}_\S+$", "description": "Shown only here."}
    error = _object({"field": {"type": "string"}, "message": {"type": "string"}}, closed=False)
    problem = {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "detail": {"type": "string", "description": "What went wrong, for people; never a phone number."},
        "errors": {"type": "array", "items": error, "description": "Validation errors, each naming a field."},
    }
    memory = {
        "identifier": {"type": "string", "pattern": E164_PATTERN, "description": "The caller, in E.164."},
        "fields": {
            "type": "object",
            "description": "Live fields, name to JSON value. Expired fields are never returned.",
            "maxProperties": MAX_STATE_KEYS,
            "propertyNames": {"pattern": FIELD_NAME_PATTERN},
        },
        "expires_at": date_time
        | {"type": ["string", "null"], "description": "When the last field expires, rounded up to the hour."},
        "blacklisted": {
            "type": "boolean",
            "description": "Blacklisted: memory is empty, writes are dropped.",
        },
    }
    receipt = {
        "receipt_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "project": {"type": "string", "pattern": PROJECT_ID_PATTERN},
        "erased_at": date_time | {"description": "Rounded down to the hour."},
        "removed": _object(
            {
                "fields": {"type": "integer", "minimum": 0},
                "first_interaction": {"type": "boolean"},
                "conversation_links": {"type": "integer", "minimum": 0},
                "analytics_conversations": {"type": "integer", "minimum": 0},
            }
        ),
        "blacklisted": {"type": "boolean"},
    }
    nullable = {"type": ["string", "null"]}
    conversation_row = {
        "conversation_id": {"type": "string"},
        "ended_at": date_time | {"description": "Rounded down to the hour."},
        "channel": nullable,
        "qa": nullable,
        "handoff_reason": nullable,
        "handoff_to": nullable,
        "repeat": {
            "type": "boolean",
            "description": "The caller had a first interaction inside the retention window.",
        },
        "REPEAT_CALLER_CONV_ID": nullable
        | {"description": "Conversation id of the caller's first interaction."},
        "REPEAT_CALLER_DATETIME": {
            "type": ["string", "null"],
            "format": "date-time",
            "description": "When it happened, rounded down to the hour.",
        },
        "REPEAT_CALLER_QA": nullable,
        "REPEAT_CALLER_HANDOFF_REASON": nullable,
        "REPEAT_CALLER_HANDOFF_TO": nullable,
        "time_to_callback_hours": {"type": ["integer", "null"], "minimum": 0},
    }
    count = {"type": "integer", "minimum": 0}
    rate = {
        "type": ["number", "null"],
        "minimum": 0,
        "maximum": 1,
        "description": "null when there is nothing to divide",
    }
    breakdown_row = _object({"value": nullable, "repeat_conversations": count, "share": rate})
    report = {
        "interval": {"type": "string", "enum": ["hour", "day", "week"]},
        "from": date_time,
        "to": date_time,
        "totals": _object(
            {
                "conversations": count,
                "repeat_conversations": count,
                "first_conversations": count,
                "repeat_rate": rate,
            }
        ),
        "series": {
            "type": "array",
            "items": _object(
                {
                    "start": date_time,
                    "conversations": count,
                    "repeat_conversations": count,
                    "first_conversations": count,
                    "repeat_rate": rate,
                    "distinct_callers": count
                    | {"description": "Distinct callers in this bucket (not additive)."},
                }
            ),
        },
        "time_to_callback": {
            "type": "array",
            "items": _object({"bucket": {"type": "string"}, "repeat_conversations": count, "share": rate}),
        },
        "breakdowns": _object(
            {
                dimension: {"type": "array", "items": breakdown_row}
                for dimension in ("qa", "handoff_reason", "handoff_to")
            }
        ),
    }
    health = {"status": {"type": "string", "enum": ["ok", "ready", "unready"]}, "detail": {"type": "string"}}
    patch_description = (
        "JSON Merge Patch (RFC 7396) of the top level: each member sets a field, `null` deletes it, other "
        f"fields are untouched. Every name must be in the project's `state_keys`; values are any JSON of at "
        f"most {MAX_VALUE_BYTES} bytes."
    )
    return {
        **_config_schemas(),
        **_model_schemas(TokenCreate),
        **_model_schemas(EndRequest),
        "ConversationEnded": _object(
            {
                "conversation_id": {"type": "string", "pattern": CONVERSATION_ID_PATTERN},
                "persisted": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "State keys written (or deleted, for null) in the caller's memory.",
                },
                "ignored": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "State keys not in the project's state_keys: not stored.",
                },
                "blacklisted": {
                    "type": "boolean",
                    "description": "The caller is blacklisted: nothing was stored.",
                },
                "erased": {
                    "type": "boolean",
                    "description": "The caller was erased after this write was made (`ended_at`, or when the "
                    "request arrived): nothing was stored.",
                },
                "repeat_caller": {
                    "type": "object",
                    "description": "Repeat-caller metrics of the caller's first interaction (empty until analytics).",
                },
            }
        ),
        "Problem": _object(
            problem, optional=("errors",), closed=False, description="RFC 9457 problem details."
        ),
        "Memory": _object(memory),
        "MemoryPatch": {
            "type": "object",
            "description": patch_description,
            "propertyNames": {"pattern": FIELD_NAME_PATTERN},
        },
        "ConversationRow": _object(conversation_row),
        "ConversationList": _object(
            {
                "conversations": {"type": "array", "items": _ref("ConversationRow")},
                "next_cursor": {
                    "type": ["string", "null"],
                    "description": "Pass as `cursor` for the next page.",
                },
            }
        ),
        "RepeatCallerReport": _object(report),
        "SweepReport": _object(
            {
                "sweep_id": {"type": "string"},
                "holder": {"type": "string", "description": "The replica that ran it."},
                "started_at": date_time,
                "duration_ms": {"type": "number", "minimum": 0},
                "rounds": count,
                "complete": {
                    "type": "boolean",
                    "description": "False: it stopped at its time budget with work left.",
                },
                "removed": {
                    "type": "object",
                    "additionalProperties": count,
                    "description": "Removed items by kind.",
                },
            }
        ),
        "SweepList": _object({"sweeps": {"type": "array", "items": _ref("SweepReport")}}),
        "AuditRecord": _object(
            {
                "id": {"type": "string"},
                "at": date_time | {"description": "Rounded down to the hour for erasures."},
                "actor": {"type": "string", "description": "`operator` or `token:<token_id>`."},
                "action": {
                    "type": "string",
                    "enum": [
                        "project.created",
                        "project.configured",
                        "token.created",
                        "token.revoked",
                        "caller.erased",
                    ],
                },
                "details": {
                    "type": "object",
                    "description": "Counts and ids; never a phone number or a stored value.",
                },
                "receipt_id": nullable,
            }
        ),
        "AuditList": _object(
            {
                "records": {"type": "array", "items": _ref("AuditRecord")},
                "next_cursor": {"type": ["string", "null"]},
            }
        ),
        "Token": _object(token),
        "MintedToken": _object(token | {"token": secret}),
        "TokenList": _object({"tokens": {"type": "array", "items": _ref("Token")}}),
        "ErasureReceipt": _object(receipt),
        "Health": _object(health, optional=("detail",)),
    }


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
            "schemas": dict(sorted(_schemas().items())),
            "parameters": _parameters(),
            "headers": _headers(),
        },
    }
