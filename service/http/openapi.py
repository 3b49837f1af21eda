"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``: its operations, their
descriptions and examples.

Written next to ``routes.py``; tests/http/test_openapi.py checks that both list the same operations. Nothing
about a body's shape is written here: ``components.schemas`` is generated from the typed bodies
(components.py), and the query parameters from the query models (queries.py). The shared parameters,
headers, responses and request bodies are in openapi_parts.py.
"""

from __future__ import annotations

import re
from typing import Any

from ..domain.limits import (
    MAX_VALUE_BYTES,
)
from .components import component_schemas
from .dashboard import ASSETS
from .openapi_parts import (
    AUTH_TEXT,
    BAD_CALLER,
    JSON,
    MEMORY_HEADERS,
    MERGE_PATCH,
    NO_STORE,
    Json,
    body_errors,
    conversation_operations,
    dashboard_file,
    operation,
    problem,
    ref,
    request_body,
    response,
    shared_headers,
    shared_parameters,
    version,
)
from .openapi_webhooks import webhook_events, webhook_operations
from .queries import (
    AuditQuery,
    ConversationsQuery,
    MemoryQuery,
    RepeatCallersQuery,
    SweepsQuery,
)


def _operations() -> dict[tuple[str, str], Json]:
    stored = "StoredProjectConfig"
    precondition = problem("If-Match did not match; `ETag` holds the current one.", "ETag")
    return {
        ("get", "/healthz"): operation(
            "healthz", None, "Liveness", {"200": response("Alive: `ok`.", "Health")}
        ),
        ("get", "/metrics"): operation(
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
        ("post", "/v1/admin/sweeps"): operation(
            "run_sweep",
            "operator",
            "Run an expiry sweep now",
            {
                "200": response(
                    "What the sweep removed and how long it took, and how many inactivity ends it ran.",
                    "SweepRun",
                ),
                "404": None,
                "409": problem("Another sweep holds the lease (on this or another replica)."),
                "422": None,
            },
            description="Removes expired fields, callers left empty, expired first-interaction records, "
            "conversation records and analytics entries, in bounded batches, for at most 30 seconds; then "
            "runs the inactivity ends that are due (conversations nobody ended within "
            "`end_after_inactivity`), as the scheduler does every CALLER_MEMORY_INACTIVITY_INTERVAL.",
        ),
        ("get", "/v1/admin/sweeps"): operation(
            "list_sweeps",
            "operator",
            "Recent sweeps",
            {
                "200": response("The latest sweeps, newest first (at most 100 are kept).", "SweepList"),
                "404": None,
                "422": problem("A malformed `limit`."),
            },
            query=SweepsQuery,
        ),
        ("get", "/v1/projects/{project}/audit"): operation(
            "list_audit",
            "admin",
            "Audit records: erasures, configuration and token changes",
            {
                "200": response("Audit records, newest first.", "AuditList"),
                "422": problem("A malformed `limit` or `before`."),
            },
            query=AuditQuery,
        ),
        ("get", "/readyz"): operation(
            "readyz",
            None,
            "Readiness: the store answers",
            {
                "200": response("Ready.", "Health"),
                "503": response("Not ready: `unready`, with a `detail` (not a problem document).", "Health"),
            },
        ),
        ("get", "/openapi.json"): operation(
            "openapi",
            None,
            "This API description",
            {"200": {"description": "This document.", "content": {JSON: {"schema": {"type": "object"}}}}},
        ),
        ("get", "/dashboard"): operation(
            "dashboard",
            None,
            "The repeat-caller dashboard page",
            {
                "200": dashboard_file("The page.", "text/html"),
                "304": response("Unchanged since the ETag given in If-None-Match."),
            },
            parameters=("If-None-Match",),
            description="Static; it holds no data. The page asks for a project id and a token with the "
            "`analytics` or `admin` role, keeps the token in the browser tab's session storage, and calls the "
            "analytics endpoints with it. Nothing is loaded from outside the service.",
        ),
        ("get", "/favicon.ico"): operation(
            "favicon",
            None,
            "The service's icon (the dashboard's), which browsers ask for by themselves",
            {
                "200": dashboard_file("The icon, as SVG.", "image/svg+xml"),
                "304": response("Unchanged since the ETag given in If-None-Match."),
            },
            parameters=("If-None-Match",),
        ),
        ("get", "/dashboard/{asset}"): operation(
            "dashboard_asset",
            None,
            "A script or style sheet of the dashboard page",
            {
                "200": dashboard_file("The file.", *sorted(set(ASSETS.values()))),
                "304": response("Unchanged since the ETag given in If-None-Match."),
                "404": problem("No such file."),
            },
            parameters=("If-None-Match",),
        ),
        ("put", "/v1/projects/{project}"): operation(
            "put_project",
            "operator",
            "Create or replace a project's configuration",
            {
                "200": response("Replaced; the configuration as stored.", stored),
                "201": response("Created; the configuration as stored.", stored),
                "404": None,  # the operator sees every project; a project token gets 403 first
                "422": problem("Invalid project id or configuration; `errors` names each offending field."),
                **body_errors(),
            },
            body=request_body(
                "ProjectConfig", "The whole configuration document; missing members take defaults."
            ),
        ),
        ("get", "/v1/projects/{project}"): operation(
            "get_project",
            "admin",
            "Read a project's configuration",
            {"200": response("The configuration.", stored)},
        ),
        ("post", "/v1/projects/{project}/tokens"): operation(
            "create_token",
            "admin",
            "Mint a project token",
            {
                "201": response("The new token with its secret, shown once.", "MintedToken", "Cache-Control"),
                "422": problem("Unknown role or member, or a label too long; `errors` names the field."),
                **body_errors(),
            },
            body=request_body("TokenCreate", "The role of the new token, and a label for people."),
        ),
        ("get", "/v1/projects/{project}/tokens"): operation(
            "list_tokens",
            "admin",
            "List the project's tokens",
            {"200": response("No secrets.", "TokenList")},
        ),
        ("delete", "/v1/projects/{project}/tokens/{token_id}"): operation(
            "revoke_token",
            "admin",
            "Revoke a token",
            {
                "204": response("Revoked; other replicas refuse it within their token cache time."),
                "404": problem("No such project, or no such token in it."),
            },
        ),
        ("get", "/v1/projects/{project}/callers/{identifier}/memory"): operation(
            "read_memory",
            "agent",
            "Read a caller's memory",
            {
                "200": response(
                    "Live memory; empty for unknown or blacklisted callers.", "Memory", *MEMORY_HEADERS
                ),
                "304": response("Unchanged since an ETag given in If-None-Match.", None, *MEMORY_HEADERS),
                "422": problem(f"{BAD_CALLER}, or an attestation no provider sends."),
            },
            parameters=("If-None-Match",),
            query=MemoryQuery,
            description="An agent's read is a call's: the fields the call's caller-ID trust does not qualify "
            "for are left out and listed in `withheld` (the ETag depends on them). Through a linked "
            "identifier, the profile's memory.",
        ),
        ("patch", "/v1/projects/{project}/callers/{identifier}/memory"): operation(
            "patch_memory",
            "admin",
            "Merge-patch a caller's fields",
            {
                "200": response(
                    "The memory after the write; dropped for blacklisted callers.", "Memory", *MEMORY_HEADERS
                ),
                "412": precondition,
                "422": problem(
                    f"{BAD_CALLER}, the body is not an object, a name is not a valid field name or not in "
                    f"`state_keys`, or a value is over {MAX_VALUE_BYTES} bytes. Nothing is changed."
                ),
                **body_errors(),
            },
            parameters=("If-Match",),
            body=request_body("MemoryPatch", "Fields to set; `null` deletes.", JSON, MERGE_PATCH),
        ),
        ("delete", "/v1/projects/{project}/callers/{identifier}/memory/{field}"): operation(
            "delete_field",
            "admin",
            "Delete one field of a caller's memory",
            {
                "200": response(
                    "The memory after the delete (an absent field is no error).", "Memory", *MEMORY_HEADERS
                ),
                "412": precondition,
                "422": problem(f"{BAD_CALLER}, or the field name is not valid."),
            },
            parameters=("If-Match",),
        ),
        ("delete", "/v1/projects/{project}/callers/{identifier}"): operation(
            "erase_caller",
            "admin",
            "Erase everything about a caller",
            {
                "200": response("The erasure receipt; it holds no phone number.", "ErasureReceipt"),
                "422": problem(f"{BAD_CALLER}."),
            },
        ),
        ("post", "/v1/projects/{project}/callers/{identifier}/links"): operation(
            "create_link",
            "agent",
            "Link another identifier to a caller (merging its memory if asked)",
            {
                "200": response("It was linked already: renewed.", "LinkCreated", *NO_STORE),
                "201": response("Linked.", "LinkCreated", *NO_STORE),
                "403": problem(
                    "The project does not link identifiers, or an agent's request without `step_up`."
                ),
                "409": problem(
                    "The identifier is linked elsewhere, has links of its own, has memory and `merge` was not "
                    "given, or the caller has five identifiers already. Nothing is changed."
                ),
                "422": problem(
                    f"{BAD_CALLER}, a bad body identifier, the same identifier, or a blacklisted one."
                ),
                **body_errors(),
            },
            body=request_body("LinkBody", "The identifier to link."),
            description="An admin, or an agent in a call whose caller passed a step-up check. Audited.",
        ),
        ("get", "/v1/projects/{project}/callers/{identifier}/links"): operation(
            "list_links",
            "admin",
            "A caller's linked identifiers",
            {
                "200": response("Kind and link id each.", "LinkList", *NO_STORE),
                "422": problem(f"{BAD_CALLER}."),
            },
        ),
        ("delete", "/v1/projects/{project}/callers/{identifier}/links/{other}"): operation(
            "delete_link",
            "admin",
            "Unlink an identifier (by the identifier, or by its link id)",
            {
                "200": response(
                    "Unlinked; what a merge moved stays with the caller.", "LinkRemoved", *NO_STORE
                ),
                "404": problem("No such project, or the caller has no such link."),
                "422": problem(f"{BAD_CALLER}, or `other` is neither an identifier nor a link id."),
            },
            description="Audited.",
        ),
        ("post", "/v1/projects/{project}/conversations/{conversation_id}/end"): operation(
            "end_conversation",
            "agent",
            "End a conversation: persist its state and record its outcome",
            {
                "200": response(
                    "What was persisted and ignored; a retry gets the same answer.",
                    "ConversationEnded",
                    "Idempotent-Replayed",
                ),
                "409": problem(
                    "This conversation id was already ended with a different request (or, after the "
                    "service ended it, ended late with a different request)."
                ),
                "422": problem(
                    "Malformed conversation id, caller that is not a possible phone number, invalid state key "
                    "or value, unknown `end_reason` or member; `errors` names the field."
                ),
                **body_errors(),
            },
            body=request_body(
                "EndRequest",
                "The caller, the conversation's state (`conv.state`), its outcome and channel.",
            ),
            description="Idempotent on the conversation id: a retry with the same body applies nothing twice. "
            "With conversation memory on, it also ends the transcript; if the service had already ended it "
            "(by inactivity or supersession), the end is *late*: `late: true`, its state applied as a merge "
            "patch written at its time, analytics as recorded.",
        ),
        **conversation_operations(),
        **webhook_operations(),
        ("get", "/v1/projects/{project}/analytics/conversations"): operation(
            "list_conversations",
            "analytics",
            "Conversations with their repeat-caller metrics",
            {
                "200": {
                    "description": "A page of conversations. With `Accept: text/csv`, the same columns as CSV "
                    "(cells that a spreadsheet would run as formulas are prefixed with `'`); the next page is "
                    "in `X-Next-Cursor` and `Link`.",
                    "headers": {
                        name: ref(name, "headers") for name in ("Cache-Control", "X-Next-Cursor", "Link")
                    },
                    "content": {
                        JSON: {"schema": ref("ConversationList")},
                        "text/csv": {"schema": {"type": "string"}},
                    },
                },
                "422": problem("A malformed query parameter; `errors` names it."),
            },
            query=ConversationsQuery,
        ),
        ("get", "/v1/projects/{project}/analytics/repeat-callers"): operation(
            "repeat_callers",
            "analytics",
            "Repeat-caller rate over time, time to callback, and breakdowns by the first interaction",
            {
                "200": response(
                    "The report, computed from per-bucket counters.", "RepeatCallerReport", "Cache-Control"
                ),
                "422": problem("A malformed query parameter, or too many buckets; `errors` names it."),
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
    if "/conversations" in path:
        return "conversation"
    if "/webhooks" in path:
        return "webhook"
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
    conversation = project | {"conversation_id": "$request.path.conversation_id"}
    transcript = {
        "ConversationStatus": to("conversation_status", conversation),
        "History": to("conversation_history", conversation),
        "Context": to("conversation_context", conversation),
        "PutSummary": to("put_summary", conversation),
        "AppendMessages": to("append_messages", conversation),
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
        ("create_link", "201"): {
            "ListLinks": to("list_links", caller),
            "Unlink": to("delete_link", caller | {"other": "$response.body#/link/link_id"}),
        },
        ("read_memory", "200"): memory,
        ("patch_memory", "200"): memory,
        ("delete_field", "200"): memory,
        ("erase_caller", "200"): {"ReadMemory": memory["ReadMemory"], "ListAudit": to("list_audit", project)},
        ("end_conversation", "200"): {
            "ReadCallerMemory": to("read_memory", project | {"identifier": "$request.body#/caller"}),
            "ConversationStatus": to("conversation_status", conversation),
            "Retry": to(
                "end_conversation",
                project | {"conversation_id": "$response.body#/conversation_id"},
                requestBody="$request.body",
            ),
            "ListConversations": to("list_conversations", project),
            "RepeatCallers": to("repeat_callers", project),
        },
        ("start_conversation", "200"): transcript | {"Delete": to("delete_conversation", conversation)},
        ("append_messages", "200"): transcript
        | {
            "Retry": to("append_messages", conversation, requestBody="$request.body"),
            "End": to("end_conversation", conversation),
        },
        ("conversation_history", "200"): {
            "HistoryIfChanged": to(
                "conversation_history", conversation | {"header.If-None-Match": "$response.header.ETag"}
            ),
        },
        ("put_summary", "200"): {"Context": transcript["Context"]},
        ("delete_conversation", "204"): {"ConversationStatus": transcript["ConversationStatus"]},
        ("list_conversations", "200"): {
            "NextPage": to("list_conversations", project | {"query.cursor": "$response.body#/next_cursor"}),
        },
        ("caller_conversations", "200"): {
            "NextPage": to("caller_conversations", caller | {"query.cursor": "$response.body#/next_cursor"}),
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
        for status, answer in op["responses"].items():
            if (op["operationId"], status) in links:
                op["responses"][status] = answer | {"links": links[op["operationId"], status]}
        item = paths.setdefault(path, {})
        if "{" in path and "parameters" not in item:
            item["parameters"] = [ref(name, "parameters") for name in re.findall(r"\{(\w+)\}", path)]
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
        "info": {"title": "Caller Memory", "version": version(), "description": description},
        "tags": [
            {"name": "service", "description": "Probes and this description; no authentication."},
            {"name": "project", "description": "Project configuration."},
            {"name": "token", "description": "Project tokens."},
            {"name": "memory", "description": "Caller memory, addressed by phone number."},
            {
                "name": "conversation",
                "description": "Conversation memory (a call's transcript, its summary, the context for the "
                "next inference, resume after a dropped call) and the end of a conversation, as the agent's "
                "SDK sends them.",
            },
            {"name": "analytics", "description": "Repeat-caller analytics: conversations and the report."},
            {
                "name": "webhook",
                "description": "Webhook endpoints (signed deliveries of conversation.ended, "
                "conversation.updated and caller.erased; see `webhooks`) and their failed deliveries.",
            },
            {"name": "operator", "description": "Expiry sweeps; the operator token only."},
            {"name": "audit", "description": "The project's audit log."},
            {
                "name": "dashboard",
                "description": "The dashboard page and its files; the data calls need a token.",
            },
        ],
        "security": [{"bearerAuth": []}],
        "paths": _paths(),
        "webhooks": webhook_events(),
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer", "description": AUTH_TEXT}},
            "schemas": component_schemas(),
            "parameters": shared_parameters(),
            "headers": shared_headers(),
        },
    }
