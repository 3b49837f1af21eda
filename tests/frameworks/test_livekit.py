"""caller_memory.sdk.livekit against the real LiveKit Agents (an AgentSession in text mode, no room), the real
service (in process, on a real port) and a fake OpenAI-compatible model on loopback (issue 16).

Runs in its own pytest process (the Makefile runs this file separately)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from caller_memory.sdk.conversation import DEFAULT_CHANNEL
from caller_memory.sdk.livekit import (
    MEMORY_MESSAGE_ID,
    SIP_ATTESTATION_ATTRIBUTES,
    CallMemory,
    attestation_from_participant,
    caller_from_participant,
    mask_livekit_logs,
    remember_caller,
)
from caller_memory.sdk.render import PREAMBLE, RESUME_NOTE, STALE_NOTE
from livekit import rtc
from livekit.agents import CloseReason, RunResult, UserStateChangedEvent
from livekit.agents.testing import fake_job_context
from livekit.rtc._proto import handle_pb2, participant_pb2

from tests.conftest import OPERATOR_TOKEN, Api

# The fixtures (fake_llm, sessions, tokens, store_url, lines) come with the star import.
from tests.frameworks.conftest_livekit import *  # noqa: F403
from tests.frameworks.conftest_livekit import (
    INSTRUCTIONS,
    NUMBER,
    PROJECT,
    PROJECT_CONFIG,
    Lines,
    Sessions,
    Shopkeeper,
    make_client,
    sip_participant,
)
from tests.support.fake_llm import FakeLLM, text_of
from tests.support.proxy import LossyProxy
from tests.support.spans import SpanInspector

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
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path, lines: Lines
) -> None:
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        # Call 1: a new caller gives their name; the tool writes conv.state.
        session = sessions.new()
        call = remember_caller(session, client, participant=sip_participant(NUMBER, "SCL_call1"))
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        run: RunResult[None] = await session.run(user_input="hi")
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
    # Neither the memory message nor the memory's values reached a log line (the number: the lines fixture).
    assert not [line for line in lines.lines if PREAMBLE[:30] in line or 'caller_memory\\":' in line]

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


async def remember_ada(api: Api, admin: str) -> None:
    """The caller's memory as an earlier call left it."""
    reply = await api.call(
        "PATCH", f"/v1/projects/{PROJECT}/callers/{NUMBER}/memory", token=admin, json={"caller_name": "Ada"}
    )
    assert reply.status == 200, reply.body


