"""Conversation memory endpoints (SPEC sections 10 and 14): start, append, status, history, summary, context,
and the admin's listing and deletion. Thin: parse, call the domain (transcript_service.py, lifecycle.py),
serialise its views (transcript_views.py) as they are."""

from __future__ import annotations

from urllib.parse import urlencode

from aiohttp import web

from ..domain.conversations.requests import EVERYONE, Reader, read_append
from ..domain.conversations.service import TranscriptService
from ..domain.fields import entity_tags
from ..domain.projects import Project
from ..domain.tokens import Principal, Role
from .app_keys import SERVICES, Services
from .queries import CallerConversationsQuery, ContextQuery, HistoryQuery, parse_query
from .responses import json_response
from .routes import PRINCIPAL, actor, call_for, project_for, read_body, read_json

routes = web.RouteTableDef()

CONVERSATION = "/v1/projects/{project}/conversations/{conversation_id}"
#: Transcripts are personal data: no answer about one is kept by a cache.
NO_STORE = {"Cache-Control": "no-store"}


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


async def record_read(
    request: web.Request, services: Services, project: Project, conversation_id: str, what: str
) -> None:
    if audited(request[PRINCIPAL]):
        await services.audit.record(
            project.project_id,
            actor(request),
            "transcript.read",
            {"conversation_id": conversation_id, "read": what},
        )


async def conversation_for(request: web.Request, role: Role) -> tuple[Services, Project, str]:
    services, project = await project_for(request, role)
    return services, project, request.match_info["conversation_id"]


@routes.post(CONVERSATION + "/start")
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
async def append_messages(request: web.Request) -> web.Response:
    received_at = request.app[SERVICES].clock.now_ms()  # before anything else: an erasure after this wins
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    document = read_append(await read_body(request))
    appended = await services.transcripts.append(
        project, conversation_id, document, received_at=received_at, writer=writer_for(request[PRINCIPAL])
    )
    return json_response(appended, headers=NO_STORE)


@routes.get(CONVERSATION)
async def conversation_status(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    status = await services.transcripts.status(project, conversation_id)
    return json_response(status, headers=NO_STORE)


@routes.get(CONVERSATION + "/history")
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
    )
    await record_read(request, services, project, conversation_id, "history")
    # The status the platform layout shows (active or idle) follows the clock, not only the header.
    shown = body.get("status")
    etag = TranscriptService.etag(header, reader, query.format, query.after_turn, query.limit, shown)
    headers = {"ETag": etag, **NO_STORE}
    if held is not None and ("*" in held or etag.removeprefix("W/") in {t.removeprefix("W/") for t in held}):
        return web.Response(status=304, headers=headers)
    return json_response(body, headers=headers)


@routes.put(CONVERSATION + "/summary")
async def put_summary(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    document = await read_json(request)
    status = await services.transcripts.put_summary(
        project, conversation_id, document, reader=reader_for(request[PRINCIPAL], project)
    )
    return json_response(status, headers=NO_STORE)


@routes.get(CONVERSATION + "/context")
async def conversation_context(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.AGENT)
    query = parse_query(request, ContextQuery)
    context = await services.transcripts.context(
        project,
        conversation_id,
        query.max_tokens,
        reader=reader_for(request[PRINCIPAL], project),
        call=call_for(request, query.attestation, query.step_up),
    )
    await record_read(request, services, project, conversation_id, "context")
    return json_response(context, headers=NO_STORE)


@routes.get("/v1/projects/{project}/callers/{identifier}/conversations")
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
async def delete_conversation(request: web.Request) -> web.Response:
    services, project, conversation_id = await conversation_for(request, Role.ADMIN)
    header = await services.transcripts.delete(project, conversation_id)
    await services.audit.record(
        project.project_id,
        actor(request),
        "transcript.deleted",
        {"conversation_id": conversation_id, "messages": header.messages},
    )
    return web.Response(status=204)
