"""The service's MCP servers (SPEC section 17): one per kind of connection, each with only the tools that
connection may use (a tool a connection may not call is not listed to it):

- ``agent``: the tools bound to one call (:mod:`.agent_tools`), for an agent or platform token naming a
  started conversation;
- ``staff``: the read-only staff tools (:mod:`.staff_tools`), for a ``staff`` token;
- ``erasure``: the staff tools and ``erase_caller``, for a staff connection that opts in.

Each is the official SDK's ``MCPServer`` served by its Streamable HTTP session manager in stateless mode with
JSON answers, so that any worker or replica answers any request. The one piece of state a request carries
to the next, an elicitation's sealed ``requestState`` (the erasure's confirmation), is sealed with a key
derived from the pseudonym key every process of a deployment shares, so the confirming request may land on
another process. The transport's own DNS-rebinding check is off, explicitly: every request must carry a bearer
token, which a page in a browser cannot send for another origin, and the HTTP route refuses any request
from a browser (an ``Origin`` header) before the SDK sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from mcp.server.mcpserver import MCPServer, RequestStateSecurity
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from .agent_tools import McpDomain, add_agent_tools
from .connection import McpConnection, principal_of
from .staff_tools import add_staff_tools

#: The largest request body an MCP request may have (a tool call's arguments are small; a remembered value
#: is at most a field's size).
MAX_REQUEST_BYTES = 64 * 1024
#: Seconds an erasure's confirmation may take (the sealed state of the question lives this long).
CONFIRMATION_SECONDS = 600.0
AGENT_INSTRUCTIONS = (
    "Caller Memory for this phone call. The caller's memory is usually in the conversation already; use "
    "get_caller_memory for a fresh read, remember to keep something for the caller's next call (one of the "
    "project's state keys), get_context and get_history for this call's own history."
)
STAFF_INSTRUCTIONS = (
    "Caller Memory for the business's staff: look up a caller's memory by their identifier, list their "
    "conversations, read a transcript. Every use is audited."
)


def request_state_key(pseudonym_key: bytes) -> bytes:
    """The key sealing an elicitation's request state: derived from the deployment's pseudonym key (shared by
    every process), never that key itself."""
    return hmac.new(pseudonym_key, b"caller-memory/mcp/request-state/v1", hashlib.sha256).digest()


@contextmanager
def _logging_kept() -> Iterator[None]:
    """The SDK's ``MCPServer`` configures the root logger when it is built (``logging.basicConfig``, a
    handler of its own where there is none): the service's logging stays as the service set it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@dataclass(frozen=True, slots=True)
class McpServers:
    agent: MCPServer[Any]
    staff: MCPServer[Any]
    erasure: MCPServer[Any]

    def for_connection(self, connection: McpConnection) -> MCPServer[Any]:
        if connection.call is not None:
            return self.agent
        return self.erasure if connection.erasure else self.staff

    def manager(self, connection: McpConnection) -> StreamableHTTPSessionManager:
        return self.for_connection(connection).session_manager

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The servers' session managers running (their task groups: enter and leave in one task)."""
        async with AsyncExitStack() as stack:
            for server in (self.agent, self.staff, self.erasure):
                await stack.enter_async_context(server.session_manager.run())
            yield


def _version() -> str:
    try:
        return metadata.version("caller-memory")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree not installed
        return ""


def build_servers(domain: McpDomain, pseudonym_key: bytes) -> McpServers:
    security = RequestStateSecurity(
        keys=[request_state_key(pseudonym_key)], ttl=CONFIRMATION_SECONDS, bind_principal=principal_of
    )

    version = _version()

    def server(name: str, instructions: str) -> MCPServer[Any]:
        with _logging_kept():
            built: MCPServer[Any] = MCPServer(
                name,
                instructions=instructions,
                version=version,
                request_state_security=security,
                warn_on_duplicate_tools=True,
            )
        return built

    agent = server("caller-memory", AGENT_INSTRUCTIONS)
    add_agent_tools(agent, domain)
    staff = server("caller-memory-staff", STAFF_INSTRUCTIONS)
    add_staff_tools(staff, domain, erasure=False)
    erasure = server("caller-memory-staff", STAFF_INSTRUCTIONS)
    add_staff_tools(erasure, domain, erasure=True)
    for each in (agent, staff, erasure):
        # Builds the server's session manager: stateless, JSON answers, the transport's settings explicit.
        each.streamable_http_app(
            json_response=True,
            stateless_http=True,
            # The bridge refuses a larger body first (the service's 413); this is the SDK's own bound.
            max_request_body_size=MAX_REQUEST_BYTES + 1,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
    return McpServers(agent, staff, erasure)
