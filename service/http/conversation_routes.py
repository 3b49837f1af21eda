"""Conversation memory endpoints (SPEC sections 10 and 14): start, append, status, history, summary, context,
and the admin's listing and deletion. Thin: parse, call the domain (transcript_service.py, lifecycle.py),
serialise its views (transcript_views.py) as they are."""

from __future__ import annotations

from urllib.parse import urlencode

from aiohttp import web

from ..domain.conversations.call_trust import ConversationTrust
from ..domain.conversations.requests import EVERYONE, Reader, read_append
from ..domain.conversations.service import TranscriptService
from ..domain.fields import entity_tags
from ..domain.limits import MAX_BODY_BYTES
from ..domain.projects import Project
from ..domain.tokens import Principal, Role
from .app_keys import SERVICES, Services
from .openapi_parts import (
    BAD_CALLER,
    JSON,
    NO_STORE_HEADERS,
    THIS_CALLER,
    THIS_CONVERSATION,
    Json,
    body_errors,
    link,
    problem,
    ref,
    request_body,
    response,
)
from .operations import documented
from .queries import CallerConversationsQuery, ContextQuery, HistoryQuery, parse_query
from .responses import json_response
from .routes import PRINCIPAL, actor, call_for, project_for, read_body, read_json

routes = web.RouteTableDef()

CONVERSATION = "/v1/projects/{project}/conversations/{conversation_id}"
#: Transcripts are personal data: no answer about one is kept by a cache.
NO_STORE = {"Cache-Control": "no-store"}

TRANSCRIPT_404 = (
    "No such project; or the conversation has no transcript: it never had one, an admin deleted it, or "
    "the project has conversation memory off (`memory.conversation.enabled`)."
)
TRANSCRIPT_410 = (
    "The transcript expired (`transcript_retention` after its last activity) or its caller was erased; "
    "said for as long as the service remembers the conversation id."
)
BAD_CONVERSATION = "A malformed conversation id"
#: What an answer about a transcript lets a client do next.
TRANSCRIPT_LINKS = {
    "ConversationStatus": link("conversation_status", THIS_CONVERSATION),
    "History": link("conversation_history", THIS_CONVERSATION),
    "Context": link("conversation_context", THIS_CONVERSATION),
    "PutSummary": link("put_summary", THIS_CONVERSATION),
    "AppendMessages": link("append_messages", THIS_CONVERSATION),
}
TRANSCRIPT_NOT_FOUND, TRANSCRIPT_GONE = problem(TRANSCRIPT_404), problem(TRANSCRIPT_410)


def history_answer() -> Json:
    """The 200 answer of the history: the platform layout or OpenAI's, with a weak ETag."""
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


def reader_for(principal: Principal, project: Project) -> Reader:
    """Whose messages a read shows. Under ``transcript_scope: "agent"``, an agent token sees the user's
    messages and those of the agent it was minted for; one minted for no agent sees the user's only (it
    is no agent of the conversation, and agent scope exists so that agents do not read each other). Admins
    and the operator see everything (and their reads are audited)."""
    if not project.conversation.agent_scope or principal.operator or principal.role is not Role.AGENT:
        return EVERYONE
    return Reader(agent=principal.agent or "")


def writer_for(principal: Principal) -> str | None:
    """The agent an agent token minted for one acts as: what it writes is attributed to that agent."""
    if principal.operator or principal.role is not Role.AGENT:
        return None
    return principal.agent or None


def audited(principal: Principal) -> bool:
    """Reads of transcripts by an admin (or the operator) are audited; the agent in the call is not."""
    return principal.operator or principal.role is Role.ADMIN


async def conversation_for(request: web.Request, role: Role) -> tuple[Services, Project, str]:
    services, project = await project_for(request, role)
    return services, project, request.match_info["conversation_id"]


