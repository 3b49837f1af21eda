"""Conversation memory through the SDK against the real service (real HTTP server; SQLite and Redis stores):
``conv.add_message()`` sent in the background, in order, idempotently; the outbox when the service is down;
refusals dropped and reported; the start and ``conv.resume``; history, context and summaries (issue 14)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from caller_memory.sdk import (
    GoneError,
    History,
    InvalidRequestError,
    MemoryClient,
    NotFoundError,
    RetryPolicy,
)

from tests.conftest import OPERATOR_TOKEN, Api
from tests.sdk.conftest import Forwarder
from tests.support.proxy import LossyProxy

CALLER = "+14155550100"
PROJECT = "cheese-shop"
MESSAGES = "/conversations/{conversation_id}/messages"
END = "/conversations/{conversation_id}/end"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=0.5)
#: Short durations, so that the inactivity end can be reached by moving the service's clock.
CONVERSATION = {
    "enabled": True,
    "idle_after": "PT10S",
    "end_after_inactivity": "PT60S",
    "resume_window": "PT5M",
}


async def configure(api: Api, conversation: dict[str, Any] | None = None) -> dict[str, str]:
    reply = await api.call(
        "PUT",
        f"/v1/projects/{PROJECT}",
        token=OPERATOR_TOKEN,
        json={
            "memory": {
                "repeat_caller": {
                    "state_keys": ["booking_day", "caller_name"],
                    "default_region": "US",
                    "identifier_blacklist": ["+440000000000"],
                },
                "conversation": CONVERSATION if conversation is None else conversation,
            }
        },
    )
    assert reply.status in (200, 201), reply.body
    return {role: await api.mint(PROJECT, role) for role in ("agent", "admin")}


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await configure(api)


def client_for(url: str, token: str, tmp_path: Path, **options: Any) -> MemoryClient:
    """A client whose reads have time (a shared machine under load): the budgets are tested elsewhere."""
    options.setdefault("read_budget", 2.0)
    return MemoryClient(url, token=token, project=PROJECT, outbox_path=tmp_path / "outbox.db", **options)


async def history_of(api: Api, admin: str, conversation_id: str) -> dict[str, Any]:
    reply = await api.call(
        "GET", f"/v1/projects/{PROJECT}/conversations/{conversation_id}/history", token=admin
    )
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def status_of(api: Api, admin: str, conversation_id: str) -> dict[str, Any]:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/conversations/{conversation_id}", token=admin)
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    """Wait until ``check()`` holds: for background work that signals nothing the test can wait on."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


def without_times(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k not in ("timestamp", "message_id")} for m in messages]


# The platform example of SPEC section 14 ----------------------------------------------------------------

PLATFORM_EXAMPLE: list[dict[str, Any]] = [
    {
        "role": "assistant",
        "content": "How can I help you today?",
        "turn_id": 1,
        "metadata": {"source": "greeting"},
    },
    {"role": "user", "content": "Can you tell me a joke?", "turn_id": 2, "metadata": {"source": "asr"}},
    {
        "role": "assistant",
        "content": "Why did the scarecrow ",
        "turn_id": 2,
        "metadata": {
            "source": "llm",
            "interrupted": True,
            "original": "Why did the scarecrow win an award? Because he was outstanding in his field!",
        },
    },
    {
        "role": "user",
        "content": "You know what? Tell me a story instead.",
        "turn_id": 3,
        "metadata": {"source": "asr"},
    },
    {
        "role": "assistant",
        "content": "Once upon a time in a land far away, ...",
        "turn_id": 3,
        "metadata": {"source": "llm"},
    },
    {"role": "assistant", "content": "Are you still there?", "turn_id": 4, "metadata": {"source": "command"}},
]


