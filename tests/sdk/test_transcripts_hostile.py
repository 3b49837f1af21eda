"""Conversation memory through the SDK against servers that hang or misbehave, on real loopback sockets: the
hot path never waits, an answer of the wrong shape never counts as a success (a batch is kept, a read raises
ServiceUnavailableError), huge bodies and redirects are refused, refusals are sorted into the caller's errors
and outages (issue 14)."""

from __future__ import annotations

import asyncio
import gzip
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import MemoryClient, OutboxUnavailableError, RetryPolicy, ServiceUnavailableError

from tests.sdk.conftest import Serve

CALLER = "+14155550100"
NATIONAL = "4155550100"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=0.5)
BUDGET = 0.15
#: What a call may take beyond its budget on a loaded machine.
MARGIN = 0.1

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


def status_of(conversation_id: str, status: str = "active") -> dict[str, Any]:
    return {
        "conversation_id": conversation_id,
        "status": status,
        "channel": "voice",
        "agent": None,
        "started_at": "2030-01-01T00:00:00Z",
        "last_activity_at": "2030-01-01T00:00:00Z",
        "turn_id": 0,
        "messages": 0,
        "tokens": 0,
        "bytes": 0,
        "summary": None,
        "ended_by": None,
        "end_reason": None,
        "end_processed": False,
        "expires_at": "2030-01-02T00:00:00Z",
    }


def documented(request: web.Request, body: Any = None) -> dict[str, Any]:
    """The documented answer of a fake service to ``request`` (``body``: its decoded JSON body)."""
    path = request.path
    conversation_id = path.split("/conversations/")[-1].split("/")[0] if "/conversations/" in path else ""
    if path.endswith("/memory"):
        return {
            "identifier": CALLER,
            "fields": {"caller_name": "Ada"},
            "expires_at": None,
            "blacklisted": False,
        }
    if path.endswith("/start"):
        return {"conversation": status_of(conversation_id), "stored": True, "resume": None, "superseded": []}
    if path.endswith("/messages"):
        added = len((body or {}).get("messages", []))
        return {
            "conversation_id": conversation_id,
            "stored": True,
            "status": "active",
            "turn_id": 0,
            "added": added,
            "messages": added,
            "bytes": 0,
            "tokens": 0,
        }
    if path.endswith("/end"):
        return valid_end_for(conversation_id)
    if path.endswith("/history"):
        if request.query.get("format") == "openai":
            return {"messages": [{"role": "user", "content": "hi"}]}
        return {
            "conversation_id": conversation_id,
            "status": "active",
            "turn_id": 0,
            "started_at": "2030-01-01T00:00:00Z",
            "times": "epoch_ms",
            "contents": [
                {"role": "user", "content": "hi", "turn_id": 0, "timestamp": 1, "metadata": {"source": "asr"}}
            ],
            "next_after_turn": None,
        }
    if path.endswith("/context"):
        return {
            "conversation_id": conversation_id,
            "status": "active",
            "max_tokens": int(request.query.get("max_tokens", "2000")),
            "tokens": 1,
            "unsummarized_tokens": 1,
            "needs_summary": False,
            "sections": {
                "profile": {
                    "provenance": "caller_memory",
                    "tokens": 0,
                    "token_source": "estimate",
                    "fields": {},
                    "omitted": [],
                },
                "summary": None,
                "recent_turns": {
                    "provenance": "transcript",
                    "tokens": 1,
                    "token_source": "estimate",
                    "from_turn": 0,
                    "to_turn": 0,
                    "dropped_turns": 0,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            },
        }
    return status_of(conversation_id)  # GET .../conversations/{id}, PUT .../summary


def valid_end_for(conversation_id: str) -> dict[str, Any]:
    return {
        "conversation_id": conversation_id,
        "persisted": [],
        "ignored": [],
        "blacklisted": False,
        "erased": False,
        "repeat_caller": {},
        "late": False,
    }


class Fake:
    """A fake service: the documented answers, except where ``routes`` (path suffix -> answer) says
    otherwise. ``seen`` lists (method, path suffix) of every request."""

    def __init__(self, routes: dict[str, Answer] | None = None) -> None:
        self.routes = routes or {}
        self.seen: list[tuple[str, str]] = []
        self.bodies: list[Any] = []

    def count(self, suffix: str) -> int:
        return sum(1 for _, path in self.seen if path.endswith(suffix))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw) if raw else None
        self.seen.append((request.method, request.path))
        self.bodies.append(body)
        for suffix, answer in self.routes.items():
            if request.path.endswith(suffix):
                return await answer(request)
        return web.json_response(documented(request, body))


