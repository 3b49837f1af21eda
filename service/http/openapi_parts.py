"""The building blocks of the OpenAPI document (openapi.py): media types, the shared parameters, headers and
responses, request bodies with their examples, and one operation's skeleton."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from ..domain.limits import (
    CONVERSATION_ID_PATTERN,
    FIELD_NAME_PATTERN,
    MAX_ANY_IDENTIFIER_CHARS,
    MAX_BODY_BYTES,
    PROJECT_ID_PATTERN,
    TOKEN_ID_PATTERN,
)
from ..domain.webhooks.views import ENDED, ERASED
from .queries import QueryModel, query_parameters

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
    "platform": "Role: **platform** (a token with role `platform` or `admin` in this project, or the operator "
    "token).",
}

AUTH_TEXT = (
    "`Authorization: Bearer <token>`. The **operator token** is set in the service's environment "
    "(`CALLER_MEMORY_OPERATOR_TOKEN`); it manages projects and may do anything a project admin may do in "
    "every project (so it can mint a project's first admin token). **Project tokens** "
    "(`cm_<token_id>_<secret>`) are minted per project and carry one role: `agent` (read memory), "
    "`analytics` (for the analytics endpoints), `admin` (everything in the project) or `platform` (only "
    "what a hosted voice platform calls: `/platforms/{platform}/{hook}` and `/llm/chat/completions`; "
    "everything else answers 403). "
    "A project token sees nothing of another project: that project is reported as not found (404)."
)


def version() -> str:
    try:
        return importlib.metadata.version("caller-memory")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def ref(name: str, kind: str = "schemas") -> Json:
    return {"$ref": f"#/components/{kind}/{name}"}


# Parameters, headers, responses ---------------------------------------------------------------------------


#: ``If-Match`` and ``If-None-Match``: ``*`` or up to 16 entity tags (domain/fields.py reads them; anything
#: else is a 400).
_TAG = r'(W/)?"[\x21\x23-\x7e]{0,64}"'
ENTITY_TAGS: Json = {
    "type": "string",
    "pattern": rf"^[ \t]*(\*|{_TAG}([ \t]*,[ \t]*{_TAG}){{0,15}})[ \t]*$",
    "examples": ['"5d41402abc4b2a76b971"', 'W/"0f3a5c1b9e2d4a6c8b7e"'],
}


def shared_parameters() -> dict[str, Json]:
    def path(name: str, description: str, schema: Json) -> Json:
        return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}

    def header(name: str, description: str) -> Json:
        return {"name": name, "in": "header", "description": description, "schema": ENTITY_TAGS}

    return {
        "project": path(
            "project",
            "Project id: 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit.",
            {"type": "string", "pattern": PROJECT_ID_PATTERN, "examples": ["cheese-shop"]},
        ),
        "identifier": path(
            "identifier",
            "The caller's identifier, percent-encoded: a phone number in E.164 (`+14155550100`) or any form "
            "libphonenumber reads (national numbers with the project's `default_region`), "
            "`email:ada@example.com` (trimmed and case-folded), or `account:A-1234` (1-64 of `[A-Za-z0-9._-]`).",
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_ANY_IDENTIFIER_CHARS,
                "examples": ["+14155550100"],
            },
        ),
        "other": path(
            "other",
            "The linked identifier (any kind, percent-encoded), or its link id (`lnk_...`).",
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_ANY_IDENTIFIER_CHARS,
                "examples": ["email:ada@example.com"],
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
        "platform": path(
            "platform",
            "A hosted voice platform.",
            {"type": "string", "enum": ["agora", "vapi", "retell", "elevenlabs", "telnyx"]},
        ),
        "webhook_id": path(
            "webhook_id", "A webhook endpoint's id.", {"type": "string", "pattern": "^wh_[0-9a-f]{16}$"}
        ),
        "delivery_id": path(
            "delivery_id",
            "A delivery's id (its webhook-id header).",
            {"type": "string", "minLength": 1, "maxLength": 64},
        ),
        "If-Match": header(
            "If-Match",
            "Write only if the memory's ETag is one of these (`*`: if it has live fields); else 412.",
        ),
        "If-None-Match": header(
            "If-None-Match", "ETags the client holds: 304 without a body if one matches."
        ),
    }


def shared_headers() -> dict[str, Json]:
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


def response(description: str, schema: str | None = None, *headers: str, media: str = JSON) -> Json:
    response: Json = {"description": description}
    if headers:
        response["headers"] = {name: ref(name, "headers") for name in headers}
    if schema is not None:
        response["content"] = {media: {"schema": ref(schema)}}
    return response


def problem(description: str, *headers: str) -> Json:
    return response(description, "Problem", *headers, media=PROBLEM)


def authenticated() -> dict[str, Json | None]:
    """What every authenticated operation may answer besides its own outcomes."""
    return {
        "400": problem(
            "A header value is not valid UTF-8, or `If-Match` / `If-None-Match` is not a list of entity tags."
        ),
        "401": problem("Missing, malformed or unknown bearer token.", "WWW-Authenticate"),
        "403": problem("The token's role does not allow this operation."),
        "404": problem("No such project, or the token belongs to another project."),
        "422": problem("The project id is malformed."),
        "429": problem(
            "Too many failed authentications from this address lately (this one failed too), or this "
            "project already has its share of the requests in flight; retry after `Retry-After` seconds. A "
            "valid token is never refused for others' failures.",
            "Retry-After",
        ),
        "500": problem("Unexpected error (logged), or the store holds data this version cannot read."),
        "503": problem(
            "The store did not answer in time, or the service has its limit of requests in flight (then "
            "with `Retry-After`)."
        ),
    }


def body_errors() -> dict[str, Json | None]:
    return {
        "400": problem("The body is empty or not valid JSON, or a header is malformed."),
        "408": problem("The body did not arrive within the body timeout (CALLER_MEMORY_BODY_TIMEOUT)."),
        "413": problem(f"The body is larger than {MAX_BODY_BYTES} bytes."),
        "415": problem(
            f"The Content-Type is neither `{JSON}` nor `{MERGE_PATCH}`, or names a charset other than UTF-8."
        ),
    }


def platform_body_errors() -> dict[str, Json | None]:
    """:func:`body_errors` of an operation a hosted platform calls: its body may hold a whole call."""
    return body_errors() | {
        "413": problem(
            "The body is larger than `CALLER_MEMORY_PLATFORM_MAX_BODY` allows (4 MiB unless the operator set "
            "another size)."
        )
    }


def signed_hook_errors() -> dict[str, Json | None]:
    """What a platform's hook without a bearer token (signed by the platform) may answer besides its own
    outcomes: :func:`platform_body_errors`, and the project's share of the requests in flight."""
    return platform_body_errors() | {
        "429": problem(
            "This project already has its share of the requests in flight; retry after `Retry-After` "
            "seconds.",
            "Retry-After",
        )
    }


