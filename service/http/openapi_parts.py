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
from .dashboard import ASSETS, CONTENT_SECURITY_POLICY
from .queries import CallerConversationsQuery, ContextQuery, HistoryQuery, QueryModel, query_parameters

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
        "webhook_id": path(
            "webhook_id", "A webhook endpoint's id.", {"type": "string", "pattern": "^wh_[0-9a-f]{16}$"}
        ),
        "delivery_id": path(
            "delivery_id",
            "A delivery's id (its webhook-id header).",
            {"type": "string", "minLength": 1, "maxLength": 64},
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


def dashboard_file(description: str, *media: str) -> Json:
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
    "WebhookCreate": {
        "url": "https://crm.example.com/hooks/caller-memory",
        "events": ["conversation.ended", "caller.erased"],
        "include_history": False,
        "description": "CRM",
    },
    "WebhookRotate": {"grace_seconds": 86400},
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


# Operations -----------------------------------------------------------------------------------------------

MEMORY_HEADERS = ("ETag", "Cache-Control")
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


# Conversation memory --------------------------------------------------------------------------------------
# Its operations are written here rather than in openapi.py, which lists the others, to keep each module a
# readable size; openapi.py merges them in.

TRANSCRIPT_404 = (
    "No such project; or the conversation has no transcript: it never had one, an admin deleted it, or "
    "the project has conversation memory off (`memory.conversation.enabled`)."
)
TRANSCRIPT_410 = (
    "The transcript expired (`transcript_retention` after its last activity) or its caller was erased; "
    "said for as long as the service remembers the conversation id."
)
BAD_CONVERSATION = "A malformed conversation id"
NO_STORE = ("Cache-Control",)


def _history_answer() -> Json:
    tag = {
        "description": "Weak ETag of this answer (it changes with new messages, the summary and the status); "
        "send it in If-None-Match to poll cheaply.",
        "schema": {"type": "string", "pattern": '^W/"[0-9a-f]{20}"$'},
    }
    return {
        "description": "The transcript in order, in the platform layout; with `format=openai`, "
        "`{messages: [{role, content}]}` of the user's and the assistant's messages only.",
        "headers": {"ETag": tag, "Cache-Control": ref("Cache-Control", "headers")},
        "content": {JSON: {"schema": {"oneOf": [ref("History"), ref("OpenAIHistory")]}}},
    }


def conversation_operations() -> dict[tuple[str, str], Json]:
    conversation = "/v1/projects/{project}/conversations/{conversation_id}"
    not_found, gone = problem(TRANSCRIPT_404), problem(TRANSCRIPT_410)
    return {
        ("post", conversation + "/start"): operation(
            "start_conversation",
            "agent",
            "Start a conversation; offers `resume` after a dropped call",
            {
                "200": response(
                    "The conversation (`stored: false`, with a `reason`, when nothing is kept: conversation "
                    "memory off, a blacklisted caller, or a caller erased since), the `resume` offer, and "
                    "the caller's open conversations on this channel that this start ended (`superseded`).",
                    "Started",
                    *NO_STORE,
                ),
                "409": problem("The conversation id belongs to another caller."),
                "410": gone,
                "422": problem(
                    f"{BAD_CONVERSATION}, a caller that is not a possible phone number, a malformed channel "
                    "or agent name, or an unknown member; `errors` names the field."
                ),
                **body_errors(),
            },
            body=request_body("StartBody", "The caller, the channel, and the agent answering."),
            description="Starting again is harmless (the same conversation is answered). A conversation "
            "of the same caller on the same channel (any channel with `cross_channel`) that is still "
            "open is ended first (`ended_by: superseded`, its last state checkpoint persisted). One that "
            "ended by inactivity, by supersession or with `end_reason: dropped` within `resume_window` is "
            "offered as `resume`: its id, summary, last turns and last checkpoint.",
        ),
        ("post", conversation + "/messages"): operation(
            "append_messages",
            "agent",
            "Append messages (and a state checkpoint) to the transcript",
            {
                "200": response(
                    "The conversation's counts after the append; `stored: false` with a `reason` when "
                    "nothing is kept (conversation memory off, a blacklisted or erased caller).",
                    "Appended",
                    *NO_STORE,
                ),
                "404": problem(
                    "No such project; or the conversation has not started: send `caller` and `channel` "
                    "with its first messages, or start it."
                ),
                "409": problem(
                    "The conversation has ended, belongs to another caller, or a message id is already in "
                    "it with another body."
                ),
                "410": gone,
                "422": problem(
                    f"{BAD_CONVERSATION}; a message that breaks the schema (a `metadata.source` that does "
                    "not fit its role, interruption fields on a message that was not interrupted); turn ids "
                    "that go down; too many messages in the conversation; `caller` without `channel`; a "
                    "bad state key or value. `errors` names the field. Nothing is appended."
                ),
                **body_errors(),
                "413": problem(
                    f"The body is larger than {MAX_BODY_BYTES} bytes, a message is larger than its limit "
                    "once stored, or the transcript would pass its limit; the detail names which. Nothing "
                    "is appended."
                ),
                "507": problem(
                    "The project's transcripts are at `memory.conversation.max_transcript_bytes`; ends are "
                    "still taken."
                ),
            },
            body=request_body("AppendBody", "Messages in the platform layout, in order, appended whole."),
            description="`caller` and `channel` are needed when this starts the conversation. A message "
            "with a `message_id` already in the conversation with the same body is skipped (a retry is "
            "harmless); with another body it is a 409. Phone numbers said in `content` and `original` are "
            "replaced by `[phone]` (the caller's own always) before anything is stored. `state` is the "
            "state checkpoint an inactivity end persists.",
        ),
        ("get", conversation): operation(
            "conversation_status",
            "agent",
            "A conversation's status and counters",
            {
                "200": response(
                    "Status, times, turns, counts, summary coverage.", "ConversationStatus", *NO_STORE
                ),
                "404": not_found,
                "410": gone,
                "422": problem(f"{BAD_CONVERSATION}."),
            },
        ),
        ("delete", conversation): operation(
            "delete_conversation",
            "admin",
            "Delete a conversation's transcript (audited)",
            {
                "204": response("Deleted: its messages, summary and state checkpoint; reads now answer 404."),
                "404": not_found,
                "422": problem(f"{BAD_CONVERSATION}."),
            },
        ),
        ("get", conversation + "/history"): operation(
            "conversation_history",
            "agent",
            "The transcript, in pages of whole turns",
            {
                "200": _history_answer(),
                "304": response("Unchanged since the ETag given in If-None-Match.", None, *NO_STORE),
                "400": problem("`If-None-Match` is not a list of entity tags, or a header is not UTF-8."),
                "404": not_found,
                "410": gone,
                "422": problem(f"{BAD_CONVERSATION}, or a malformed query parameter; `errors` names it."),
            },
            parameters=("If-None-Match",),
            query=HistoryQuery,
            description="While the conversation is open, message times are as sent (epoch ms); once it "
            "ended, milliseconds from its start (`times`). Under `transcript_scope: agent`, an agent token "
            "sees the user's messages and its own agent's. Admin reads are audited.",
        ),
        ("put", conversation + "/summary"): operation(
            "put_summary",
            "agent",
            "Store the agent's summary of the turns so far",
            {
                "200": response(
                    "The conversation's status with the new summary coverage.",
                    "ConversationStatus",
                    *NO_STORE,
                ),
                "404": not_found,
                "410": gone,
                "422": problem(
                    f"{BAD_CONVERSATION}, `through_turn` beyond the conversation's latest turn, a text too "
                    "long, or an unknown member; `errors` names the field."
                ),
                **body_errors(),
            },
            body=request_body("SummaryBody", "The summary text, the last turn it covers, its tokens."),
            description="The service runs no model: the agent summarises older turns itself (when "
            "`context` says `needs_summary`). Phone numbers in the text are replaced as in messages.",
        ),
        ("get", conversation + "/context"): operation(
            "conversation_context",
            "agent",
            "The context for the next inference, within a token budget",
            {
                "200": response(
                    "Sections `profile` (the caller's memory, capped at a quarter of the budget), `summary` "
                    "and `recent_turns` (the latest whole turns after the summary that fit, older ones "
                    "dropped first), each with its provenance and tokens; `needs_summary` once the "
                    "unsummarised turns pass 75% of the budget.",
                    "Context",
                    *NO_STORE,
                ),
                "404": not_found,
                "410": gone,
                "422": problem(f"{BAD_CONVERSATION}, or a malformed `max_tokens`; `errors` names it."),
            },
            query=ContextQuery,
            description="Token counts are the client's where it gave them, otherwise an estimate "
            "(`token_source`). Admin reads are audited.",
        ),
        ("get", "/v1/projects/{project}/callers/{identifier}/conversations"): operation(
            "caller_conversations",
            "admin",
            "A caller's conversations (their transcripts' status), a page at a time",
            {
                "200": response(
                    "Newest start first, at most `limit`; the next page's cursor is `next_cursor` (null on "
                    "the last page), also in `X-Next-Cursor` and `Link`. A page may hold fewer than `limit` "
                    "while more follow (expired transcripts are left out).",
                    "CallerConversations",
                    *NO_STORE,
                    "X-Next-Cursor",
                    "Link",
                ),
                "422": problem(
                    f"{BAD_CALLER}, or a malformed `limit`, or a `cursor` this listing did not return; "
                    "`errors` names it."
                ),
            },
            query=CallerConversationsQuery,
            description="Each page costs what it holds, however many conversations the caller has.",
        ),
    }