def client(url: str, tmp_path: Path, **options: Any) -> MemoryClient:
    options.setdefault("retry", FAST)
    options.setdefault("read_budget", BUDGET)
    return MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db", **options)


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


async def kept_messages(c: MemoryClient) -> list[str]:
    """The contents of the message batches kept in the outbox, in order."""
    return [
        m["content"]
        for entry in await c.outbox.pending()
        if entry.kind == "messages"
        for m in orjson.loads(entry.body)["messages"]
    ]


def problem(status: int, detail: str = "refused", **extra: Any) -> Answer:
    async def answer(request: web.Request) -> web.Response:
        document = {"type": "x", "title": "Refused", "status": status, "detail": detail, **extra}
        return web.Response(
            status=status, body=orjson.dumps(document), content_type="application/problem+json"
        )

    return answer


def raw(status: int, body: Any, content_type: str = "application/json", **headers: str) -> Answer:
    async def answer(request: web.Request) -> web.Response:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        return web.Response(status=status, body=data, content_type=content_type, headers=headers)

    return answer


def merged(change: dict[str, Any], status: int = 200) -> Answer:
    async def answer(request: web.Request) -> web.Response:
        body = documented(request, orjson.loads(await request.read() or b"null")) | change
        return web.json_response(body, status=status)

    return answer


async def hang(request: web.Request) -> web.Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


# The hot path -------------------------------------------------------------------------------------------


async def test_add_message_and_begin_turn_never_wait_on_a_hung_service(serve: Serve, tmp_path: Path) -> None:
    url = await serve(hang)
    slow = RetryPolicy(attempts=2, attempt_timeout=5.0)  # every batch stays in flight
    async with client(url, tmp_path, retry=slow) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        started = time.perf_counter()
        memory = await conv.begin_turn()  # the start and the read, within one budget
        assert time.perf_counter() - started < BUDGET + MARGIN
        assert not memory.available and conv.resume is None and "no answer within" in (conv.start_error or "")
        took = []
        for i in range(500):
            started = time.perf_counter()
            conv.add_message("user" if i % 2 else "assistant", f"message {i}", source=None)
            took.append(time.perf_counter() - started)
        assert statistics.median(took) < 0.001 and sum(took) < 0.5, (statistics.median(took), max(took))
        # Many conversations with a batch hung in flight: a read still finds a connection, within its budget.
        others = [c.conversation(f"other-{i}", caller=CALLER, transcript=True) for i in range(30)]
        for other in others:
            other.add_message("user", "hello")
        await asyncio.sleep(0)  # their senders start
        for _ in range(3):
            started = time.perf_counter()
            await conv.begin_turn()
            assert time.perf_counter() - started < BUDGET + MARGIN
        assert conv.unsent == 500
        started = time.perf_counter()
        await c.aclose(grace=0.2)
        assert time.perf_counter() - started < 2.0
        assert len(await kept_messages(c)) == 530  # nothing lost: kept for the next run


async def test_a_down_service_costs_the_turn_nothing(tmp_path: Path) -> None:
    from tests.support.service_process import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        for turn in range(3):
            started = time.perf_counter()
            await conv.begin_turn()
            conv.add_message("user", f"turn {turn}")
            assert time.perf_counter() - started < BUDGET + MARGIN
        assert (await conv.end()).queued
        assert await kept_messages(c) == ["turn 0", "turn 1", "turn 2"]


# Answers of the wrong shape ---------------------------------------------------------------------------

WRONG_APPENDS: list[Answer] = [
    raw(200, {}),
    raw(200, {"ok": True}),
    raw(200, []),
    raw(200, None),
    merged({"stored": "true"}),
    merged({"added": -1}),
    merged({"turn_id": "0"}),
    merged({"status": "finished"}),
    merged({"conversation_id": "another-conversation"}),
    merged({}, status=201),
    raw(200, b"<html>captive portal</html>", "text/html"),
    raw(403, b"<html>proxy</html>", "text/html"),
    raw(422, {"title": "Invalid", "status": 500}),  # a problem document that contradicts its status
    raw(302, b"", Location="http://127.0.0.1:9/elsewhere"),
    raw(200, b'{"conversation_id": "' + b"x" * (2 << 20) + b'"}'),
    raw(200, gzip.compress(b" " * (4 << 20)), **{"Content-Encoding": "gzip"}),
    problem(503),
    problem(429, "slow down"),
]


