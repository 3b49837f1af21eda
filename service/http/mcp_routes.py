"""``/v1/projects/{project}/mcp``: Caller Memory as MCP tools (SPEC section 17), the official SDK's servers
(:mod:`caller_memory.service.mcp.servers`) behind the ASGI bridge (:mod:`.mcp_bridge`).

The route decides who the request is before the SDK sees it (the SDK's server only runs the tools):

- an ``Origin`` header (a page in a browser) is refused;
- with ``X-Caller-Memory-Conversation``: an agent connection (a token granting ``agent`` or ``platform``),
  bound to that started conversation of the project (its caller, its transcript, its call's trust);
- without it: a staff connection (a token granting ``staff``), with ``X-Caller-Memory-Erasure: allow`` the
  erasure tool too.

Whatever a model writes in a tool's arguments, it reaches only what the connection is bound to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from ..domain.conversations.ending import check_conversation_id
from ..domain.errors import Forbidden, InvalidInput, NotAcceptable, UnsupportedMediaType
from ..domain.projects import Project
from ..domain.store.transcripts import ConversationKey, TranscriptStatus
from ..domain.tokens import Role
from ..mcp.connection import CONVERSATION_HEADER, ERASURE_HEADER, SCOPE_KEY, AgentCall, McpConnection
from ..mcp.servers import MAX_REQUEST_BYTES, McpServers
from .app_keys import Services
from .conversation_routes import reader_for
from .mcp_bridge import serve_asgi
from .openapi_parts import JSON, Json, ref
from .operations import documented
from .routes import JSON_TYPES, PRINCIPAL, project_for

routes = web.RouteTableDef()

MCP_PATH = "/v1/projects/{project}/mcp"
MCP = web.AppKey("mcp", McpServers)


def mcp_lifecycle(servers: McpServers) -> Callable[[web.Application], AsyncIterator[None]]:
    """The cleanup context running the servers' session managers (entered and left in one task)."""

    async def run(started: asyncio.Event, stop: asyncio.Event) -> None:
        async with servers.running():
            started.set()
            await stop.wait()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # aiohttp runs a cleanup context's two halves in different tasks; the managers' task groups must be
        # entered and left in one, so they run in a task of their own.
        started, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run(started, stop))
        ready = asyncio.create_task(started.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # it failed to start: say why
            ready.cancel()
            task.result()
        yield
        stop.set()
        await task

    return lifecycle


async def _agent(request: web.Request, conversation_id: str) -> McpConnection:
    try:
        services, project = await project_for(request, Role.AGENT)
    except Forbidden:
        try:
            services, project = await project_for(request, Role.PLATFORM)
        except Forbidden:
            raise Forbidden(
                f"an agent connection (with {CONVERSATION_HEADER}) needs a token with role 'agent' or "
                f"'platform'; a staff token connects without that header"
            ) from None
    try:
        check_conversation_id(conversation_id)
    except InvalidInput:
        raise InvalidInput(
            f"the {CONVERSATION_HEADER} header must be a conversation id (1-128 of A-Z a-z 0-9 . _ : -)",
            field=CONVERSATION_HEADER,
        ) from None
    if ERASURE_HEADER in request.headers:
        raise InvalidInput(
            f"{ERASURE_HEADER} is for a staff connection (without {CONVERSATION_HEADER})",
            field=ERASURE_HEADER,
        )
    subject, unbound = await _subject(services, project, conversation_id)
    principal = request[PRINCIPAL]
    call = AgentCall(conversation_id, subject, reader_for(principal, project), unbound=unbound)
    return McpConnection(project, actor=f"mcp:{principal.name}", call=call)


async def _subject(services: Services, project: Project, conversation_id: str) -> tuple[str, str | None]:
    """The caller (pseudonym) of the started conversation ``conversation_id``, or "" and why its tools cannot
    answer yet. A connection may come before its call starts (a framework connects its tools when the agent
    starts): it lists the tools, and each call of one finds the conversation again."""
    header, _ = await services.store.read_conversation(
        ConversationKey(project.project_id, conversation_id), services.clock.now_ms()
    )
    if not project.conversation.enabled:
        return "", (
            "the project has conversation memory off (memory.conversation.enabled): a call is a conversation "
            "the tools find only with it on (docs/mcp.md)"
        )
    if header is None or not header.subject:
        return "", (
            f"conversation '{conversation_id}' has not started: start it first (the SDK's begin_turn, "
            "POST .../conversations/{id}/start, a platform's call start or Agora's join), then call again"
        )
    if header.status in (TranscriptStatus.ERASED, TranscriptStatus.DELETED):
        return "", f"conversation '{conversation_id}' was erased or deleted"
    return header.subject, None


async def _staff(request: web.Request) -> McpConnection:
    try:
        _, project = await project_for(request, Role.STAFF)
    except Forbidden:
        raise Forbidden(
            f"a staff connection (without {CONVERSATION_HEADER}) needs a token with role 'staff'; an agent or "
            f"platform token connects with that header, naming its call"
        ) from None
    opt_in = request.headers.get(ERASURE_HEADER)
    if opt_in is not None and opt_in != "allow":
        raise InvalidInput(f"{ERASURE_HEADER} must be 'allow' (or absent)", field=ERASURE_HEADER)
    return McpConnection(project, actor=f"mcp:{request[PRINCIPAL].name}", erasure=opt_in == "allow")


def check_transport(request: web.Request) -> None:
    """What the transport refuses, refused here first as the service refuses it (a problem document): a body
    that is not JSON in UTF-8, an ``Accept`` that does not take JSON (the SDK's own rule)."""
    charset = request.charset
    if request.content_type not in JSON_TYPES or (
        charset is not None and charset.lower() not in ("utf-8", "utf8")
    ):
        raise UnsupportedMediaType("send the body as JSON in UTF-8, with 'Content-Type: application/json'")
    accepted = {part.split(";")[0].strip().lower() for part in request.headers.get("Accept", "").split(",")}
    if not accepted & {"application/json", "application/*", "*/*"}:
        raise NotAcceptable(
            "the Accept header must take application/json (MCP's Streamable HTTP answers JSON)"
        )


#: The request body: one JSON-RPC message (what each method's params hold is MCP's, see docs/mcp.md).
JSON_RPC: Json = {
    "type": "object",
    "required": ["jsonrpc", "method"],
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": {"type": ["integer", "string"]},
        "method": {
            "type": "string",
            "enum": ["tools/list", "tools/call", "ping", "notifications/initialized"],
        },
        "params": {"type": "object"},
    },
}
#: How the endpoint answers an error: a JSON-RPC error object (what MCP clients read and show), at the HTTP
#: status the rest of the API would answer; the service's refusals carry its problem document as ``data``.
JSON_RPC_ERROR: Json = {
    "type": "object",
    "required": ["jsonrpc", "error"],
    "properties": {
        "jsonrpc": {"const": "2.0"},
        "id": {"type": ["integer", "string", "null"]},
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "integer"},
                "message": {"type": "string"},
                "data": {"type": "object"},
            },
        },
    },
}


