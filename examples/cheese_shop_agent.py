"""A returning-caller cheese-shop agent, written against the Caller Memory SDK.

Each turn of a call starts with ``await conv.begin_turn()``; the agent reads ``conv.memory`` (what is known
about the caller from earlier calls) and puts what it wants remembered in ``conv.state``, which is written
when the call ends. What is said goes to the call's transcript with ``conv.add_message()`` (never waiting),
and ``conv.state`` rides along as a checkpoint: when a call drops and nobody ends it, the service ends it
after a while of silence and keeps the checkpoint; when the caller calls back, ``conv.resume`` offers to
pick up where they left off.

Run it against a service you started with ``make run`` (after minting an agent token, see the README)::

    .venv/bin/python examples/cheese_shop_agent.py --url http://127.0.0.1:8080 --token cm_... --caller +14155550100

or, with nothing running, let it start a service on a temporary SQLite file (``caller_memory.sdk.testing``;
the service must be installed beside the SDK) and play four calls from the same number (a first call, a returning caller, a call that drops mid-booking, and the callback
that resumes it)::

    .venv/bin/python examples/cheese_shop_agent.py --demo
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import sys
import tempfile
from pathlib import Path

from caller_memory.sdk import Conversation, EndResult, MemoryClient, ServiceError

#: The project configuration this agent expects (apply it with `caller-memory project apply`).
PROJECT_CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "booking_day", "cheese_type", "visit_count"],
            "retention": "P30D",
            "default_region": "GB",
        },
        "conversation": {"enabled": True},
    }
}
#: The demo's conversation memory: a dropped call is ended after 2 seconds of silence (30 minutes by default).
DEMO_CONVERSATION = {"enabled": True, "end_after_inactivity": 2, "idle_after": 1}


def greet(conv: Conversation) -> str:
    """Turn 1: greet a returning caller by name, offer to finish a booking their dropped call left
    unfinished, or to rebook what they booked last time."""
    memory = conv.memory
    visits = memory.get("visit_count", 0)
    conv.state["visit_count"] = visits + 1
    resume = conv.resume
    # A dropped call that never got as far as a checkpoint has no state (None).
    if resume is not None and resume.state and "booking_day" in resume.state and "caller_name" in memory:
        # The dropped call's checkpoint: what it was about to book.
        conv.state["pending_cheese"] = resume.state.get("cheese_type", "cheese")
        conv.state["pending_day"] = resume.state["booking_day"]
        return (
            f"Welcome back, {memory['caller_name']}! We were booking {conv.state['pending_cheese']} for "
            f"{conv.state['pending_day']} when the line dropped. Shall I finish that?"
        )
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
    if lowered and lowered[0] == "yes" and "pending_day" in conv.state:
        conv.state["booking_day"] = conv.state["pending_day"]
        conv.state["cheese_type"] = conv.state["pending_cheese"]
    elif lowered and lowered[0] == "yes" and "booking_day" in conv.memory:
        conv.state["booking_day"] = conv.memory["booking_day"]
        conv.state["cheese_type"] = conv.memory.get("cheese_type", "cheddar")
    if "booking_day" in conv.state:
        return f"Booked: {conv.state.get('cheese_type', 'cheese')} on {conv.state['booking_day']}. Goodbye!"
    return "Sorry, which day would suit you?"


def say(conv: Conversation, reply: str) -> str:
    """The agent's line, into the transcript too (never waits for the service)."""
    conv.add_message("assistant", reply, source="greeting" if conv.turn_id <= 1 else "llm")
    return reply