async def test_the_platform_example_round_trips_in_order(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, channel="phone", transcript=True)
        ids = [conv.add_message("assistant", "How can I help you today?", turn_id=1, source="greeting")]
        await conv.begin_turn()
        assert conv.turn_id == 2 and conv.start_error is None and conv.resume is None
        ids.append(conv.add_message("user", "Can you tell me a joke?", source="asr"))
        ids.append(
            conv.add_message(
                "assistant",
                "Why did the scarecrow ",
                source="llm",
                interrupted=True,
                original=PLATFORM_EXAMPLE[2]["metadata"]["original"],
            )
        )
        await conv.begin_turn()
        ids.append(conv.add_message("user", "You know what? Tell me a story instead.", source="asr"))
        ids.append(conv.add_message("assistant", "Once upon a time in a land far away, ...", source="llm"))
        await conv.begin_turn()
        ids.append(conv.add_message("assistant", "Are you still there?", source="command"))
        history = await conv.history()
        assert isinstance(history, History) and history.unsent == 0 and history.times == "epoch_ms"
        assert without_times([m.to_dict() for m in history.messages]) == PLATFORM_EXAMPLE
        assert [m.message_id for m in history.messages] == ids and len(set(ids)) == len(ids)  # the SDK's ids
        stamps = [m.timestamp for m in history.messages]
        assert stamps == sorted(stamps) and abs(stamps[0] - time.time() * 1000) < 60_000
        assert await conv.history(format="openai") == [
            {"role": m["role"], "content": m["content"]} for m in PLATFORM_EXAMPLE
        ]
        assert conv.transcript_errors == () and conv.transcript_off is None
        result = await conv.end(end_reason="completed")
        assert not result.queued and not result.late
    after = await history_of(api, shop["admin"], "conv-1")
    assert after["status"] == "ended" and after["times"] == "offset_ms"
    assert without_times(after["contents"]) == PLATFORM_EXAMPLE
    status = await status_of(api, shop["admin"], "conv-1")
    assert (
        status["ended_by"] == "explicit"
        and status["end_reason"] == "completed"
        and status["channel"] == "phone"
    )


