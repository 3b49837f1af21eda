"""caller_memory.sdk.livekit against the real LiveKit Agents (an AgentSession in text mode, no room), the real
service (in process, on a real port) and a fake OpenAI-compatible model on loopback (issue 16).

Runs in its own pytest process (the Makefile runs this file separately)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from caller_memory.sdk.livekit import (
    MEMORY_MESSAGE_ID,
    remember_caller,
)
from caller_memory.sdk.render import PREAMBLE

from tests.conftest import Api

# The fixtures (fake_llm, sessions, tokens, store_url, lines) come with the star import.
from tests.frameworks.conftest_livekit import *  # noqa: F403
from tests.frameworks.conftest_livekit import (
    INSTRUCTIONS,
    NUMBER,
    PROJECT,
    Sessions,
    Shopkeeper,
    make_client,
    sip_participant,
)
from tests.support.fake_llm import FakeLLM, text_of

ROOT = Path(__file__).resolve().parents[2]


def memory_messages(body: dict[str, Any]) -> int:
    """How many memory messages one request to the model carried."""
    return sum(PREAMBLE in text_of(m) for m in body["messages"])


def last_text(session: Any) -> str:
    assistant = [i for i in session.history.items if i.type == "message" and i.role == "assistant"]
    text: str = assistant[-1].text_content
    return text


async def history(api: Api, admin: str, conversation_id: str) -> dict[str, Any]:
    reply = await api.call(
        "GET", f"/v1/projects/{PROJECT}/conversations/{conversation_id}/history", token=admin
    )
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def status(api: Api, admin: str, conversation_id: str) -> dict[str, Any]:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/conversations/{conversation_id}", token=admin)
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_two_calls_from_one_number_the_second_greeted_welcome_back(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        # Call 1: a new caller gives their name; the tool writes conv.state.
        session = sessions.new()
        call = remember_caller(session, client, participant=sip_participant(NUMBER, "SCL_call1"))
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        run = await session.run(user_input="hi")
        run.expect.next_event().is_message(role="assistant")
        assert last_text(session) == "Hello! What's your name?"
        run = await session.run(user_input="my name is Ada")
        run.expect.next_event().is_function_call(name="save_name", arguments={"name": "Ada"})
        run.expect.next_event().is_function_call_output()
        run.expect.next_event().is_message(role="assistant")
        assert last_text(session) == "Nice to meet you, Ada."
        call.set_outcome(qa="resolved")
        hung_up = time.perf_counter()
        await session.aclose()
        closed = time.perf_counter()
        first = await call.wait_ended()
        finished = time.perf_counter()
        print(
            f"\nhang-up to closed {1000 * (closed - hung_up):.1f} ms, "
            f"to end persisted {1000 * (finished - hung_up):.1f} ms"
        )
        assert first is not None and not first.queued
        assert first.persisted == ("caller_name",) and first.ignored == () and first.repeat_caller == {}
        assert finished - hung_up < 5.0  # generous: a loaded 2-core machine
        assert all(memory_messages(body) == 0 for body in fake_llm.requests)  # nothing known yet

        # Call 2: the same number; the greeting is personal, from the memory read at the call's start.
        fake_llm.requests.clear()
        session = sessions.new()
        call = remember_caller(session, client, participant=sip_participant(NUMBER, "SCL_call2"))
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        await session.generate_reply()
        assert last_text(session) == "Welcome back, Ada!"
        await session.run(user_input="just browsing")
        call.state["favourite_cheese"] = "gouda"  # not a state key of the project: ignored
        await session.aclose()
        second = await call.wait_ended()
        assert second is not None and second.persisted == () and second.ignored == ("favourite_cheese",)
        assert second.repeat_caller["REPEAT_CALLER_CONV_ID"] == "SCL_call1"
        assert second.repeat_caller["REPEAT_CALLER_QA"] == "resolved"

    # One memory message in every request of call 2, right after the instructions, never in the history.
    assert [memory_messages(body) for body in fake_llm.requests] == [1, 1]
    roles = [m["role"] for m in fake_llm.requests[-1]["messages"]]
    assert roles[:2] == ["system", "system"] and PREAMBLE in text_of(fake_llm.requests[-1]["messages"][1])
    assert all(item.id != MEMORY_MESSAGE_ID for item in session.history.items)
    assert not any(form in json.dumps(fake_llm.requests) for form in ("4155550100",))

    # The analytics API counts call 2 as a repeat call of call 1.
    reply = await api.call(
        "GET", f"/v1/projects/{PROJECT}/analytics/conversations?repeat=true", token=tokens["admin"]
    )
    assert reply.status == 200, reply.body
    [repeat] = reply.body["conversations"]
    assert repeat["conversation_id"] == "SCL_call2"

    # The transcripts, read back from the service: user and assistant turns, the greeting marked as such.
    one = await history(api, tokens["admin"], "SCL_call1")
    said = [(m["role"], m["content"], m["turn_id"]) for m in one["contents"]]
    assert said == [
        ("user", "hi", 1),
        ("assistant", "Hello! What's your name?", 1),
        ("user", "my name is Ada", 2),
        ("assistant", "Nice to meet you, Ada.", 2),
    ]
    two = await history(api, tokens["admin"], "SCL_call2")
    assert two["contents"][0]["content"] == "Welcome back, Ada!"
    assert two["contents"][0]["metadata"]["source"] == "greeting"
    assert [m["metadata"]["source"] for m in two["contents"][1:]] == ["message", "llm"]