async def test_a_tool_follow_up_reuses_its_turns_memory(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    await remember_ada(api, tokens["admin"])
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_tool")
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        reads = api.count("GET", "/memory")
        await session.run(user_input="my name is Bob")
        assert last_text(session) == "Nice to meet you, Bob."
        # The turn and its tool follow-up: one read (taken by the turn), one memory message in each request.
        assert [memory_messages(body) for body in fake_llm.requests] == [1, 1]
        assert fake_llm.requests[1]["messages"][-1]["role"] == "tool"
        assert api.count("GET", "/memory") - reads <= 1
        await session.aclose()
        result = await call.wait_ended()
        assert result is not None and result.persisted == ("caller_name",)


async def test_the_turns_read_nests_in_livekits_llm_node_span(
    api: Api,
    tokens: dict[str, str],
    sessions: Sessions,
    fake_llm: FakeLLM,
    tmp_path: Path,
    no_identifier_in_any_span: SpanInspector,
) -> None:
    """LiveKit's own tracing (on the test session's provider): the read a turn begins in its llm_node is a
    child of LiveKit's llm_node span, in its agent_turn, with the service's request and the store call under
    it (docs/observability.md). (The read prefetched as the session starts, which the first turn takes, comes
    before any of LiveKit's spans.)"""
    await remember_ada(api, tokens["admin"])
    with no_identifier_in_any_span.recording() as spans:
        async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
            session = sessions.new()
            call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_traced")
            await session.start(Shopkeeper(instructions=INSTRUCTIONS))
            await session.run(user_input="hi")  # takes the read prefetched as the session started
            await session.run(user_input="my name is Bob")  # reads in its llm_node
            await session.aclose()
            await call.wait_ended()
    by_id = {s.context.span_id: s for s in spans}
    reads = [
        s
        for s in spans
        if s.name.endswith("/memory")
        and s.instrumentation_scope is not None
        and s.instrumentation_scope.name == "caller_memory.sdk"
    ]
    nested = [r for r in reads if r.parent is not None and by_id.get(r.parent.span_id, r).name == "llm_node"]
    assert nested, [(r.name, r.parent and by_id.get(r.parent.span_id)) for r in reads]
    node = by_id[nested[0].parent.span_id]  # type: ignore[union-attr]
    assert node.parent is not None and by_id[node.parent.span_id].name == "agent_turn"
    [server] = [s for s in spans if s.parent is not None and s.parent.span_id == nested[0].context.span_id]
    [store] = [s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id]
    assert store.name == "store read_fields"
    assert len({s.context.trace_id for s in (node, nested[0], server, store)}) == 1


async def timed_turn(session: Any, text: str) -> float:
    started = time.perf_counter()
    await session.run(user_input=text)
    return time.perf_counter() - started


async def test_a_service_slowed_to_1_s_costs_a_turn_at_most_the_budget_and_the_last_memory_is_served_stale(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    await remember_ada(api, tokens["admin"])
    proxy = LossyProxy(int(api.base_url.rsplit(":", 1)[1]))
    await proxy.start()
    budget = 0.3
    try:
        async with make_client(f"http://127.0.0.1:{proxy.port}", tokens["agent"], tmp_path, budget) as client:
            session = sessions.new()
            call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_slow")
            await session.start(Shopkeeper(instructions=INSTRUCTIONS))
            await session.generate_reply()
            assert last_text(session) == "Welcome back, Ada!"
            fast = await timed_turn(session, "hello")
            proxy.delay = 1.0  # every answer of the service from now on: a read cannot make the budget
            slow = await timed_turn(session, "anything new?")
            print(
                f"\nturn with the service answering at once {1000 * fast:.0f} ms, 1 s late {1000 * slow:.0f} ms"
            )
            assert slow < budget + 0.5  # the budget, and a margin for a loaded machine: never the 1 s
            # The read failed: the last memory, marked stale, is what the model got.
            memory_message = [m for m in fake_llm.requests[-1]["messages"] if PREAMBLE in text_of(m)]
            assert len(memory_message) == 1 and STALE_NOTE in text_of(memory_message[0])
            assert call.memory is not None and call.memory.stale and call.memory["caller_name"] == "Ada"
            proxy.delay = 0.0
            await session.aclose()
            assert (await call.wait_ended()) is not None
    finally:
        await proxy.close()


async def test_memory_message_waits_for_the_read_where_call_memory_is_still_none(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    """The realtime-model recipe of docs/livekit.md: the memory for an agent's instructions, before any
    turn (call.memory is None then), waited for within the budget; the greeting then reuses that turn."""
    await remember_ada(api, tokens["admin"])
    proxy = LossyProxy(int(api.base_url.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        async with make_client(f"http://127.0.0.1:{proxy.port}", tokens["agent"], tmp_path, 3.0) as client:
            session = sessions.new()
            proxy.delay = 0.3  # the read is not done when the agent asks for it
            call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_realtime")
            agent = Shopkeeper(instructions=INSTRUCTIONS)
            await session.start(agent)
            assert call.memory is None
            text = await call.memory_message(agent.chat_ctx)
            assert text is not None and PREAMBLE in text and "Ada" in text
            await agent.update_instructions(INSTRUCTIONS + "\n\n" + text)
            proxy.delay = 0.0
            reads = api.count("GET", "/memory")
            await session.generate_reply()
            assert last_text(session) == "Welcome back, Ada!"
            assert api.count("GET", "/memory") == reads  # the greeting's turn is the one already read
            await session.aclose()
            assert (await call.wait_ended()) is not None
    finally:
        await proxy.close()


async def test_prefetch_when_the_caller_starts_speaking_hides_the_read(
    api: Api, tokens: dict[str, str], sessions: Sessions, tmp_path: Path
) -> None:
    await remember_ada(api, tokens["admin"])
    proxy = LossyProxy(int(api.base_url.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        async with make_client(f"http://127.0.0.1:{proxy.port}", tokens["agent"], tmp_path, 3.0) as client:
            session = sessions.new()
            remember_caller(session, client, caller=NUMBER, conversation_id="SCL_prefetch")
            await session.start(Shopkeeper(instructions=INSTRUCTIONS))
            await session.generate_reply()
            proxy.delay = 0.4  # a slow read: 0.4 s
            without = await timed_turn(session, "hello")
            # What LiveKit's VAD does when the caller starts speaking (a test emits the public event).
            session.emit(
                "user_state_changed", UserStateChangedEvent(old_state="listening", new_state="speaking")
            )
            await asyncio.sleep(1.0)  # the caller speaks for a second
            with_prefetch = await timed_turn(session, "and now?")
            print(
                f"\nturn with a 0.4 s read: {1000 * without:.0f} ms, prefetched {1000 * with_prefetch:.0f} ms"
            )
            assert without >= 0.4 and with_prefetch < without - 0.2
            proxy.delay = 0.0
            await session.aclose()
    finally:
        await proxy.close()


async def test_an_interrupted_answer_goes_to_the_transcript_as_spoken_marked_interrupted(
    api: Api, tokens: dict[str, str], sessions: Sessions, tmp_path: Path
) -> None:
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        call = remember_caller(session, client, caller=NUMBER, conversation_id="SCL_story")
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        run: RunResult[None] = session.run(user_input="tell me a story")
        await asyncio.sleep(0.5)  # 40 words 50 ms apart: the caller interrupts about a quarter in
        await session.interrupt()
        await run
        await session.aclose()
        await call.wait_ended()
    [_, told] = (await history(api, tokens["admin"], "SCL_story"))["contents"]
    story = "".join(f"word{i} " for i in range(40))
    assert told["metadata"]["interrupted"] is True and told["content"] and story.startswith(told["content"])
    assert len(told["content"]) < len(story)
    # Without audio, what was spoken is all the model had generated when it was cut: no other original.
    assert story.startswith(told["metadata"].get("original", told["content"]))


def fake_job() -> Any:
    """LiveKit's offline JobContext (an unconnected room); its shutdown runs nothing, so the tests run its
    shutdown callbacks as the job process does (all at once)."""
    return fake_job_context()


async def run_shutdown(job: Any) -> None:
    await asyncio.gather(*(callback("test shutdown") for callback in job._shutdown_callbacks))


@pytest.mark.parametrize(
    ("way", "end_reason"),
    [
        ("the bot hangs up", "completed"),
        ("the bot transfers the call", "transferred"),
        ("the caller hangs up", "completed"),
        ("the line drops", "dropped"),
        ("an error closes the session", "dropped"),
        ("the worker shuts the job down", "completed"),
        ("the job shuts down first (the session closes with it)", "dropped"),
    ],
)
async def test_the_end_is_persisted_however_the_call_ends(
    way: str, end_reason: str, api: Api, tokens: dict[str, str], sessions: Sessions, tmp_path: Path
) -> None:
    conversation_id = "SCL_" + "".join(c if c.isalnum() else "_" for c in way)
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        caller = sip_participant(NUMBER, conversation_id)
        with fake_job() as job:
            call = remember_caller(session, client, participant=caller, job=job)
            await session.start(Shopkeeper(instructions=INSTRUCTIONS))
            await session.run(user_input="my name is Ada")
            closed = asyncio.Event()
            session.on("close", lambda _: closed.set())
            started = time.perf_counter()
            if way == "the bot hangs up":
                await session.aclose()
            elif way == "the bot transfers the call":
                call.transfer("billing", "wants a refund")
                await session.aclose()
            elif way == "the caller hangs up":
                session._close_soon(reason=CloseReason.PARTICIPANT_DISCONNECTED)  # what RoomIO does
                await closed.wait()
            elif way == "an error closes the session":
                session._close_soon(reason=CloseReason.ERROR)  # what an unrecoverable model error does
                await closed.wait()
            elif way == "the line drops":  # LiveKit leaves the session open: the integration ends the call
                caller._info.disconnect_reason = participant_pb2.DisconnectReason.SIP_TRUNK_FAILURE
                job.room.emit("participant_disconnected", caller)
            elif way == "the worker shuts the job down":
                await session.aclose()  # the job process closes the session first, then runs the callbacks
                await run_shutdown(job)
            else:
                await run_shutdown(job)
            result = await call.wait_ended()
            print(f"\n{way}: end persisted {1000 * (time.perf_counter() - started):.0f} ms after")
            await session.aclose()
        job._tempdir.cleanup()  # a JobContext's temporary folder: only its _on_cleanup() removes it
    assert result is not None and result.persisted == ("caller_name",) and not result.queued
    ended = await status(api, tokens["admin"], conversation_id)
    assert ended["status"] == "ended" and ended["end_reason"] == end_reason
    if end_reason == "transferred":
        reply = await api.call(
            "GET", f"/v1/projects/{PROJECT}/analytics/conversations", token=tokens["admin"]
        )
        [listed] = [c for c in reply.body["conversations"] if c["conversation_id"] == conversation_id]
        assert (listed["handoff_to"], listed["handoff_reason"]) == ("billing", "wants a refund"), listed


def test_the_sip_attributes_give_the_number_and_the_call_id() -> None:
    assert caller_from_participant(sip_participant(NUMBER, "SCL_abc")) == (NUMBER, "SCL_abc")
    assert caller_from_participant(sip_participant(None, "SCL_abc")) == (None, "SCL_abc")  # number hidden
    browser = sip_participant(
        NUMBER, "SCL_abc", kind=participant_pb2.ParticipantKind.PARTICIPANT_KIND_STANDARD
    )
    assert caller_from_participant(browser) == (None, None)


async def test_no_number_means_no_memory_said_once_and_a_number_set_late_starts_it(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path, lines: Lines
) -> None:
    await remember_ada(api, tokens["admin"])
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        call = remember_caller(session, client, participant=sip_participant(None, "SCL_hidden"))
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        await session.run(user_input="hi")
        await session.run(user_input="hello?")
        assert all(memory_messages(body) == 0 for body in fake_llm.requests)
        assert sum("no caller number" in line for line in lines.lines) == 1
        call.set_caller(NUMBER, "SCL_late")  # e.g. from the app's own lookup, once known
        await session.run(user_input="and now?")
        assert memory_messages(fake_llm.requests[-1]) == 1
        await session.aclose()
        result = await call.wait_ended()
        assert result is not None and result.conversation_id == "SCL_late"


async def test_the_number_is_masked_in_livekits_logs_also_in_extras_and_child_loggers(lines: Lines) -> None:
    child = logging.getLogger("livekit.agents.voice.some_new_module")  # made after the import
    mask_livekit_logs()
    room, identity = f"call-_{NUMBER}_Xyz", f"sip_{NUMBER}"
    # The line RoomIO logs when the caller hangs up, and the conversation text LiveKit logs at DEBUG.
    logging.getLogger("livekit.agents").info(
        "closing agent session due to participant disconnect", extra={"room": room, "participant": identity}
    )
    logging.getLogger("livekit.agents").debug(
        "conversation_item_added", extra={"lk.pii.text": "call me on (415) 555-0100", "role": "user"}
    )
    child.info("participant %s joined", identity)
    logging.getLogger("livekit").warning("room %s", "%2B14155550100")
    logged = [line for line in lines.lines if json.loads(line)["name"].startswith("livekit")]
    assert len(logged) == 4 and all("[number]" in line for line in logged)
    assert lines.leaks() == []


async def test_the_openai_clients_request_bodies_are_cut_to_method_and_url(
    lines: Lines, tmp_path: Path
) -> None:
    """The OpenAI client 2.x (LiveKit Agents 1.7 requires it) logs each request's options at DEBUG, the
    messages included; once the drop-in is used, only the method and URL are left (what 3.x logs)."""
    openai_log = logging.getLogger("openai._base_client")
    secret = PREAMBLE + '{"caller_name":"Ada"}'
    options = {"method": "post", "url": "/chat/completions", "json_data": {"messages": [{"content": secret}]}}
    async with make_client("http://127.0.0.1:9", "cm_unused", tmp_path) as client:
        CallMemory(client)  # what remember_caller() makes; no caller, so no request
        # As the client logs them: one dict argument (logging keeps the dict itself as the record's args).
        openai_log.debug("Request options: %s", options)
        openai_log.debug("Sending HTTP Request: %s", "POST")
    logged = [json.loads(line)["message"] for line in lines.lines if '"openai._base_client"' in line]
    assert logged == [
        "Request options: {'method': 'post', 'url': '/chat/completions'}",
        "Sending HTTP Request: POST",
    ]
    assert options["json_data"]  # the client's own dict is left as it was


async def test_importing_the_drop_in_masks_no_logger_and_every_call_masks_them_all(tmp_path: Path) -> None:
    """The filter goes on LiveKit's loggers where the drop-in is used (every CallMemory, so remember_caller(),
    or mask_livekit_logs() in the agent's module), not at import; once on each, however often it is put."""
    script = f"""
import logging
from caller_memory.sdk import MemoryClient
import caller_memory.sdk.livekit as dropin
def masked():
    loggers = logging.root.manager.loggerDict.items()
    return {{n: len(g.filters) for n, g in loggers if n.startswith("livekit") and getattr(g, "filters", None)}}
assert masked() == {{}}, masked()
client = MemoryClient("http://127.0.0.1:9", token="t", project="p", outbox_path={str(tmp_path / "o.db")!r})
dropin.CallMemory(client)
dropin.mask_livekit_logs()
assert masked()["livekit"] == masked()["livekit.agents"] == 1 and set(masked().values()) == {{1}}
print("ok")
"""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    out, err = await asyncio.wait_for(process.communicate(), 50)
    assert process.returncode == 0, err.decode()
    assert out.decode() == "ok\n"


async def test_the_example_agent_plays_two_calls_against_a_real_service(
    api: Api, tokens: dict[str, str]
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "livekit_agent.py"),
        "--demo",
        "--url",
        api.base_url,
        "--token",
        tokens["agent"],
        "--project",
        PROJECT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    out, err = await asyncio.wait_for(process.communicate(), 50)
    stdout, stderr = out.decode(), err.decode()
    assert process.returncode == 0, stderr
    first, second = stdout.split("--- call 2")
    assert "What's your name?" in first and "Nice to meet you, Ada." in first
    assert "persisted ['caller_name']" in first
    assert "agent: Welcome back, Ada!" in second
    assert "4155550100" not in stdout + stderr and "555-0100" not in stdout + stderr


async def test_the_example_demo_ignores_the_environment_and_stays_offline() -> None:
    # An unreachable service in the environment: the worker's variables, which --demo must not read.
    env = {
        **os.environ,
        "CALLER_MEMORY_URL": "http://127.0.0.1:9",
        "CALLER_MEMORY_TOKEN": "cm_unreachable",
        "PYTHONWARNINGS": "error",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "livekit_agent.py"),
        "--demo",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), 50)
    stdout = out.decode()
    assert process.returncode == 0, err.decode()
    assert stdout.startswith("[Caller Memory: a service started for the demo")  # not the environment's
    assert "agent: Welcome back, Ada!" in stdout and "(queued)" not in stdout


async def test_the_example_copied_as_a_template_runs_without_demo_support_and_names_the_demo(
    tmp_path: Path,
) -> None:
    template = tmp_path / "agent.py"
    template.write_text((ROOT / "examples" / "livekit_agent.py").read_text())
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(template),
        "--help",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    out, err = await asyncio.wait_for(process.communicate(), 50)
    assert process.returncode == 0, err.decode()
    assert "--demo" in err.decode() and "start" in out.decode()


async def test_a_callback_after_a_dropped_call_is_offered_resume(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        caller = sip_participant(NUMBER, "SCL_dropped")
        with fake_job() as job:
            call = remember_caller(session, client, participant=caller, job=job)
            await session.start(Shopkeeper(instructions=INSTRUCTIONS))
            await session.run(user_input="my name is Ada")
            caller._info.disconnect_reason = participant_pb2.DisconnectReason.CONNECTION_TIMEOUT
            job.room.emit("participant_disconnected", caller)
            assert (await call.wait_ended()) is not None
            await session.aclose()
        job._tempdir.cleanup()
        fake_llm.requests.clear()
        session = sessions.new()
        call = remember_caller(session, client, participant=sip_participant(NUMBER, "SCL_callback"))
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        await session.generate_reply()
        [memory] = [m for m in fake_llm.requests[0]["messages"] if PREAMBLE in text_of(m)]
        assert RESUME_NOTE in text_of(memory) and "Nice to meet you, Ada." in text_of(memory)
        assert call.conversation is not None and call.conversation.resume is not None
        await session.aclose()
        await call.wait_ended()


async def test_a_livekit_call_that_dropped_is_resumed_by_the_bare_sdk_both_on_the_default_channel(
    api: Api, tokens: dict[str, str], sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    """Neither names a channel: the drop-in and ``client.conversation()`` share the SDK's default, so a
    callback handled by code of another kind (a bare-SDK agent, a hand-off) resumes the LiveKit call."""
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        caller = sip_participant(NUMBER, "SCL_livekit")
        with fake_job() as job:
            call = remember_caller(session, client, participant=caller, job=job)
            await session.start(Shopkeeper(instructions=INSTRUCTIONS))
            await session.run(user_input="my name is Ada")
            caller._info.disconnect_reason = participant_pb2.DisconnectReason.CONNECTION_TIMEOUT
            job.room.emit("participant_disconnected", caller)
            assert (await call.wait_ended()) is not None
            await session.aclose()
        job._tempdir.cleanup()
        assert call.conversation is not None and call.conversation.channel == DEFAULT_CHANNEL

        callback = client.conversation("sdk-callback", caller=NUMBER, transcript=True)
        await callback.begin_turn()
        resume = callback.resume
        assert resume is not None and resume.conversation_id == "SCL_livekit"
        assert resume.channel == DEFAULT_CHANNEL and resume.end_reason == "dropped"
        assert {"role": "user", "content": "my name is Ada"} in resume.to_openai()
        await callback.end(end_reason="completed")


# Caller-ID trust --------------------------------------------------------------------------------------------

#: A P-Asserted-Identity as Telnyx sends it, with the verification result as its URI's verstat parameter.
TELNYX_PAI = f'"Ada" <sip:{NUMBER};verstat=TN-Validation-Passed@sip.telnyx.com;user=phone>'


def sip_caller(
    attributes: dict[str, str],
    kind: participant_pb2.ParticipantKind.ValueType = participant_pb2.ParticipantKind.PARTICIPANT_KIND_SIP,
) -> rtc.RemoteParticipant:
    """A real SIP participant (no server: handle 0) with the attributes LiveKit would map from the INVITE."""
    info = participant_pb2.ParticipantInfo(
        sid="PA_trust",
        identity="sip_caller",
        kind=kind,
        attributes={"sip.phoneNumber": NUMBER, "sip.callID": "SCL_trust", **attributes},
    )
    owned = participant_pb2.OwnedParticipant(handle=handle_pb2.FfiOwnedHandle(id=0), info=info)
    return rtc.RemoteParticipant(owned)


def test_the_attestation_comes_from_the_sip_headers_livekit_maps_to_attributes() -> None:
    assert SIP_ATTESTATION_ATTRIBUTES == ("sip.h.x-twilio-verstat", "sip.h.p-asserted-identity")
    # Twilio Elastic SIP Trunking: its X-Twilio-VerStat header (include_headers: SIP_X_HEADERS).
    twilio = sip_caller({"sip.h.x-twilio-verstat": "TN-Validation-Passed-A"})
    assert attestation_from_participant(twilio) == "TN-Validation-Passed-A"
    # Telnyx: the verstat parameter of P-Asserted-Identity (include_headers: SIP_ALL_HEADERS).
    assert attestation_from_participant(sip_caller({"sip.h.p-asserted-identity": TELNYX_PAI})) == (
        "TN-Validation-Passed"
    )
    tel = f"<tel:{NUMBER};verstat=TN-Validation-Failed>"
    assert (
        attestation_from_participant(sip_caller({"sip.h.p-asserted-identity": tel})) == "TN-Validation-Failed"
    )
    # X-Twilio-VerStat first; a P-Asserted-Identity without verstat is no attestation.
    both = sip_caller({"sip.h.x-twilio-verstat": "No-TN-Validation", "sip.h.p-asserted-identity": TELNYX_PAI})
    assert attestation_from_participant(both) == "No-TN-Validation"
    plain = sip_caller({"sip.h.p-asserted-identity": f"<sip:{NUMBER}@carrier.example>"})
    assert attestation_from_participant(plain) is None
    assert attestation_from_participant(sip_caller({})) is None  # outside North America; no headers mapped
    # The caller writes their own From header: not read unless named.
    from_header = sip_caller({"sip.h.from": f"<sip:{NUMBER};verstat=TN-Validation-Passed@x.example>"})
    assert attestation_from_participant(from_header) is None
    assert attestation_from_participant(from_header, "sip.h.from") == "TN-Validation-Passed"
    # A trunk's headers_to_attributes: {"X-Twilio-VerStat": "verstat"}; only the named attribute is read.
    mapped = sip_caller(
        {"verstat": "TN-Validation-Passed-B", "sip.h.x-twilio-verstat": "TN-Validation-Passed-A"}
    )
    assert attestation_from_participant(mapped, "verstat") == "TN-Validation-Passed-B"
    assert attestation_from_participant(mapped, "missing") is None
    # There but not a verification result: it grants nothing (the service is not sent what it refuses).
    odd = sip_caller({"sip.h.x-twilio-verstat": "TN-Validation-Passed-A-Passthrough"})
    assert attestation_from_participant(odd) == "failed"
    pai = sip_caller({"sip.h.p-asserted-identity": f"<sip:{NUMBER};verstat=Maybe@x.example>"})
    assert attestation_from_participant(pai) == "failed"
    # Anyone else in the room sets their own attributes: they attest nothing.
    browser = sip_caller(
        {"sip.h.x-twilio-verstat": "TN-Validation-Passed-A"},
        kind=participant_pb2.ParticipantKind.PARTICIPANT_KIND_STANDARD,
    )
    assert attestation_from_participant(browser) is None


async def trusted_project(api: Api) -> dict[str, str]:
    """``verified`` is sensitive (an A-attested call, or a step-up check); the caller has it."""
    config = json.loads(json.dumps(PROJECT_CONFIG))
    config["memory"]["repeat_caller"].update(
        state_keys=["caller_name", "verified"],
        field_classes={"verified": "sensitive"},
        trust={"sensitive": "A"},
    )
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=config)
    assert reply.status in (200, 201), reply.body
    tokens = {role: await api.mint(PROJECT, role) for role in ("agent", "admin")}
    reply = await api.call(
        "PATCH",
        f"/v1/projects/{PROJECT}/callers/{NUMBER}/memory",
        token=tokens["admin"],
        json={"caller_name": "Ada", "verified": "yes"},
    )
    assert reply.status == 200, reply.body
    return tokens


def memory_text(body: dict[str, Any]) -> str:
    [text] = [text_of(m) for m in body["messages"] if PREAMBLE in text_of(m)]
    return text


async def test_a_call_gets_what_its_sip_attestation_qualifies_for_and_more_after_a_step_up(
    api: Api, sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    tokens = await trusted_project(api)
    pai = f"<sip:{NUMBER};verstat=TN-Validation-Passed-C@sip.telnyx.com;user=phone>"  # a C call
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        call = remember_caller(session, client, participant=sip_caller({"sip.h.p-asserted-identity": pai}))
        assert call.conversation is not None and call.conversation.attestation == "TN-Validation-Passed-C"
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        await session.generate_reply()
        assert last_text(session) == "Welcome back, Ada!"
        greeting = memory_text(fake_llm.requests[-1])
        assert '"caller_name":"Ada"' in greeting and "verified" not in greeting
        before = call.memory
        assert before is not None and before.withheld == ("verified",)
        assert before.attestation == "C"
        call.step_up_passed()  # the app's own tool checked the caller's PIN
        await session.run(user_input="my PIN is 1234")
        assert '"verified":"yes"' in memory_text(fake_llm.requests[-1])
        assert call.memory is not None and call.memory.withheld == ()
        call.state["verified"] = "pin"
        await session.aclose()
        result = await call.wait_ended()
        assert result is not None and result.persisted == ("verified",) and result.withheld == ()
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/callers/{NUMBER}/memory", token=tokens["admin"])
    assert reply.body["fields"] == {"caller_name": "Ada", "verified": "pin"}


async def test_an_attestation_given_wins_and_a_step_up_before_the_caller_is_kept(
    api: Api, sessions: Sessions, fake_llm: FakeLLM, tmp_path: Path
) -> None:
    tokens = await trusted_project(api)
    async with make_client(api.base_url, tokens["agent"], tmp_path) as client:
        session = sessions.new()
        twilio_a = sip_caller({"sip.h.x-twilio-verstat": "TN-Validation-Passed-A"})
        call = remember_caller(session, client, participant=twilio_a, attestation="TN-Validation-Failed-A")
        assert call.conversation is not None and call.conversation.attestation == "TN-Validation-Failed-A"
        await session.start(Shopkeeper(instructions=INSTRUCTIONS))
        await session.generate_reply()
        assert "verified" not in memory_text(fake_llm.requests[-1])
        call.state["verified"] = "no"
        await session.aclose()
        result = await call.wait_ended()
        assert result is not None and result.withheld == ("verified",) and result.persisted == ()

        later = remember_caller(sessions.new(), client, attestation="C")  # the number is known later
        later.step_up_passed()
        later.set_caller(NUMBER, "SCL_later")
        assert later.conversation is not None and later.conversation.step_up
        assert later.conversation.attestation == "C"
        memory = await later.conversation.begin_turn()
        assert memory.withheld == () and memory.fields()["verified"] == "yes"
        await later.end()
        with pytest.raises(ValueError, match="attestation"):
            remember_caller(sessions.new(), client, caller=NUMBER, attestation="x" * 65)
