"""The tools of a ``staff`` token (SPEC section 17): a business's staff looking up any caller of the project
from an MCP client (a desktop assistant). Read-only, each use audited with the actor ``mcp:<principal>``:

- ``lookup_caller``: a caller's memory by identifier (the identifier echoed as the service normalised it:
  the one place a tool answer holds one, because the staff member typed it);
- ``list_conversations``: a caller's conversations, newest first;
- ``read_transcript``: one conversation's transcript.

``erase_caller`` exists only on a connection that opts in (the header ``X-Caller-Memory-Erasure: allow``):
it asks the person at the client to confirm through MCP elicitation before anything is erased, is annotated
destructive, and answers the erasure's receipt.
"""

# No `from __future__ import annotations`: the SDK reads the tools' annotations at run time, and a resolver
# named in one (Resolve(confirm)) is a local name, not a global.
from typing import Annotated, Any

import orjson
from mcp.server.mcpserver import Context, Elicit, ElicitationResult, MCPServer, Resolve
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from mcp_types.version import is_version_at_least
from pydantic import BaseModel, Field

from ..domain.clock import iso_utc
from ..domain.conversations.service import DEFAULT_PAGE
from .agent_tools import READ_ONLY, McpDomain, tool_errors
from .connection import McpConnection, connection_of

#: The first protocol revision whose tool calls carry a confirmation as an input-required result.
INPUT_REQUIRED_VERSION = "2026-07-28"
#: The most conversations one ``list_conversations`` answers.
MAX_LISTED = 50

Identifier = Annotated[
    str,
    Field(
        min_length=1,
        max_length=320,
        description="The caller's phone number (E.164 or as dialled in the project's region), "
        "'email:<address>' or 'account:<id>'.",
    ),
]


class EraseConfirmation(BaseModel):
    """What the person at the client confirms before an erasure."""

    erase: bool = Field(
        description="true to erase everything Caller Memory holds about this caller, for good"
    )


def staff(ctx: Context[Any, Any]) -> McpConnection:
    connection = connection_of(ctx)
    if connection.call is not None:  # pragma: no cover - the HTTP layer serves agent connections other tools
        raise ToolError("staff tools need a staff connection, without X-Caller-Memory-Conversation")
    return connection


def add_staff_tools(server: MCPServer[Any], domain: McpDomain, *, erasure: bool) -> None:
    async def lookup_caller(identifier: Identifier, ctx: Context[Any, Any]) -> dict[str, Any]:
        """A caller's memory: what the business keeps about them between calls (audited)."""
        connection = staff(ctx)
        async with domain.calling("lookup_caller", connection.project.project_id):
            view = await domain.memory.read(connection.project, identifier)
            await domain.audit.record(
                connection.project.project_id,
                connection.actor,
                "caller.looked_up",
                {"fields": len(view.fields)},
            )
        return {
            "identifier": view.identifier,
            "fields": {name: orjson.loads(value) for name, value in view.fields.items()},
            "expires_at": None if view.expires_at is None else iso_utc(view.expires_at),
            "blacklisted": view.blacklisted,
        }

    async def list_conversations(
        identifier: Identifier,
        ctx: Context[Any, Any],
        limit: Annotated[int, Field(ge=1, le=MAX_LISTED, description="At most this many.")] = 20,
        cursor: Annotated[str | None, Field(description="The next_cursor of the page before.")] = None,
    ) -> dict[str, Any]:
        """A caller's conversations, newest first, each with its status and times (audited)."""
        connection = staff(ctx)
        async with domain.calling("list_conversations", connection.project.project_id):
            page = await domain.transcripts.for_caller(
                connection.project, identifier, limit=limit, cursor=cursor
            )
            await domain.audit.record(
                connection.project.project_id,
                connection.actor,
                "caller.conversations_listed",
                {"conversations": len(page["conversations"])},
            )
        return dict(page)

    async def read_transcript(
        conversation_id: Annotated[
            str, Field(min_length=1, max_length=128, description="The conversation's id.")
        ],
        ctx: Context[Any, Any],
        after_turn: Annotated[int, Field(ge=-1, description="Only the turns after this one (-1: all).")] = -1,
    ) -> dict[str, Any]:
        """One conversation's transcript in order (a page of at most 200 messages; audited)."""
        connection = staff(ctx)
        async with domain.calling("read_transcript", connection.project.project_id):
            history, _ = await domain.transcripts.history(
                connection.project,
                conversation_id,
                after_turn=None if after_turn < 0 else after_turn,
                limit=DEFAULT_PAGE,
                audited_as=connection.actor,
            )
        return dict(history)

    server.add_tool(lookup_caller, annotations=READ_ONLY)
    server.add_tool(list_conversations, annotations=READ_ONLY)
    server.add_tool(read_transcript, annotations=READ_ONLY)
    if not erasure:
        return

    async def confirm(identifier: str, ctx: Context[Any, Any]) -> Elicit[EraseConfirmation]:
        # The identifier is checked before anyone is asked: a bad one is an error at once.
        connection = staff(ctx)
        async with tool_errors():
            domain.memory.caller(connection.project, identifier)
        if not is_version_at_least(ctx.protocol_version or "", INPUT_REQUIRED_VERSION):
            # A stateless server has no channel to ask a handshake-era client anything mid-call.
            raise ToolError(
                "erase_caller asks for confirmation, which needs a client of MCP 2026-07-28 or later; nothing "
                "was erased (the HTTP API's erasure needs no MCP client: docs/api.md)"
            )
        return Elicit(
            "Erase everything Caller Memory holds about this caller (memory, transcripts, analytics, "
            "archived calls)? This cannot be undone.",
            EraseConfirmation,
        )

    async def erase_caller(
        identifier: Identifier,
        confirmation: Annotated[ElicitationResult[EraseConfirmation], Resolve(confirm)],
        ctx: Context[Any, Any],
    ) -> dict[str, Any]:
        """Erase everything about a caller (their right to erasure), after the person at the client confirms;
        answers the erasure's receipt (audited)."""
        connection = staff(ctx)
        if confirmation.action != "accept" or not confirmation.data.erase:
            return {"erased": False, "reason": "not confirmed: nothing was erased"}
        async with domain.calling("erase_caller", connection.project.project_id):
            receipt = await domain.memory.erase(connection.project, identifier, actor=connection.actor)
        return {
            "erased": True,
            "receipt_id": receipt.receipt_id,
            "erased_at": iso_utc(receipt.erased_at),
            "removed": receipt.removed(),
        }

    server.add_tool(
        erase_caller,
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
        ),
    )
