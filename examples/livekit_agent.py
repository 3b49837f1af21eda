"""A LiveKit Agents receptionist that remembers its callers, with caller_memory.sdk.livekit.

As a LiveKit worker (SIP calls reach it through a LiveKit SIP trunk and dispatch rule; the caller's number
is the SIP participant's ``sip.phoneNumber``)::

    CALLER_MEMORY_URL=http://127.0.0.1:8080 CALLER_MEMORY_TOKEN=cm_... CALLER_MEMORY_PROJECT=cheese-shop \\
    LIVEKIT_URL=... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=... \\
    .venv/bin/python examples/livekit_agent.py start

Without ``--demo``, the command line is LiveKit's (``start``, ``dev``, ``console``...; ``--help`` shows it).
The worker's models are LiveKit Inference descriptors (``"openai/gpt-4.1-mini"``...), which need a LiveKit
Cloud project; put plugin objects there for your own providers.

Offline, with nothing but this repository: ``--demo`` plays two calls from one number through a real
``AgentSession`` in text mode, against a scripted model on loopback (``caller_memory.sdk.testing``), and a
Caller Memory service: one started for the demo on a temporary SQLite file (the service must be installed
beside the SDK), or yours, but only with ``--url`` and ``--token`` (and ``--project``) on the command line,
whose project must store ``caller_name`` and have conversation memory on. The demo ignores the
``CALLER_MEMORY_*`` variables, so that it stays offline (``--demo --help`` lists its options). It needs
``livekit-plugins-openai`` (the offline model speaks OpenAI's API), which the SDK's ``livekit`` extra
brings::

    .venv/bin/python examples/livekit_agent.py --demo

The second call is greeted "Welcome back, Ada!": the memory the first call's tool wrote. No phone number
is printed (LiveKit's own log lines are masked too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

#: What to install when LiveKit Agents or its OpenAI plugin is missing.
INSTALL = (
    "Install the SDK with its LiveKit extra, which brings LiveKit Agents and its OpenAI plugin: "
    'pip install "caller-memory-sdk[livekit]" '
    '(from a clone of the repository: pip install "./sdk[livekit]").'
)

try:
    from caller_memory.sdk import MemoryClient
    from caller_memory.sdk.livekit import CallMemory, MemoryAgent, remember_caller
    from livekit.agents import AgentServer, AgentSession, JobContext, RunContext, cli, function_tool
except ImportError as missing:  # a bare ModuleNotFoundError would not say what to install
    sys.exit(
        f"This agent needs LiveKit Agents and the SDK's LiveKit drop-in, and {missing.name or missing} is missing. {INSTALL}"
    )

INSTRUCTIONS = (
    "You are the cheese shop's receptionist. Greet returning callers by name. When a caller tells you "
    "their name, call save_name."
)
#: The project this agent expects (apply it with `caller-memory project apply`).
PROJECT_CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name"], "default_region": "US", "analytics_enabled": True},
        "conversation": {"enabled": True},
    }
}


class Receptionist(MemoryAgent):
    """Every inference carries the caller's memory (MemoryAgent); one tool writes what to remember."""

    def __init__(self) -> None:
        super().__init__(instructions=INSTRUCTIONS)

    @function_tool
    async def save_name(self, context: RunContext[Any], name: str) -> str:
        """Remember the caller's first name for their next calls.

        Args:
            name: the caller's first name
        """
        CallMemory.of(context).state["caller_name"] = name
        return json.dumps({"name": name})


# The worker ------------------------------------------------------------------------------------------

server = AgentServer()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    client = MemoryClient(
        os.environ["CALLER_MEMORY_URL"],
        token=os.environ["CALLER_MEMORY_TOKEN"],
        project=os.environ.get("CALLER_MEMORY_PROJECT", "cheese-shop"),
    )
    await client.open()  # closed in finish(), below
    await ctx.connect()
    participant = await ctx.wait_for_participant()  # the SIP caller
    session: AgentSession[Any] = AgentSession(
        stt="deepgram/nova-3", llm="openai/gpt-4.1-mini", tts="cartesia/sonic-2"
    )
    call = remember_caller(session, client, participant=participant, job=ctx)

    async def finish() -> None:  # the end first (the shutdown callbacks run together), then the client
        await call.finish()
        await client.aclose()

    ctx.add_shutdown_callback(finish)
    await session.start(Receptionist(), room=ctx.room)
    await session.generate_reply()  # the greeting: personal, from the memory read at the call's start


