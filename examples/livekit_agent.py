"""A LiveKit Agents receptionist that remembers its callers, with caller_memory.sdk.livekit.

As a LiveKit worker (SIP calls reach it through a LiveKit SIP trunk and dispatch rule; the caller's number
is the SIP participant's ``sip.phoneNumber``)::

    CALLER_MEMORY_URL=http://127.0.0.1:8080 CALLER_MEMORY_TOKEN=cm_... CALLER_MEMORY_PROJECT=cheese-shop \\
    LIVEKIT_URL=... LIVEKIT_API_KEY=... LIVEKIT_API_SECRET=... OPENAI_API_KEY=... \\
    .venv/bin/python examples/livekit_agent.py start

Offline, with nothing but this repository: ``--demo`` plays two calls from one number through a real
``AgentSession`` in text mode, against a small fake model served on loopback by this script, and a Caller
Memory service (an embedded one on a temporary SQLite file, or yours with ``--url``/``--token``/``--project``,
whose project must store ``caller_name`` and have conversation memory on)::

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

from caller_memory.sdk import MemoryClient
from caller_memory.sdk.livekit import CallMemory, MemoryAgent, remember_caller
from demo_support import Reply, embedded_service, fake_model, scripted_reply
from livekit.agents import AgentServer, AgentSession, JobContext, RunContext, cli, function_tool
from livekit.plugins import openai

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
    await client.__aenter__()
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


async def one_call(client: MemoryClient, model_url: str, caller: str, call_id: str, lines: list[str]) -> None:
    """One call through a real AgentSession in text mode (no room): a greeting, then the caller's lines."""
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


def greeted(messages: list[dict[str, Any]]) -> Reply:
    """The demo's model, with this shop's greeting."""
    return scripted_reply(messages, "Hello, you've reached the cheese shop! What's your name?")


async def demo(url: str | None, token: str | None, project: str) -> None:
    caller = "+14155550100"  # a 555-01xx number: never printed
    run = secrets.token_hex(3)
    with tempfile.TemporaryDirectory() as workdir:
        async with contextlib.AsyncExitStack() as stack:
            if url is None or token is None:
                url, token = await stack.enter_async_context(
                    embedded_service(Path(workdir), project, PROJECT_CONFIG)
                )
            model_url = await stack.enter_async_context(fake_model(greeted))
            client = await stack.enter_async_context(
                MemoryClient(url, token=token, project=project, outbox_path=Path(workdir) / "outbox.db")
            )
            print("--- call 1")
            await one_call(client, model_url, caller, f"demo-{run}-1", ["my name is Ada"])
            print("--- call 2")
            await one_call(client, model_url, caller, f"demo-{run}-2", ["just checking in"])


def main() -> None:
    if "--demo" not in sys.argv[1:]:
        cli.run_app(server)  # LiveKit's command line: start, dev, console...
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="two calls from one number, offline")
    parser.add_argument("--url", default=os.environ.get("CALLER_MEMORY_URL"))
    parser.add_argument("--token", default=os.environ.get("CALLER_MEMORY_TOKEN"))
    parser.add_argument("--project", default=os.environ.get("CALLER_MEMORY_PROJECT", "cheese-shop"))
    args = parser.parse_args()
    asyncio.run(demo(args.url, args.token, args.project))


if __name__ == "__main__":
    main()
