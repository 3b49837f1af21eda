"""The tools of an agent connection (SPEC section 17), bound to one started conversation by the connection
(:mod:`.connection`): the caller, the conversation and the call's trust are the connection's, never the
model's arguments.

- ``get_caller_memory``: the caller's live memory, without what the call's stored trust does not qualify for
  (those names listed as ``withheld``).
- ``remember``: one of the project's ``state_keys`` for the call's end to persist (any end: the SDK's, a
  platform's, the service's), checked and redacted like an end's state.
- ``get_context``: the context for one inference within a token budget (memory, summary, recent turns).
- ``get_history``: the call's transcript after a turn.

A bad argument, a key that is no state key, an ended call: a tool error naming what is wrong, changing
nothing. A store that does not answer is a tool error saying so, never a failed request: the agent goes on
without memory.
"""

# No `from __future__ import annotations`: the SDK reads the tools' annotations at run time, and a resolver
# named in one (Resolve(confirm)) is a local name, not a global.
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from ..domain.audit import AuditLog
from ..domain.clock import Clock
from ..domain.conversations.call_trust import stored_call_trust
from ..domain.conversations.service import DEFAULT_PAGE, TranscriptService
from ..domain.errors import CallerMemoryError, StoreUnavailable
from ..domain.memory import MemoryService
from ..domain.store import Store
from ..domain.trust import UNKNOWN_CALL, CallTrust
from .connection import AgentCall, McpConnection, connection_of

#: The largest token budget ``get_context`` takes (the HTTP API's).
MAX_CONTEXT_TOKENS = 1_000_000
#: What a read-only tool is (it changes nothing; the same call answers the same until the call moves on).
READ_ONLY = ToolAnnotations(
    read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False
)
UNAVAILABLE = "Caller Memory is unavailable right now; go on without it"


@dataclass(frozen=True, slots=True)
class McpDomain:
    """The use cases the tools call."""

    store: Store
    clock: Clock
    memory: MemoryService
    transcripts: TranscriptService
    audit: AuditLog
    #: A span around one tool's work (the service's tracing, where it is on): ``tool_span(tool, project)``.
    tool_span: Callable[[str, str], AbstractContextManager[object]] = lambda tool, project: nullcontext()

    @asynccontextmanager
    async def calling(self, tool: str, project: str) -> AsyncIterator[None]:
        """A tool's work: in a span of its own, its domain errors as tool errors."""
        with self.tool_span(tool, project):
            async with tool_errors():
                yield


@asynccontextmanager
async def tool_errors() -> AsyncIterator[None]:
    """A domain error as a tool error naming what is wrong (never a failed request); a store that does not
    answer as one saying so. Domain messages never hold a number."""
    try:
        yield
    except StoreUnavailable:
        raise ToolError(UNAVAILABLE) from None
    except TimeoutError:
        raise ToolError(UNAVAILABLE) from None
    except CallerMemoryError as exc:
        raise ToolError(exc.detail) from None


def agent_call(ctx: Context[Any, Any]) -> tuple[McpConnection, AgentCall]:
    connection = connection_of(ctx)
    if connection.call is None:
        raise ToolError(
            "this tool needs an agent connection: the header X-Caller-Memory-Conversation naming the call"
        )
    if connection.call.unbound is not None:
        raise ToolError(connection.call.unbound)
    return connection, connection.call


def add_agent_tools(server: MCPServer[Any], domain: McpDomain) -> None:
    async def trust(connection: McpConnection, call: AgentCall) -> CallTrust:
        project = connection.project
        if not project.trust.levels:
            return UNKNOWN_CALL  # no trust levels: nothing is withheld, nothing to read
        return await stored_call_trust(
            domain.store, project.project_id, call.conversation_id, domain.clock.now_ms()
        )

    async def get_caller_memory(ctx: Context[Any, Any]) -> dict[str, Any]:
        """The caller's memory as of now: what the business knows about this caller from earlier calls
        (e.g. their name, an open booking). Fields the call's caller-ID trust does not qualify for are left
        out and named in `withheld`. Prefer the memory already given in the conversation; call this for a
        fresh read."""
        connection, call = agent_call(ctx)
        async with domain.calling("get_caller_memory", connection.project.project_id):
            view = await domain.memory.read_of(
                connection.project, call.subject, await trust(connection, call)
            )
        return {
            "fields": {name: orjson.loads(value) for name, value in view.fields.items()},
            "withheld": list(view.withheld),
            "known": bool(view.fields),
        }

    async def remember(
        key: Annotated[str, Field(description="One of the project's state keys (e.g. 'name').")],
        value: Annotated[
            Any, Field(description="The value to keep: text, a number, true/false or an object.")
        ],
        ctx: Context[Any, Any],
    ) -> dict[str, Any]:
        """Remember something about the caller for their next call: the value of one of the project's state
        keys. It is saved into the caller's memory when this call ends. A later value of the same key
        replaces it."""
        connection, call = agent_call(ctx)
        async with domain.calling("remember", connection.project.project_id):
            kept = await domain.transcripts.remember(
                connection.project, call.conversation_id, key, value, await trust(connection, call)
            )
        return {"remembered": key, "kept": kept, "persisted": "when the call ends"}

    async def get_context(
        ctx: Context[Any, Any],
        max_tokens: Annotated[
            int, Field(ge=1, le=MAX_CONTEXT_TOKENS, description="The token budget of the context.")
        ] = 2000,
    ) -> dict[str, Any]:
        """The context for the next answer within `max_tokens`: the caller's memory, the summary of older
        turns and the most recent turns of this call, each section with its token count."""
        connection, call = agent_call(ctx)
        async with domain.calling("get_context", connection.project.project_id):
            context = await domain.transcripts.context(
                connection.project,
                call.conversation_id,
                max_tokens,
                reader=call.reader,
                call=await trust(connection, call),
            )
        return dict(context)

    async def get_history(
        ctx: Context[Any, Any],
        after_turn: Annotated[
            int, Field(ge=-1, description="Only the turns after this one (-1: from the start).")
        ] = -1,
    ) -> dict[str, Any]:
        """This call's transcript in order, after a turn (a page of at most 200 messages; `next_after_turn`
        names where the next page starts)."""
        connection, call = agent_call(ctx)
        async with domain.calling("get_history", connection.project.project_id):
            history, _ = await domain.transcripts.history(
                connection.project,
                call.conversation_id,
                reader=call.reader,
                after_turn=None if after_turn < 0 else after_turn,
                limit=DEFAULT_PAGE,
                call=await trust(connection, call),
            )
        return dict(history)

    server.add_tool(get_caller_memory, annotations=READ_ONLY)
    server.add_tool(
        remember,
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )
    server.add_tool(get_context, annotations=READ_ONLY)
    server.add_tool(get_history, annotations=READ_ONLY)
