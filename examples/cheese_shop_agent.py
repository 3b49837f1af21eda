"""A returning-caller cheese-shop agent, written against the Caller Memory SDK.

Each turn of a call starts with ``await conv.begin_turn()``; the agent reads ``conv.memory`` (what is known
about the caller from earlier calls) and puts what it wants remembered in ``conv.state``, which is written
when the call ends.

Run it against a service you started with ``make run`` (after minting an agent token, see the README)::

    .venv/bin/python examples/cheese_shop_agent.py --url http://127.0.0.1:8080 --token cm_... --caller +14155550100

or, with nothing running, let it start an embedded service on a temporary SQLite file and play two calls
from the same number::

    .venv/bin/python examples/cheese_shop_agent.py --demo
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import secrets
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from caller_memory.sdk import Conversation, EndResult, MemoryClient, ServiceError

#: The project configuration this agent expects (apply it with `caller-memory project apply`).
PROJECT_CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "booking_day", "cheese_type", "visit_count"],
            "retention": "P30D",
            "default_region": "GB",
        }
    }
}


def greet(conv: Conversation) -> str:
    """Turn 1: greet a returning caller by name, and offer to rebook what they booked last time."""
    memory = conv.memory
    visits = memory.get("visit_count", 0)
    conv.state["visit_count"] = visits + 1
    if "caller_name" not in memory:
        return "Hello, you've reached the cheese shop! May I have your name? (say: my name is ...)"
    greeting = f"Welcome back, {memory['caller_name']}!"
    if "booking_day" in memory:
        cheese = memory.get("cheese_type", "your usual")
        greeting += f" Shall I book {cheese} for {memory['booking_day']} again?"
    return greeting


def understand(conv: Conversation, utterance: str) -> str:
    """Later turns: a very small "NLU" that picks out a name, a day and a cheese."""
    words = re.findall(r"[A-Za-z']+", utterance)
    lowered = [w.lower() for w in words]
    if "name" in lowered and "is" in lowered:
        conv.state["caller_name"] = words[lowered.index("is") + 1]
        return f"Nice to meet you, {conv.state['caller_name']}. What would you like?"
    for day in ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday"):
        if day in lowered:
            conv.state["booking_day"] = day.capitalize()
    for cheese in ("gouda", "brie", "stilton", "cheddar"):
        if cheese in lowered:
            conv.state["cheese_type"] = cheese
    if lowered and lowered[0] == "yes" and "booking_day" in conv.memory:
        conv.state["booking_day"] = conv.memory["booking_day"]
        conv.state["cheese_type"] = conv.memory.get("cheese_type", "cheddar")
    if "booking_day" in conv.state:
        return f"Booked: {conv.state.get('cheese_type', 'cheese')} on {conv.state['booking_day']}. Goodbye!"
    return "Sorry, which day would suit you?"


async def handle_call(
    client: MemoryClient, conversation_id: str, caller: str, utterances: list[str]
) -> list[str]:
    """One phone call: a greeting turn, then one turn per caller utterance, then the end of the call."""
    conv = client.conversation(conversation_id, caller=caller)
    await conv.begin_turn()
    replies = [greet(conv)]
    for utterance in utterances:
        await conv.begin_turn()
        replies.append(understand(conv, utterance))
    result = await conv.end(qa="resolved")
    replies.append(f"[call ended: persisted {list(result.persisted)}{' (queued)' if result.queued else ''}]")
    return replies


@contextlib.asynccontextmanager
async def embedded_service(workdir: Path) -> AsyncIterator[tuple[str, str]]:
    """Start Caller Memory in this process on a SQLite file; yield (url, agent token)."""
    import aiohttp
    from aiohttp import web
    from caller_memory.service.app import create_app
    from caller_memory.service.config import Settings
    from caller_memory.service.http.access_log import RouteAccessLogger

    operator = secrets.token_urlsafe(24)
    settings = Settings(
        pseudonym_key=secrets.token_urlsafe(32).encode(),
        store_url=f"sqlite:///{workdir}/demo.db",
        operator_token=operator,
    )
    # The service's access log names routes, never paths (paths hold phone numbers).
    runner = web.AppRunner(create_app(settings), access_log_class=RouteAccessLogger)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    # Set the project up as an operator would, through the HTTP API.
    auth = {"Authorization": f"Bearer {operator}"}
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.put(f"{url}/v1/projects/cheese-shop", json=PROJECT_CONFIG) as resp:
            resp.raise_for_status()
        async with session.post(f"{url}/v1/projects/cheese-shop/tokens", json={"role": "agent"}) as resp:
            resp.raise_for_status()
            token = (await resp.json())["token"]
    try:
        yield url, token
    finally:
        await runner.cleanup()


async def demo() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with embedded_service(Path(workdir)) as (url, token):
            async with MemoryClient(
                url, token=token, project="cheese-shop", outbox_path=Path(workdir) / "outbox.db"
            ) as client:
                calls = [
                    ("call-1", ["My name is Ada.", "Gouda on Friday, please."]),
                    ("call-2", ["Yes please!"]),
                ]
                for conversation_id, utterances in calls:
                    print(f"--- {conversation_id}")
                    for line in await handle_call(client, conversation_id, "07700 900123", utterances):
                        print(line)


async def read_utterance() -> str | None:
    """The caller's next line; None when they hang up (an empty line, or the end of input)."""
    try:
        line = await asyncio.to_thread(input, "caller (empty line or Ctrl-D hangs up): ")
    except EOFError:
        print()
        return None
    return line.strip() or None


def describe(result: EndResult, url: str, client: MemoryClient) -> str:
    """What happened to the end of the call, in words."""
    if result.queued:
        return (
            f"[call ended; the service at {url} could not be reached, so the end of the call is kept in the "
            f"outbox {client.outbox.path} and will be delivered when a client next starts (or calls "
            "flush_outbox()) and the service answers]"
        )
    if result.erased:
        return "[call ended; the caller was erased meanwhile: nothing was stored]"
    return f"[call ended: persisted {list(result.persisted)}, ignored {list(result.ignored)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="start an embedded service and play two calls")
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--token", help="an agent token of the project")
    parser.add_argument("--project", default="cheese-shop")
    parser.add_argument(
        "--caller", default="07700 900123", help="the caller's number (default: a UK test number)"
    )
    args = parser.parse_args()
    if args.demo:
        asyncio.run(demo())
        return
    if not args.token:
        parser.error("--token is required unless --demo is given")

    async def one_call() -> None:
        async with MemoryClient(args.url, token=args.token, project=args.project) as client:
            conversation_id = f"call-{secrets.token_hex(4)}"
            conv = client.conversation(conversation_id, caller=args.caller)
            await conv.begin_turn()
            if not conv.memory.available:
                print(f"[memory unavailable ({conv.memory.reason}); treating the caller as new]")
            print("agent:", greet(conv))
            while (utterance := await read_utterance()) is not None:
                await conv.begin_turn()
                print("agent:", understand(conv, utterance))
            try:
                result = await conv.end(qa="resolved")
            except ServiceError as exc:  # refused for good (a revoked token, say): set aside in the outbox
                sys.exit(
                    f"[call ended; the service refused its end ({exc}); it is set aside in the outbox "
                    f"{client.outbox.path}, see client.outbox.rejected()]"
                )
            print(describe(result, args.url, client))

    try:
        asyncio.run(one_call())
    except ValueError as exc:  # a token, project or number the SDK refuses at once
        parser.error(str(exc))


if __name__ == "__main__":
    main()
