"""Caller Memory as MCP tools (SPEC section 17), on the official ``mcp`` SDK's server.

- :mod:`.connection`: who a request is (its project, the call it is bound to or a staff member, the erasure
  opt-in), found by the HTTP layer from the token and headers, never from what a model writes.
- :mod:`.agent_tools`: the tools of an agent connection, bound to one started conversation.
- :mod:`.staff_tools`: the read-only tools of a ``staff`` token, and the erasure a connection opts into.
- :mod:`.servers`: the three servers (agent, staff, staff with erasure) the HTTP layer chooses from.
- :mod:`.stdio`: ``caller-memory mcp``, a stdio server relaying to a running service.

The transport (Streamable HTTP, stateless, JSON answers) is bridged into aiohttp in
:mod:`caller_memory.service.http.mcp_bridge`; nothing here imports aiohttp.
"""
