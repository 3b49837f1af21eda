"""Who an MCP request is, as the HTTP layer found it before the request reaches the SDK's server: put in the
ASGI scope under :data:`SCOPE_KEY` and read by every tool (:func:`connection_of`). A tool never takes the
caller, the conversation or the project from its arguments: a model cannot reach another call's memory
whatever it writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

from ..domain.conversations.requests import Reader
from ..domain.projects import Project

#: The ASGI scope's key holding the request's :class:`McpConnection`.
SCOPE_KEY = "caller_memory.mcp"
#: The request header naming the conversation an agent connection is bound to.
CONVERSATION_HEADER = "X-Caller-Memory-Conversation"
#: The request header by which a staff connection opts into the erasure tool (value ``allow``).
ERASURE_HEADER = "X-Caller-Memory-Erasure"


@dataclass(frozen=True, slots=True)
class AgentCall:
    """The call an agent connection is bound to: a started conversation and its caller's pseudonym."""

    conversation_id: str
    subject: str
    #: Whose transcript messages the token reads (``transcript_scope: "agent"``).
    reader: Reader
    #: Why the tools cannot answer for the call yet (it has not started, or was erased); None: bound.
    unbound: str | None = None


@dataclass(frozen=True, slots=True)
class McpConnection:
    project: Project
    #: How audit records name the request's principal (``mcp:token:<id>``, ``mcp:operator``).
    actor: str
    #: The agent connection's call; None for a staff connection.
    call: AgentCall | None = None
    #: A staff connection that opted into the erasure tool.
    erasure: bool = False


def connection_of(ctx: Context[Any, Any]) -> McpConnection:
    """The connection the HTTP layer bound this request to (a tool error if there is none: a server not
    reached through the service's route, which never happens in the service)."""
    request = ctx.request_context.request
    scope = getattr(request, "scope", None)
    found = scope.get(SCOPE_KEY) if isinstance(scope, dict) else None
    if not isinstance(found, McpConnection):
        raise ToolError("this request is bound to no Caller Memory connection")
    return found


def principal_of(ctx: Any) -> str | None:
    """The principal a sealed request state is bound to (the SDK's ``bind_principal``): the request's actor,
    so that an elicitation's state minted for one token is refused with another."""
    request = getattr(ctx, "request", None)
    scope = getattr(request, "scope", None)
    found = scope.get(SCOPE_KEY) if isinstance(scope, dict) else None
    return found.actor if isinstance(found, McpConnection) else None