# The offline demo ------------------------------------------------------------------------------------
# Its helpers (and livekit-plugins-openai, for the scripted model) are imported inside the demo only, so
# that a copy of this file used as a template runs as a worker without examples/demo_support.py.


async def one_call(client: MemoryClient, model_url: str, caller: str, call_id: str, lines: list[str]) -> None:
    """One call through a real AgentSession in text mode (no room): a greeting, then the caller's lines."""
    from livekit.plugins import openai  # main() checked that it is installed

    model = openai.LLM(model="demo", base_url=model_url, api_key="demo")
    session: AgentSession[Any] = AgentSession(llm=model, vad=None, turn_handling={"turn_detection": None})
    call = remember_caller(session, client, caller=caller, conversation_id=call_id)
    try:
        await session.start(Receptionist())
        await session.generate_reply()
        print("agent:", session.history.items[-1].text_content)  # type: ignore[union-attr]
        for line in lines:
            print("caller:", line)
            await session.run(user_input=line)
            print("agent:", session.history.items[-1].text_content)  # type: ignore[union-attr]
        await session.aclose()  # the bot hangs up
        result = await call.wait_ended()
        if result is not None:
            print(f"[call ended: persisted {list(result.persisted)}{' (queued)' if result.queued else ''}]")
    finally:
        await model.aclose()


async def demo(url: str | None, token: str | None, project: str) -> None:
    """Two calls from one number, against the service at ``url`` or, without one, a service started for the
    demo."""
    from caller_memory.sdk.testing import ScriptedModel, service
    from demo_support import shop_model

    caller = "+14155550100"  # a 555-01xx number: never printed
    run = secrets.token_hex(3)
    greeting = "Hello, you've reached the cheese shop! What's your name?"
    with tempfile.TemporaryDirectory() as workdir:
        async with contextlib.AsyncExitStack() as stack:
            if url is None or token is None:
                cm = await stack.enter_async_context(service())
                url, token = cm.url, (await cm.create_project(project, PROJECT_CONFIG)).agent
                print(
                    f"[Caller Memory: a service started for the demo, on a temporary SQLite file, project {project}]"
                )
            else:
                print(f"[Caller Memory: {url}, project {project}]")
            model = await stack.enter_async_context(ScriptedModel(shop_model(greeting)))
            client = await stack.enter_async_context(
                MemoryClient(url, token=token, project=project, outbox_path=Path(workdir) / "outbox.db")
            )
            print("--- call 1")
            await one_call(client, model.base_url, caller, f"demo-{run}-1", ["my name is Ada"])
            print("--- call 2")
            await one_call(client, model.base_url, caller, f"demo-{run}-2", ["just checking in"])


def main() -> None:
    argv = sys.argv[1:]
    if "--demo" not in argv:
        if "--help" in argv or "-h" in argv:  # LiveKit's help does not know the demo: say it here
            print(
                "This script also runs offline, without LiveKit: --demo (see --demo --help). "
                "LiveKit's command line follows.\n",
                file=sys.stderr,
            )
        cli.run_app(server)  # LiveKit's command line: start, dev, console...
        return
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] + " The offline demo: two calls from one number.",
        epilog="The demo reads no environment variable: without --url and --token it starts its own "
        "service, so that it stays offline. Without --demo, the command line is LiveKit's worker "
        "(start, dev, console; it reads CALLER_MEMORY_URL, CALLER_MEMORY_TOKEN, CALLER_MEMORY_PROJECT).",
    )
    parser.add_argument("--demo", action="store_true", help="play two calls from one number, offline")
    parser.add_argument(
        "--url", help="a Caller Memory service to use instead of one started for the demo (with --token)"
    )
    parser.add_argument("--token", help="an agent token of --project on the --url service")
    parser.add_argument(
        "--project",
        default="cheese-shop",
        help="the project (on --url: it must store caller_name and have conversation memory on; default: %(default)s)",
    )
    args = parser.parse_args()
    if (args.url is None) != (args.token is None):
        parser.error("--url and --token go together (without both, the demo starts its own service)")
    try:
        from livekit.plugins import openai  # noqa: F401  (the demo's model speaks OpenAI's API)
    except ImportError:
        sys.exit(
            f"--demo needs LiveKit's OpenAI plugin (livekit-plugins-openai), which is not installed. {INSTALL}"
        )
    from caller_memory.sdk.testing import ServiceNotInstalledError

    try:
        asyncio.run(demo(args.url, args.token, args.project))
    except ServiceNotInstalledError as exc:
        sys.exit(f"--demo without --url and --token starts a Caller Memory service: {exc}")


if __name__ == "__main__":
    main()