async def test_messages_go_in_few_batches_with_the_caller_on_the_first_only(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        for i in range(250):  # added in one go: at most 100 a batch
            conv.add_message("user" if i % 2 else "assistant", f"message {i}")
        history = await conv.history(limit=1000)
        assert [m.content for m in history.messages] == [f"message {i}" for i in range(250)]
        assert api.count("POST", MESSAGES, 200) == 3
        await conv.end()


async def test_a_lost_answer_is_retried_without_adding_anything_twice(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    proxy = LossyProxy(int(api.base_url.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        url = f"http://127.0.0.1:{proxy.port}"
        async with client_for(url, shop["agent"], tmp_path, retry=FAST) as client:
            conv = client.conversation("conv-1", caller=CALLER, transcript=True)
            await conv.begin_turn()
            proxy.drop_answers = 1  # the service applies the next batch; its answer is lost
            for text in ("one", "two", "three"):
                conv.add_message("user", text)
            history = await conv.history()
            assert [m.content for m in history.messages] == ["one", "two", "three"] and history.unsent == 0
            assert api.count("POST", MESSAGES, 200) == 2  # the first attempt and its retry
            assert (await status_of(api, shop["admin"], "conv-1"))["messages"] == 3
            assert conv.transcript_errors == ()
            await conv.end()
    finally:
        await proxy.close()


async def test_the_outbox_keeps_messages_while_the_service_is_down_and_delivers_them_before_the_end(
    api: Api, shop: dict[str, str], forwarder: tuple[Forwarder, str], tmp_path: Path
) -> None:
    proxy, url = forwarder
    proxy.switch("down")
    async with client_for(url, shop["agent"], tmp_path, retry=FAST, deliver_outbox_on_start=False) as client:
        conv = client.conversation("conv-1", caller=CALLER, channel="phone", transcript=True)
        memory = await conv.begin_turn()
        assert not memory.available and conv.resume is None and "503" in (conv.start_error or "")
        for i in range(5):
            conv.add_message("user", f"said {i}")
        conv.state["booking_day"] = "Friday"
        result = await conv.end(qa="resolved", end_reason="completed")
        assert result.queued
        assert sorted(e.kind for e in await client.outbox.pending()) == ["end", "messages"]
        [batch] = await client.outbox.claim(10, lease=1)  # the end waits behind the messages
        assert batch.kind == "messages"
        assert [m["content"] for m in orjson.loads(batch.body)["messages"]] == [f"said {i}" for i in range(5)]
        await client.outbox.release(batch.id)
        assert api.count("POST", MESSAGES) == 0 and api.count("POST", END) == 0
    proxy.switch("open")
    async with client_for(
        url, shop["agent"], tmp_path, deliver_outbox_on_start=False
    ) as client:  # a new process
        report = await client.flush_outbox()
        assert (report.delivered, report.remaining, report.rejected, report.dropped) == (2, 0, 0, 0)
    routes = [route for method, route, status in api.requests if method == "POST" and status == 200]
    assert routes.index(next(r for r in routes if r.endswith(END))) > routes.index(
        next(r for r in routes if r.endswith(MESSAGES))
    )
    history = await history_of(api, shop["admin"], "conv-1")
    assert [m["content"] for m in history["contents"]] == [f"said {i}" for i in range(5)]
    assert history["status"] == "ended"
    memory_reply = await api.call(
        "GET", f"/v1/projects/{PROJECT}/callers/{CALLER}/memory", token=shop["admin"]
    )
    assert memory_reply.body["fields"] == {"booking_day": "Friday"}


async def test_batches_kept_in_the_outbox_are_sent_once_the_service_is_back_and_later_ones_wait_behind(
    api: Api, shop: dict[str, str], forwarder: tuple[Forwarder, str], tmp_path: Path
) -> None:
    proxy, url = forwarder
    async with client_for(url, shop["agent"], tmp_path, retry=FAST) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        proxy.switch("down")
        conv.add_message("user", "first")

        async def kept() -> bool:
            return bool(await client.outbox.pending())

        await eventually(kept)  # the retries are exhausted: the batch is in the outbox
        await conv.begin_turn()
        conv.add_message("user", "second")  # goes behind the kept batch, not around it
        proxy.switch("open")
        history = await conv.history(budget=10)
        assert [m.content for m in history.messages] == ["first", "second"]

        async def drained() -> bool:
            return conv.unsent == 0 and not await client.outbox.pending()

        await eventually(drained)
        await conv.end()
    assert (await status_of(api, shop["admin"], "conv-1"))["messages"] == 2


async def test_a_message_id_reused_with_another_message_is_dropped_and_reported_not_retried(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        conv.add_message("user", "hello", message_id="platform-1")
        await conv.history()
        conv.add_message("user", "hello again", message_id="platform-1")  # the caller's own mistake
        history = await conv.history()
        assert [m.content for m in history.messages] == ["hello"]
        [error] = conv.transcript_errors
        assert error.status == 409 and error.message_ids == ("platform-1",) and not error.state
        assert api.count("POST", MESSAGES, 409) == 1  # never retried
        conv.add_message("user", "and on")  # the conversation goes on
        assert [m.content for m in (await conv.history()).messages] == ["hello", "and on"]
        assert conv.transcript_off is None
        await conv.end()


async def test_a_refused_checkpoint_is_dropped_and_its_messages_still_sent(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        conv.state["caller_name"] = "x" * 3000  # over the 2048-byte limit of a field value
        conv.add_message("user", "my name is long")
        assert [m.content for m in (await conv.history()).messages] == ["my name is long"]
        [error] = conv.transcript_errors
        assert error.state and error.status == 422 and error.message_ids == ()
        conv.add_message("user", "still here")  # the same state is not sent again
        await conv.history()
        assert api.count("POST", MESSAGES, 422) == 1 and api.count("POST", MESSAGES, 200) == 2
        conv.state["caller_name"] = "Ada"
        await conv.begin_turn()  # a changed state is sent at the next turn, on its own
        assert "caller_name" not in conv.memory  # a checkpoint is not the caller's memory: the end writes it
        status = await status_of(api, shop["admin"], "conv-1")
        assert status["messages"] == 2
        assert (await conv.end()).persisted == ("caller_name",)


async def test_messages_for_a_conversation_that_ended_are_dropped_and_stop(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        conv.add_message("user", "hello")
        await conv.history()
        ended = await api.call(  # another process ended the call
            "POST",
            f"/v1/projects/{PROJECT}/conversations/conv-1/end",
            token=shop["agent"],
            json={"caller": CALLER},
        )
        assert ended.status == 200, ended.body
        conv.add_message("user", "anyone?")
        await conv.history()
        assert conv.transcript_off is not None and "409" in conv.transcript_off
        [error] = conv.transcript_errors
        assert error.status == 409
        before = api.count("POST", MESSAGES)
        conv.add_message("user", "dropped without a request")
        await conv.history()
        assert api.count("POST", MESSAGES) == before and conv.unsent == 0


async def test_resume_after_a_call_that_dropped_and_its_checkpoint_in_memory(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        first = client.conversation("call-1", caller=CALLER, channel="phone", transcript=True)
        await first.begin_turn()
        first.add_message("user", "I'd like to book for Friday", source="asr")
        first.state["booking_day"] = "Friday"
        first.add_message("assistant", "Friday it is. And your name?")
        await first.history()  # sent, with the checkpoint; then the line drops and nobody ends the call
        second = client.conversation("call-2", caller=CALLER, channel="phone", transcript=True)
        memory = await second.begin_turn()
        resume = second.resume
        assert resume is not None and resume.conversation_id == "call-1" and second.start_error is None
        assert resume.ended_by == "superseded" and resume.channel == "phone"
        assert dict(resume.state or {}) == {"booking_day": "Friday"}
        assert resume.to_openai() == [
            {"role": "user", "content": "I'd like to book for Friday"},
            {"role": "assistant", "content": "Friday it is. And your name?"},
        ]
        assert resume.last_turns[0].timestamp < 60_000  # times from that conversation's start
        with pytest.raises(TypeError):
            resume.state["booking_day"] = "Monday"  # type: ignore[index]
        # The start ended call-1 with its checkpoint before the memory was read.
        assert memory.available and memory["booking_day"] == "Friday"
        late = await first.end(qa="dropped")  # the first call's own end arrives late
        assert late.late and not late.queued
        other = client.conversation("call-3", caller=CALLER, channel="chat", transcript=True)
        await other.begin_turn()
        assert other.resume is None  # another channel
        await second.end()
        await other.end()


async def test_resume_after_an_inactivity_end(api: Api, shop: dict[str, str], tmp_path: Path) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        first = client.conversation("call-1", caller=CALLER, transcript=True)
        await first.begin_turn()
        first.add_message("user", "hello?")
        await first.history()
        api.clock.advance(61)  # past end_after_inactivity
        swept = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
        assert swept.status == 200, swept.body
        assert (await status_of(api, shop["admin"], "call-1"))["ended_by"] == "inactivity"
        second = client.conversation("call-2", caller=CALLER, transcript=True)
        await second.begin_turn()
        assert second.resume is not None and second.resume.ended_by == "inactivity"
        assert [m.content for m in second.resume.last_turns] == ["hello?"]
        first.add_message("user", "too late")  # the agent of call-1 comes back: dropped, reported
        await first.history()
        assert first.transcript_off is not None and first.transcript_errors[0].status == 409
        assert (await first.end()).late
        await second.end()


async def test_a_call_ended_as_dropped_is_offered_as_resume(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        first = client.conversation("call-1", caller=CALLER, transcript=True)
        await first.begin_turn()
        first.add_message("user", "my line is bad")
        await first.set_summary("The caller's line is bad.", through_turn=1, tokens=6)
        await first.end(end_reason="dropped")
        second = client.conversation("call-2", caller=CALLER, transcript=True)
        await second.begin_turn()
        resume = second.resume
        assert resume is not None and resume.end_reason == "dropped" and resume.ended_by == "explicit"
        assert (resume.summary, resume.summary_through_turn) == ("The caller's line is bad.", 1)
        await second.end()


async def test_history_pages_cached_pages_context_and_summaries(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        for turn in range(1, 5):
            await conv.begin_turn()
            conv.add_message("user", f"question {turn} " + "word " * 20, tokens=25)
            conv.add_message("assistant", f"answer {turn} " + "word " * 20, tokens=25)
        conv.add_message("tool", '{"weather": "sunny"}', source="tool")
        page = await conv.history(limit=3)
        assert [m.turn_id for m in page.messages] == [1, 1] and page.next_after_turn == 1
        rest = await conv.history(after_turn=page.next_after_turn)
        assert [m.turn_id for m in rest.messages] == [2, 2, 3, 3, 4, 4, 4] and rest.next_after_turn is None
        assert rest.messages[-1].role == "tool" and rest.to_openai()[-1]["role"] == "assistant"
        again = await conv.history(after_turn=1)
        assert again == rest and api.count("GET", "/history", 304) == 1  # an unchanged page costs a 304

        context = await conv.context(max_tokens=150)
        assert context.max_tokens == 150 and context.tokens <= 150 and context.needs_summary
        assert context.unsummarized_tokens == 200 and context.summary is None
        assert context.recent_turns.dropped_turns > 0 and context.recent_turns.to_turn == 4
        assert context.recent_turns.token_source == "client"
        assert context.to_openai()[-1] == {"role": "assistant", "content": "answer 4 " + "word " * 20}
        assert all(m["role"] != "tool" for m in context.to_openai())

        info = await conv.set_summary("Four questions about words, each answered.", through_turn=3, tokens=9)
        assert info.summary_through_turn == 3 and info.summary_tokens == 9 and info.messages == 9
        context = await conv.context(max_tokens=150)
        assert (
            context.summary is not None and context.summary.through_turn == 3 and context.summary.tokens == 9
        )
        assert context.recent_turns.from_turn == 4 and not context.needs_summary
        with pytest.raises(InvalidRequestError):
            await conv.set_summary("too far", through_turn=99)
        with pytest.raises(NotFoundError):
            await client.conversation("never-started", caller=CALLER, transcript=True).history()
        await conv.end()


async def test_reads_of_an_expired_transcript_say_gone(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        conv.add_message("user", "hello")
        await conv.end()
        api.clock.advance(86_400 + 3600)  # past transcript_retention (P1D)
        with pytest.raises(GoneError):
            await conv.history()
        with pytest.raises(NotFoundError):  # GoneError is a NotFoundError
            await conv.context()


@pytest.mark.parametrize(
    ("conversation", "caller", "reason"),
    [({"enabled": False}, CALLER, "disabled"), (None, "+440000000000", "blacklisted")],
)
async def test_no_transcript_for_a_project_without_it_or_a_blacklisted_caller(
    api: Api, tmp_path: Path, conversation: dict[str, Any] | None, caller: str, reason: str
) -> None:
    tokens = await configure(api, conversation)
    async with client_for(api.base_url, tokens["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=caller, transcript=True)
        await conv.begin_turn()
        assert conv.transcript_off is not None and reason in conv.transcript_off and conv.start_error is None
        conv.add_message("user", "hello")  # dropped: nothing is sent
        assert conv.unsent == 0 and api.count("POST", MESSAGES) == 0
        await conv.end()


async def test_a_conversation_continued_by_a_new_process_goes_on_from_the_services_turn(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        for _ in range(3):
            await conv.begin_turn()
            conv.add_message("user", f"turn {conv.turn_id}")
        await conv.history()
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:  # the agent restarted
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        assert conv.turn_id == 4
        conv.add_message("user", "turn 4")
        history = await conv.history()
        assert [m.content for m in history.messages] == [f"turn {i}" for i in range(1, 5)]
        assert conv.transcript_errors == ()
        await conv.end()


async def test_closing_the_client_keeps_unsent_messages_for_the_next_run(
    api: Api, shop: dict[str, str], forwarder: tuple[Forwarder, str], tmp_path: Path
) -> None:
    proxy, url = forwarder
    async with client_for(url, shop["agent"], tmp_path, retry=RetryPolicy(attempt_timeout=5)) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        proxy.switch("hang")
        conv.add_message("user", "said just before the agent stopped")
        started = time.perf_counter()
    assert time.perf_counter() - started < 2.0  # the close's grace (1 s), not the attempt's 5 s
    proxy.switch("open")
    async with client_for(url, shop["agent"], tmp_path) as client:  # delivers the outbox on start

        async def delivered() -> bool:
            return not await client.outbox.pending()

        await eventually(delivered)
    history = await history_of(api, shop["admin"], "conv-1")
    assert [m["content"] for m in history["contents"]] == ["said just before the agent stopped"]


async def test_an_end_cancelled_while_its_messages_are_sent_loses_nothing_and_keeps_the_order(
    api: Api, shop: dict[str, str], forwarder: tuple[Forwarder, str], tmp_path: Path
) -> None:
    proxy, url = forwarder
    async with client_for(url, shop["agent"], tmp_path, retry=FAST, deliver_outbox_on_start=False) as client:
        conv = client.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        proxy.switch("hang")
        conv.add_message("user", "the last thing said")
        conv.state["booking_day"] = "Monday"
        ending = asyncio.create_task(conv.end(qa="resolved"))

        async def sending() -> bool:
            return proxy.seen[-1][1].endswith("/messages")

        await eventually(sending)
        ending.cancel()  # the framework tore the call down while the messages went first
        with pytest.raises(asyncio.CancelledError):
            await ending
    assert sorted(e.kind for e in await client.outbox.pending()) == ["end", "messages"]  # the close waited
    proxy.switch("open")
    async with client_for(url, shop["agent"], tmp_path, deliver_outbox_on_start=False) as client:
        assert (await client.flush_outbox()).delivered == 2
    history = await history_of(api, shop["admin"], "conv-1")
    assert [m["content"] for m in history["contents"]] == ["the last thing said"] and history[
        "status"
    ] == "ended"