def rpc_error(description: str, *headers: str) -> Json:
    answer: Json = {"description": description, "content": {JSON: {"schema": JSON_RPC_ERROR}}}
    if headers:
        answer["headers"] = {name: ref(name, "headers") for name in headers}
    return answer


MCP_RESPONSES: dict[str, Json | None] = {
    "200": {
        "description": "The JSON-RPC answer (tool results; a tool's error is a result with `isError: true`).",
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    "202": {"description": "A JSON-RPC notification, taken."},
    "400": rpc_error("Not one JSON-RPC request or notification of MCP, or a header value that is not UTF-8."),
    "401": rpc_error("Missing, malformed or unknown bearer token.", "WWW-Authenticate"),
    "403": rpc_error(
        "A request from a browser (an `Origin` header); a staff connection's token without role `staff`; an "
        "agent connection's without role `agent` or `platform`."
    ),
    "404": rpc_error("No such project, or the token belongs to another project."),
    "406": rpc_error("The `Accept` header does not take `application/json`."),
    "408": rpc_error("The body did not arrive within the body timeout (CALLER_MEMORY_BODY_TIMEOUT)."),
    "413": rpc_error("A body over 64 KiB."),
    "415": rpc_error("A body that is not `application/json` in UTF-8."),
    "422": rpc_error(
        "A malformed project id or conversation header, or an erasure header that is not `allow`."
    ),
    "429": rpc_error(
        "Too many failed authentications from this address lately, or this project already has its share of "
        "the requests in flight; retry after `Retry-After` seconds.",
        "Retry-After",
    ),
    "500": rpc_error("Unexpected error (logged), or the store holds data this version cannot read."),
    "503": rpc_error(
        "The store did not answer in time, or the service has its limit of requests in flight (then with "
        "`Retry-After`)."
    ),
}


@routes.post(MCP_PATH)
@documented(
    "agent",
    "MCP: Caller Memory as tools (Streamable HTTP, stateless, JSON answers)",
    MCP_RESPONSES,
    body={
        "required": True,
        "description": "One JSON-RPC request or notification of the Model Context Protocol.",
        "content": {
            JSON: {"schema": JSON_RPC, "example": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}}
        },
    },
    description="An agent connection (`X-Caller-Memory-Conversation` naming a started conversation; a token "
    "with role `agent` or `platform`) lists and calls get_caller_memory, remember, get_context and "
    "get_history, bound to that call. A staff connection (no conversation header; role `staff`) lists and "
    "calls lookup_caller, list_conversations and read_transcript, and with `X-Caller-Memory-Erasure: allow` "
    "erase_caller (confirmed through MCP elicitation). See docs/mcp.md.",
)
async def mcp_post(request: web.Request) -> web.StreamResponse:
    if "Origin" in request.headers:
        raise Forbidden("MCP requests from a page in a browser (an Origin header) are refused")
    conversation_id = request.headers.get(CONVERSATION_HEADER)
    if conversation_id is None:
        connection = await _staff(request)
    else:
        connection = await _agent(request, conversation_id)
    check_transport(request)  # once the caller is known: a stranger learns nothing from it
    manager = request.app[MCP].manager(connection)
    return await serve_asgi(
        request, manager.handle_request, {SCOPE_KEY: connection}, max_body=MAX_REQUEST_BYTES
    )