@pytest.mark.parametrize("answer", WRONG_APPENDS)
async def test_a_batch_answered_with_anything_but_its_documented_answer_is_kept(
    serve: Serve, tmp_path: Path, answer: Answer
) -> None:
    fake = Fake({"/messages": answer})
    url = await serve(fake.handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        conv.add_message("user", "keep me")

        async def kept() -> bool:
            return await kept_messages(c) == ["keep me"]

        await eventually(kept)
        assert fake.count("/messages") >= FAST.attempts and conv.transcript_errors == ()
        assert conv.transcript_off is None and conv.unsent == 1
        assert (await conv.end()).queued  # the end waits behind the kept batch
        assert await c.outbox.rejected() == []


WRONG_STARTS: list[Answer] = [
    raw(200, {}),
    merged({"stored": "yes"}),
    merged({"resume": []}),
    merged({"resume": {"conversation_id": "c"}}),
    merged({"superseded": None}),
    merged({"conversation": None}),  # stored, but no conversation
    merged({"conversation": status_of("another-conversation")}),
    merged({"conversation": status_of("conv-1") | {"turn_id": 2**60}}),  # would make every turn id refused
    raw(307, b"", Location="http://127.0.0.1:9/elsewhere"),
    raw(200, b"x" * (2 << 20)),
    problem(500),
]


@pytest.mark.parametrize("answer", WRONG_STARTS)
async def test_a_start_answered_with_the_wrong_shape_never_breaks_the_turn(
    serve: Serve, tmp_path: Path, answer: Answer
) -> None:
    url = await serve(Fake({"/start": answer}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        started = time.perf_counter()
        memory = await conv.begin_turn()
        assert time.perf_counter() - started < BUDGET + MARGIN
        assert memory.available and memory["caller_name"] == "Ada"  # the read still happened
        assert conv.resume is None and conv.start_error is not None and conv.transcript_off is None
        conv.add_message("user", "hello")
        assert (await conv.history()).unsent == 0  # the batch names the caller: it starts the conversation


async def test_a_documented_resume_is_read_only_and_typed(serve: Serve, tmp_path: Path) -> None:
    resume = {
        "conversation_id": "call-0",
        "channel": "voice",
        "ended_by": "inactivity",
        "end_reason": None,
        "last_activity_at": "2030-01-01T00:00:00Z",
        "summary": {
            "provenance": "agent_summary",
            "tokens": 3,
            "token_source": "client",
            "through_turn": 2,
            "text": "s",
        },
        "last_turns": [
            {"role": "user", "content": "hi", "turn_id": 2, "timestamp": 5, "metadata": {"source": "asr"}},
            {"role": "tool", "content": "{}", "turn_id": 2, "timestamp": 6, "metadata": {"source": "tool"}},
        ],
        "state": {"booking_day": "Friday", "nested": {"a": [1]}},
        "added_later": True,
    }
    url = await serve(Fake({"/start": merged({"resume": resume})}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        await conv.begin_turn()
        offered = conv.resume
        assert (
            offered is not None and offered.conversation_id == "call-0" and offered.ended_by == "inactivity"
        )
        assert (offered.summary, offered.summary_through_turn) == ("s", 2)
        assert offered.to_openai() == [{"role": "user", "content": "hi"}]
        assert offered.state is not None and offered.state["nested"] == {"a": [1]}
        with pytest.raises(TypeError):
            offered.state["booking_day"] = "Monday"  # type: ignore[index]
        with pytest.raises(AttributeError):
            offered.summary = "changed"  # type: ignore[misc]


ReadCall = Callable[[Any], Awaitable[Any]]
READS: dict[str, tuple[str, ReadCall]] = {
    "history": ("/history", lambda conv: conv.history()),
    "openai history": ("/history", lambda conv: conv.history(format="openai")),
    "context": ("/context", lambda conv: conv.context(max_tokens=100)),
    "summary": ("/summary", lambda conv: conv.set_summary("s", through_turn=0)),
}
WRONG_READS: list[tuple[str, Answer]] = [
    (name, answer)
    for name in READS
    for answer in (
        raw(200, {}),
        raw(200, {"messages": "hi", "contents": None}),
        merged({"conversation_id": "another-conversation", "messages": [{"role": "system", "content": "x"}]}),
        merged({"status": 5, "messages": [{"role": "user"}]}),
        raw(304, b""),  # a 304 to a read that sent no ETag
        raw(302, b"", Location="http://127.0.0.1:9/elsewhere"),
        raw(200, b"<html>portal</html>", "text/html"),
        problem(503),
    )
] + [
    ("context", merged({"max_tokens": 99})),  # the answer to another request
    ("context", merged({"tokens": 1000})),  # more than the budget asked for
    (
        "history",
        merged(
            {
                "contents": [
                    {
                        "role": "user",
                        "content": "x",
                        "turn_id": -2,
                        "timestamp": 0,
                        "metadata": {"source": "asr"},
                    }
                ]
            }
        ),
    ),
    ("history", merged({"times": "seconds"})),
    ("summary", merged({"summary": {"through_turn": "3", "tokens": 1}})),
]


@pytest.mark.parametrize(("read", "answer"), WRONG_READS)
async def test_a_read_answered_with_the_wrong_shape_raises_service_unavailable(
    serve: Serve, tmp_path: Path, read: str, answer: Answer
) -> None:
    suffix, call = READS[read]
    url = await serve(Fake({suffix: answer}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        with pytest.raises(ServiceUnavailableError):
            await call(conv)


async def test_the_documented_reads_are_accepted(serve: Serve, tmp_path: Path) -> None:
    """The control of the test above: the same fake with its documented answers is a success."""
    url = await serve(Fake().handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        for call in (call for _, call in READS.values()):
            assert await call(conv) is not None


@pytest.mark.parametrize("kind", ["40 MB", "gzip bomb"])
async def test_huge_read_answers_are_refused_within_the_budget(
    serve: Serve, tmp_path: Path, kind: str
) -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "' + b"x" * (40 << 20) + b'"}]}'
        if kind == "40 MB"
        else gzip.compress(b" " * (64 << 20), compresslevel=9)
    )
    headers = {"Content-Encoding": "gzip"} if kind == "gzip bomb" else {}
    url = await serve(Fake({"/history": raw(200, body, **headers)}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        started = time.perf_counter()
        with pytest.raises(ServiceUnavailableError):
            await conv.history(format="openai", budget=0.5)
        assert time.perf_counter() - started < 0.5 + MARGIN


async def test_a_redirected_batch_is_not_sent_elsewhere(serve: Serve, tmp_path: Path) -> None:
    elsewhere = Fake()
    target = await serve(elsewhere.handle)

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=308, headers={"Location": target + request.path_qs})

    url = await serve(Fake({"/messages": redirect}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        conv.add_message("user", "not for anyone else")

        async def kept() -> bool:
            return await kept_messages(c) == ["not for anyone else"]

        await eventually(kept)
    assert elsewhere.seen == []


# Refusals -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "off"),
    [
        (
            problem(
                422, "messages[0].content: invalid", errors=[{"field": "messages[0].content", "message": "x"}]
            ),
            False,
        ),
        (problem(413, "the transcript would pass its limit"), False),
        (problem(400, "malformed"), False),
        # A full project: kept messages would hold back the ends queued behind them, for as long as it takes
        # transcripts to expire.
        (problem(507, "the project's transcripts are full"), False),
        (problem(410, "expired"), True),
        (problem(404, "deleted"), True),
        (
            problem(422, "not a phone number", errors=[{"field": "caller", "message": "not a phone number"}]),
            True,
        ),
    ],
)
async def test_a_refusal_for_the_callers_input_is_dropped_reported_and_never_retried(
    serve: Serve, tmp_path: Path, answer: Answer, off: bool
) -> None:
    fake = Fake({"/messages": answer})
    url = await serve(fake.handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        message_id = conv.add_message("user", "refused")
        assert (await conv.history()).unsent == 0
        [error] = conv.transcript_errors
        assert error.message_ids == (message_id,) and error.status is not None
        assert fake.count("/messages") == 1  # never retried
        assert (conv.transcript_off is not None) is off
        assert await c.outbox.pending() == [] and await c.outbox.rejected() == []
        assert not c.circuit.is_open


@pytest.mark.parametrize(("status", "off"), [("ended", True), ("ending", True), ("active", False)])
async def test_a_409_ends_the_transcript_only_when_the_conversation_ended(
    serve: Serve, tmp_path: Path, status: str, off: bool
) -> None:
    async def conversation(request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.json_response(documented(request))
        return web.json_response(status_of("conv-1", status))

    fake = Fake({"/messages": problem(409, "conflict"), "/conversations/conv-1": conversation})
    url = await serve(fake.handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        conv.add_message("user", "one")
        await conv.history()
        assert (conv.transcript_off is not None) is off and len(conv.transcript_errors) == 1
        conv.add_message("user", "two")
        await conv.history()
        assert fake.count("/messages") == (1 if off else 2)


@pytest.mark.parametrize("status", [401, 403])
async def test_a_batch_refused_for_the_token_is_set_aside(serve: Serve, tmp_path: Path, status: int) -> None:
    url = await serve(Fake({"/messages": problem(status)}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        conv.add_message("user", "for later")
        await conv.history()
        [aside] = await c.outbox.rejected()
        assert aside.kind == "messages" and orjson.loads(aside.body)["messages"][0]["content"] == "for later"


async def test_refusals_echoing_the_number_are_masked(serve: Serve, tmp_path: Path) -> None:
    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        detail = f"no such caller {orjson.loads(body).get('caller')} ({request.raw_path})"
        return await problem(422, detail, errors=[{"field": "messages", "message": detail}])(request)

    url = await serve(Fake({"/messages": echo}).handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller="+1 (415) 555-0100", transcript=True)
        conv.add_message("user", "x")
        await conv.history()
        [error] = conv.transcript_errors
        assert (
            NATIONAL not in "".join(ch for ch in error.reason if ch.isdigit()) and "[number]" in error.reason
        )


async def test_a_refused_checkpoint_is_sent_without_its_state_by_the_outbox_too(
    serve: Serve, tmp_path: Path
) -> None:
    refuse_state = True

    async def messages(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if "state" in body and refuse_state:
            return await problem(
                422, "state.x: too big", errors=[{"field": "state.x", "message": "too big"}]
            )(request)
        return web.json_response(documented(request, body))

    fake = Fake({"/messages": messages})
    url = await serve(fake.handle)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        conv.state["x"] = "big"
        conv.add_message("user", "with a state")
        await conv.history()
        assert [e.state for e in conv.transcript_errors] == [True]
        assert [("state" in b, len(b["messages"])) for b in fake.bodies if b and "messages" in b] == [
            (True, 1),
            (False, 1),
        ]


@pytest.mark.parametrize("hung", ["/messages", "/context"])
async def test_a_read_keeps_its_budget_when_the_service_hangs(
    serve: Serve, tmp_path: Path, hung: str
) -> None:
    url = await serve(Fake({hung: hang}).handle)
    async with client(url, tmp_path, retry=RetryPolicy(attempts=1, attempt_timeout=5.0)) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        conv.add_message("user", "what did I just say?")
        started = time.perf_counter()
        if hung == "/context":
            with pytest.raises(ServiceUnavailableError):
                await conv.context(budget=0.3)
        else:  # the message is stuck: the read goes on without it, within its budget, and says so
            assert (await conv.context(budget=0.3)).unsent == 1
        assert time.perf_counter() - started < 0.3 + MARGIN
        await c.aclose(grace=0.1)


async def test_messages_that_neither_the_service_nor_the_outbox_takes_are_reported_lost(
    serve: Serve, tmp_path: Path
) -> None:
    url = await serve(Fake({"/messages": problem(503), "/end": problem(503)}).handle)
    async with client(url, tmp_path, outbox_timeout=0.2) as c:
        conv = c.conversation("conv-1", caller=CALLER, transcript=True)
        blocker = sqlite3.connect(tmp_path / "o.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process keeps the outbox locked
        try:
            message_id = conv.add_message("user", "nowhere to go")
            with pytest.raises(OutboxUnavailableError):  # as for an end alone: the write is lost
                await conv.end()
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        [error] = conv.transcript_errors
        assert error.message_ids == (message_id,) and "outbox" in error.reason and conv.unsent == 0