#: Request bodies as docs/walkthrough.md sends them (schemathesis' examples phase sends them too).
BODY_EXAMPLES: dict[str, Json] = {
    "WebhookCreate": {
        "url": "https://crm.example.com/hooks/caller-memory",
        "events": [ENDED, ERASED],
        "include_history": False,
        "description": "CRM",
    },
    "WebhookRotate": {"grace_seconds": 86400},
    "ConnectionBody": {
        "secret": "whsec_example",
        "state_map": {"caller_name": "caller_name"},
        "channel": "phone",
        "analysis_qa_key": None,
        "end_grace": "PT2H",
        "options": {},
    },
    "ProjectConfig": {
        "memory": {
            "repeat_caller": {
                "state_keys": ["caller_name", "booking_day", "verified"],
                "retention": "P90D",
                "field_ttls": {"booking_day": "P7D"},
                "analytics_enabled": True,
                "identity_linking": True,
            }
        }
    },
    "TokenCreate": {"role": "agent", "label": "cheese-shop agent prod"},
    "LinkBody": {"identifier": "email:ada@example.com"},
    "MemoryPatch": {"caller_name": "Ada", "booking_day": None},
    "EndRequest": {
        "caller": "+14155550100",
        "state": {"caller_name": "Ada", "mood": "happy"},
        "outcome": {"qa": "resolved"},
        "channel": "voice",
        "end_reason": "completed",
    },
    "StartBody": {"caller": "+14155550100", "channel": "voice", "agent": "booking"},
    # SPEC section 14's platform example transcript, as one batch that starts the conversation.
    "AppendBody": {
        "caller": "+14155550100",
        "channel": "voice",
        "messages": [
            {
                "role": "assistant",
                "content": "How can I help you today?",
                "turn_id": 1,
                "timestamp": 1678901230000,
                "metadata": {"source": "greeting"},
            },
            {
                "role": "user",
                "content": "Can you tell me a joke?",
                "turn_id": 2,
                "timestamp": 1678901234000,
                "metadata": {"source": "asr"},
            },
            {
                "message_id": "m-7",
                "role": "assistant",
                "content": "Why did the scarecrow ",
                "turn_id": 2,
                "timestamp": 1678901236000,
                "tokens": 6,
                "metadata": {
                    "source": "llm",
                    "interrupted": True,
                    "interrupt_timestamp": 1678901237000,
                    "original": "Why did the scarecrow win an award? Because he was outstanding in his field!",
                },
            },
            {
                "role": "user",
                "content": "You know what? Tell me a story instead.",
                "turn_id": 3,
                "timestamp": 1678901238000,
                "metadata": {"source": "asr"},
            },
        ],
        "state": {"caller_name": "Ada"},
    },
    "SummaryBody": {
        "text": "The caller asked for a joke, then for a story.",
        "through_turn": 2,
        "tokens": 12,
    },
}


def request_body(schema: str, description: str, *media: str) -> Json:
    example = {"example": BODY_EXAMPLES[schema]} if schema in BODY_EXAMPLES else {}
    content = {m: {"schema": ref(schema)} | example for m in media or (JSON,)}
    return {"required": True, "description": description, "content": content}


# Links: what a response lets a client do next -------------------------------------------------------------

THIS_PROJECT = {"project": "$request.path.project"}
THIS_CALLER = THIS_PROJECT | {"identifier": "$request.path.identifier"}
THIS_CONVERSATION = THIS_PROJECT | {"conversation_id": "$request.path.conversation_id"}


def link(operation_id: str, parameters: Json, **extra: Any) -> Json:
    """An OpenAPI link to ``operation_id`` with these parameters (runtime expressions)."""
    return {"operationId": operation_id, "parameters": parameters} | extra


# Operations -----------------------------------------------------------------------------------------------

MEMORY_HEADERS = ("ETag", "Cache-Control")
#: The headers of an answer no cache may keep.
NO_STORE_HEADERS = ("Cache-Control",)
BAD_CALLER = "The identifier is not a possible phone number (or not a valid `email:` or `account:` one)"


def operation(
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
        responses = authenticated() | responses
    if parameters or query is not None:
        op["parameters"] = [ref(name, "parameters") for name in parameters]
        op["parameters"] += query_parameters(query) if query is not None else []
    if body is not None:
        op["requestBody"] = body
    op["responses"] = {status: r for status, r in sorted(responses.items()) if r is not None}
    return op