async def handle_call(
    client: MemoryClient,
    conversation_id: str,
    caller: str,
    utterances: list[str],
    *,
    drops: bool = False,
) -> list[str]:
    """One phone call: a greeting turn, then one turn per caller utterance, then the end of the call (or,
    with ``drops``, the line drops before anyone ends it)."""
    conv = client.conversation(conversation_id, caller=caller, channel="phone", transcript=True)
    await conv.begin_turn()
    replies = [say(conv, greet(conv))]
    for index, utterance in enumerate(utterances):
        await conv.begin_turn()
        conv.add_message("user", utterance, source="asr")
        reply = understand(conv, utterance)
        if drops and index == len(utterances) - 1:
            # The line drops while the agent confirms: the transcript keeps what was spoken, and what the
            # agent meant to say (the booking itself is only in conv.state, the checkpoint).
            spoken = reply[: len(reply) // 2]
            conv.add_message("assistant", spoken, source="llm", interrupted=True, original=reply)
            replies.append(spoken + "--")
            continue
        replies.append(say(conv, reply))
    if drops:
        # The messages and the checkpoint (conv.state) reach the service in the background; the history
        # read waits for them, as a second agent taking over the call would read it.
        history = await conv.history()
        replies.append(
            f"[the line drops after {len(history.messages)} messages; nobody ends {conversation_id}]"
        )
        return replies
    result = await conv.end(qa="resolved", end_reason="completed")
    replies.append(f"[call ended: persisted {list(result.persisted)}{' (queued)' if result.queued else ''}]")
    return replies


async def wait_for_inactivity_end(client: MemoryClient, conversation_id: str, caller: str) -> str:
    """Poll the dropped call's transcript until the service has ended it by inactivity."""
    watcher = client.conversation(conversation_id, caller=caller, channel="phone", transcript=True)
    for _ in range(100):
        history = await watcher.history()
        if history.status == "ended":
            return f"[the service ended {conversation_id} after 2 s of silence; its checkpoint is now memory]"
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{conversation_id} was not ended by inactivity")


async def demo() -> None:
    # Imported here: the interactive agent needs only the SDK, not the service that --demo starts.
    from caller_memory.sdk.testing import service

    config = {"memory": {**PROJECT_CONFIG["memory"], "conversation": DEMO_CONVERSATION}}
    with tempfile.TemporaryDirectory() as workdir:
        # The service looks for silent calls four times a second (every 10 s by default).
        async with service(environment={"CALLER_MEMORY_INACTIVITY_INTERVAL": "0.25"}) as cm:
            token = (await cm.create_project("cheese-shop", config)).agent
            async with MemoryClient(
                cm.url, token=token, project="cheese-shop", outbox_path=Path(workdir) / "outbox.db"
            ) as client:
                await play_four_calls(client)


async def play_four_calls(client: MemoryClient) -> None:
    """The demo's calls from one number: a first call, a returning caller, a call that drops mid-booking,
    and the callback that resumes it."""
    caller = "07700 900123"
    calls = [
        ("call-1", ["My name is Ada.", "Gouda on Friday, please."], False),
        ("call-2", ["Yes please!"], False),
        ("call-3", ["Actually, I'd like some brie on Saturday as well."], True),
        ("call-4", ["Yes, please do."], False),
    ]
    for conversation_id, utterances, drops in calls:
        print(f"--- {conversation_id}")
        for line in await handle_call(client, conversation_id, caller, utterances, drops=drops):
            print(line)
        if drops:
            print(await wait_for_inactivity_end(client, conversation_id, caller))


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
    parser.add_argument(
        "--demo", action="store_true", help="start a service for the demo and play four calls (one drops)"
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--token", help="an agent token of the project")
    parser.add_argument("--project", default="cheese-shop")
    parser.add_argument(
        "--caller", default="07700 900123", help="the caller's number (default: a UK test number)"
    )
    args = parser.parse_args()
    if args.demo:
        from caller_memory.sdk.testing import ServiceNotInstalledError

        try:
            asyncio.run(demo())
        except ServiceNotInstalledError as exc:
            sys.exit(f"--demo starts a Caller Memory service: {exc}")
        return
    if not args.token:
        parser.error("--token is required unless --demo is given")

    async def one_call() -> None:
        async with MemoryClient(args.url, token=args.token, project=args.project) as client:
            conversation_id = f"call-{secrets.token_hex(4)}"
            conv = client.conversation(conversation_id, caller=args.caller, channel="phone", transcript=True)
            await conv.begin_turn()
            if not conv.memory.available:
                print(f"[memory unavailable ({conv.memory.reason}); treating the caller as new]")
            print("agent:", say(conv, greet(conv)))
            while (utterance := await read_utterance()) is not None:
                await conv.begin_turn()
                conv.add_message("user", utterance, source="asr")
                print("agent:", say(conv, understand(conv, utterance)))
            try:
                result = await conv.end(qa="resolved", end_reason="completed")
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
