"""Bench only: the service exactly as ``python -m caller_memory.service serve`` runs it, with one more agent
tool, ``bench_constant``, that answers a constant given on the command line. Started by bench/mcp_bench.py;
never part of the product.

    python bench/mcp_launcher.py --port 8099 --constant '{"fields": {}, "withheld": [], "known": false}'

``caller_memory.service.app.create_app`` is wrapped before ``serve`` runs (the CLI imports it when it serves):
the wrapper builds the app with the real ``create_app`` and adds the tool to ``app[MCP].agent``, the SDK server
of agent connections. So the constant tool goes through everything ``get_caller_memory`` goes through (the
middlewares, the route's authentication and binding of the conversation, the ASGI bridge, the SDK's session
manager, its tool dispatch, the result's validation and serialization) and only the tool's body differs: it
checks the connection is bound to a call (``agent_call``, as every agent tool's first line) and returns the
constant instead of reading the caller's memory.
"""

# No `from __future__ import annotations`: the SDK reads the tool's annotations at run time (it finds the
# Context parameter by its type).

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Run as a script, bench/ comes first on sys.path: none of its modules may stand in for a library's.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

#: The bench-only tool's name.
CONSTANT_TOOL = "bench_constant"


def add_constant_tool(server: Any, answer: dict[str, Any]) -> None:
    """Add ``bench_constant`` to the agent connections' SDK server, annotated as get_caller_memory is."""
    from caller_memory.service.mcp.agent_tools import READ_ONLY, agent_call
    from mcp.server.mcpserver import Context

    async def bench_constant(ctx: Context[Any, Any]) -> dict[str, Any]:
        """Bench only: a constant answer, through the same stack as the other agent tools."""
        agent_call(ctx)
        return answer

    server.add_tool(bench_constant, annotations=READ_ONLY)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--constant", required=True, help="the JSON object bench_constant answers")
    args = parser.parse_args()
    answer = json.loads(args.constant)

    from caller_memory.service import app as service_app
    from caller_memory.service import cli
    from caller_memory.service.http.mcp_routes import MCP

    create_app = service_app.create_app

    def create_app_with_constant_tool(settings: Any, **kwargs: Any) -> Any:
        app = create_app(settings, **kwargs)
        add_constant_tool(app[MCP].agent, answer)
        return app

    service_app.create_app = create_app_with_constant_tool  # type: ignore[assignment]
    code: int = cli.main(["serve", "--port", str(args.port)])
    return code


if __name__ == "__main__":
    raise SystemExit(main())