@routes.post(CONVERSATION + "/start")
@documented(
    "agent",
    "Start a conversation; offers `resume` after a dropped call",
    {
        "200": response(
            "The conversation (`stored: false`, with a `reason`, when nothing is kept: conversation "
            "memory off, a blacklisted caller, or a caller erased since), the `resume` offer, and "
            "the caller's open conversations on this channel that this start ended (`superseded`).",
            "Started",
            *NO_STORE_HEADERS,
        ),
        "409": problem("The conversation id belongs to another caller."),
        "410": TRANSCRIPT_GONE,
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
    links={"200": TRANSCRIPT_LINKS | {"Delete": link("delete_conversation", THIS_CONVERSATION)}},
)
async def start_conversation(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    document = await read_json(request)
    started = await services.lifecycle.start(
        project,
        conversation_id,
        document,
        reader=reader_for(request[PRINCIPAL], project),
        writer=writer_for(request[PRINCIPAL]),
    )
    return json_response(started, headers=NO_STORE)


@routes.post(CONVERSATION + "/messages")
@documented(
    "agent",
    "Append messages (and a state checkpoint) to the transcript",
    {
        "200": response(
            "The conversation's counts after the append; `stored: false` with a `reason` when "
            "nothing is kept (conversation memory off, a blacklisted or erased caller).",
            "Appended",
            *NO_STORE_HEADERS,
        ),
        "404": problem(
            "No such project; or the conversation has not started: send `caller` and `channel` "
            "with its first messages, or start it."
        ),
        "409": problem(
            "The conversation has ended, belongs to another caller, or a message id is already in "
            "it with another body."
        ),
        "410": TRANSCRIPT_GONE,
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
    links={
        "200": TRANSCRIPT_LINKS
        | {
            "Retry": link("append_messages", THIS_CONVERSATION, requestBody="$request.body"),
            "End": link("end_conversation", THIS_CONVERSATION),
        }
    },
)
async def append_messages(request: web.Request) -> web.Response:
    received_at = request.app[SERVICES].clock.now_ms()  # before anything else: an erasure after this wins
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    document = read_append(await read_body(request))
    appended = await services.transcripts.append(
        project, conversation_id, document, received_at=received_at, writer=writer_for(request[PRINCIPAL])
    )
    return json_response(appended, headers=NO_STORE)


@routes.get(CONVERSATION)
@documented(
    "agent",
    "A conversation's status and counters",
    {
        "200": response(
            "Status, times, turns, counts, summary coverage.", "ConversationStatus", *NO_STORE_HEADERS
        ),
        "404": TRANSCRIPT_NOT_FOUND,
        "410": TRANSCRIPT_GONE,
        "422": problem(f"{BAD_CONVERSATION}."),
    },
)
async def conversation_status(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    status = await services.transcripts.status(project, conversation_id)
    return json_response(status, headers=NO_STORE)


@routes.get(CONVERSATION + "/history")
@documented(
    "agent",
    "The transcript, in pages of whole turns",
    {
        "200": history_answer(),
        "304": response("Unchanged since the ETag given in If-None-Match.", None, *NO_STORE_HEADERS),
        "400": problem("`If-None-Match` is not a list of entity tags, or a header is not UTF-8."),
        "404": TRANSCRIPT_NOT_FOUND,
        "410": TRANSCRIPT_GONE,
        "422": problem(f"{BAD_CONVERSATION}, or a malformed query parameter; `errors` names it."),
    },
    parameters=("If-None-Match",),
    query=HistoryQuery,
    description="While the conversation is open, message times are as sent (epoch ms); once it "
    "ended, milliseconds from its start (`times`). Under `transcript_scope: agent`, an agent token "
    "sees the user's messages and its own agent's. Admin reads are audited.",
    links={
        "200": {
            "HistoryIfChanged": link(
                "conversation_history", THIS_CONVERSATION | {"header.If-None-Match": "$response.header.ETag"}
            )
        }
    },
)
async def conversation_history(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    query = parse_query(request, HistoryQuery)
    if_none_match = request.headers.get("If-None-Match")
    # A malformed header is refused before anything is read (or audited).
    held = entity_tags(if_none_match, "If-None-Match") if if_none_match is not None else None
    reader = reader_for(request[PRINCIPAL], project)
    body, header = await services.transcripts.history(
        project,
        conversation_id,
        reader=reader,
        after_turn=query.after_turn,
        limit=query.limit,
        openai=query.format == "openai",
        call=call_for(request, query.attestation, query.step_up),
        audited_as=actor(request) if audited(request[PRINCIPAL]) else None,
    )
    # The status the platform layout shows (active or idle) follows the clock, not only the header.
    shown = body.get("status")
    etag = TranscriptService.etag(header, reader, query.format, query.after_turn, query.limit, shown)
    headers = {"ETag": etag, **NO_STORE}
    if held is not None and ("*" in held or etag.removeprefix("W/") in {t.removeprefix("W/") for t in held}):
        return web.Response(status=304, headers=headers)
    return json_response(body, headers=headers)


@routes.put(CONVERSATION + "/summary")
@documented(
    "agent",
    "Store the agent's summary of the turns so far",
    {
        "200": response(
            "The conversation's status with the new summary coverage.",
            "ConversationStatus",
            *NO_STORE_HEADERS,
        ),
        "404": TRANSCRIPT_NOT_FOUND,
        "410": TRANSCRIPT_GONE,
        "422": problem(
            f"{BAD_CONVERSATION}, `through_turn` beyond the conversation's latest turn, a text too "
            "long, or an unknown member; `errors` names the field."
        ),
        **body_errors(),
    },
    body=request_body("SummaryBody", "The summary text, the last turn it covers, its tokens."),
    description="The service runs no model: the agent summarises older turns itself (when "
    "`context` says `needs_summary`). Phone numbers in the text are replaced as in messages.",
    links={"200": {"Context": TRANSCRIPT_LINKS["Context"]}},
)
async def put_summary(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    document = await read_json(request)
    status = await services.transcripts.put_summary(
        project, conversation_id, document, reader=reader_for(request[PRINCIPAL], project)
    )
    return json_response(status, headers=NO_STORE)


@routes.post(CONVERSATION + "/trust")
@documented(
    "agent",
    "Raise the call's trust: a step-up check passed",
    {
        "204": response("Kept: the call counts as stepped up until it ends."),
        "404": TRANSCRIPT_NOT_FOUND,
        "409": problem("The conversation has ended: a step-up holds for a call in progress."),
        "422": problem(
            f"{BAD_CONVERSATION}, `step_up` not `true`, or an unknown member; `errors` names the field."
        ),
        **body_errors(),
    },
    body=request_body("TrustBody", '`{"step_up": true}`.'),
    description="A conversation keeps the trust of its start (its attestation, a step-up). After the "
    "caller passes the business's own check (a PIN, a one-time code), this raises step-up for the rest "
    "of the call: what reads memory for the call later (the memory proxy, a platform's end) shows the "
    "fields the project keeps for stepped-up calls. It never lowers the attestation. Audited.",
    links={"204": {"ConversationStatus": TRANSCRIPT_LINKS["ConversationStatus"]}},
)
async def raise_trust(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    document = await read_json(request)
    trust = ConversationTrust(services.store, services.clock, services.audit)
    await trust.raise_step_up(project, conversation_id, document, actor=actor(request))
    return web.Response(status=204)


@routes.get(CONVERSATION + "/context")
@documented(
    "agent",
    "The context for the next inference, within a token budget",
    {
        "200": response(
            "Sections `profile` (the caller's memory, capped at a quarter of the budget), `summary` "
            "and `recent_turns` (the latest whole turns after the summary that fit, older ones "
            "dropped first), each with its provenance and tokens; `needs_summary` once the "
            "unsummarised turns pass 75% of the budget.",
            "Context",
            *NO_STORE_HEADERS,
        ),
        "404": TRANSCRIPT_NOT_FOUND,
        "410": TRANSCRIPT_GONE,
        "422": problem(f"{BAD_CONVERSATION}, or a malformed `max_tokens`; `errors` names it."),
    },
    query=ContextQuery,
    description="Token counts are the client's where it gave them, otherwise an estimate "
    "(`token_source`). Admin reads are audited.",
)
async def conversation_context(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    query = parse_query(request, ContextQuery)
    context = await services.transcripts.context(
        project,
        conversation_id,
        query.max_tokens,
        reader=reader_for(request[PRINCIPAL], project),
        call=call_for(request, query.attestation, query.step_up),
        audited_as=actor(request) if audited(request[PRINCIPAL]) else None,
    )
    return json_response(context, headers=NO_STORE)


@routes.get("/v1/projects/{project}/callers/{identifier}/conversations")
@documented(
    "admin",
    "A caller's conversations (their transcripts' status), a page at a time",
    {
        "200": response(
            "Newest start first, at most `limit`; the next page's cursor is `next_cursor` (null on "
            "the last page), also in `X-Next-Cursor` and `Link`. A page may hold fewer than `limit` "
            "while more follow (expired transcripts are left out).",
            "CallerConversations",
            *NO_STORE_HEADERS,
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
    links={
        "200": {
            "NextPage": link(
                "caller_conversations", THIS_CALLER | {"query.cursor": "$response.body#/next_cursor"}
            )
        }
    },
)
async def caller_conversations(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    identifier = request.match_info["identifier"]
    services.memory.caller(project, identifier)  # a bad identifier is reported as the path's `identifier`
    query = parse_query(request, CallerConversationsQuery)
    listed = await services.transcripts.for_caller(
        project, identifier, limit=query.limit, cursor=query.cursor
    )
    headers = dict(NO_STORE)
    cursor = listed["next_cursor"]
    if cursor is not None:
        headers["X-Next-Cursor"] = cursor
        # A reference by its query alone (RFC 3986: it keeps this request's path), so that the caller's
        # identifier in the path is not written back into a header.
        next_page = urlencode({**request.rel_url.query, "cursor": cursor})
        headers["Link"] = f'<?{next_page}>; rel="next"'
    return json_response(listed, headers=headers)


@routes.delete(CONVERSATION)
@documented(
    "admin",
    "Delete a conversation's transcript (audited)",
    {
        "204": response("Deleted: its messages, summary and state checkpoint; reads now answer 404."),
        "404": TRANSCRIPT_NOT_FOUND,
        "422": problem(f"{BAD_CONVERSATION}."),
    },
    links={"204": {"ConversationStatus": TRANSCRIPT_LINKS["ConversationStatus"]}},
)
async def delete_conversation(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.ADMIN)
    await services.transcripts.delete(project, conversation_id, actor=actor(request))
    return web.Response(status=204)
