"""What ``conv.add_message()`` and the conversation-memory calls refuse of their caller's arguments: a clear
ValueError (or RuntimeError for a call that makes no sense) at once, before anything is buffered or sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from caller_memory.sdk import MemoryClient

from tests.sdk.conftest import Serve

CALLER = "+14155550100"


@pytest.fixture
async def client(serve: Serve, tmp_path: Path) -> Any:
    requests: list[str] = []

    async def nothing(request: web.Request) -> web.Response:
        requests.append(request.path)
        return web.Response(status=503)

    url = await serve(nothing)
    async with MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db") as c:
        c.requests = requests  # type: ignore[attr-defined]
        yield c


BAD_MESSAGES: list[tuple[dict[str, Any], str]] = [
    ({"role": "system", "content": "You are a bot"}, "role"),
    ({"role": "user", "content": 5}, "content must be a string"),
    ({"role": "user", "content": "\ud800"}, "surrogate"),
    ({"role": "user", "content": "hi", "source": "llm"}, "does not fit role"),
    ({"role": "assistant", "content": "hi", "source": "asr"}, "does not fit role"),
    ({"role": "tool", "content": "{}", "source": "llm"}, "does not fit role"),
    ({"role": "assistant", "content": "hi", "source": "made-up"}, "does not fit role"),
    ({"role": "user", "content": "hi", "interrupted": True}, "only an assistant"),
    ({"role": "assistant", "content": "hi", "original": "hello"}, "only on interrupted"),
    ({"role": "assistant", "content": "hi", "interrupt_timestamp": 5}, "only on interrupted"),
    ({"role": "assistant", "content": "hi", "interrupted": "yes"}, "True or False"),
    ({"role": "assistant", "content": "hi", "interrupted": True, "original": b"x"}, "original must be"),
    ({"role": "user", "content": "hi", "turn_id": -1}, "turn_id"),
    ({"role": "user", "content": "hi", "turn_id": True}, "turn_id"),
    ({"role": "user", "content": "hi", "turn_id": 2**53}, "turn_id"),
    ({"role": "user", "content": "hi", "tokens": -1}, "tokens"),
    ({"role": "user", "content": "hi", "tokens": 1.5}, "tokens"),
    ({"role": "user", "content": "hi", "timestamp": -5}, "timestamp"),
    ({"role": "user", "content": "hi", "agent": "no spaces"}, "agent"),
    ({"role": "user", "content": "hi", "message_id": "-leading-dash"}, "message_id"),
    ({"role": "user", "content": "hi", "message_id": "x" * 129}, "message_id"),
    ({"role": "user", "content": "x" * (16 * 1024)}, "limit is 16,384"),
]


@pytest.mark.parametrize(("arguments", "says"), BAD_MESSAGES)
async def test_a_message_the_service_would_refuse_is_a_value_error_and_buffers_nothing(
    client: MemoryClient, arguments: dict[str, Any], says: str
) -> None:
    conv = client.conversation("conv-1", caller=CALLER, transcript=True)
    with pytest.raises(ValueError, match=says):
        conv.add_message(**arguments)
    assert conv.unsent == 0 and conv.turn_id == 0


async def test_turn_ids_never_go_back(client: MemoryClient) -> None:
    conv = client.conversation("conv-1", caller=CALLER, transcript=True)
    conv.add_message("user", "hi", turn_id=5)
    assert conv.turn_id == 5  # a larger turn id moves the current turn on
    conv.add_message("assistant", "hello")  # turn 5
    with pytest.raises(ValueError, match="never decrease"):
        conv.add_message("user", "back", turn_id=4)
    assert conv.unsent == 2


async def test_a_message_without_a_transcript_or_after_the_end_is_a_runtime_error(
    client: MemoryClient,
) -> None:
    plain = client.conversation("conv-1", caller=CALLER)
    with pytest.raises(RuntimeError, match="transcript=True"):
        plain.add_message("user", "hi")
    conv = client.conversation("conv-2", caller=CALLER, transcript=True)
    conv.add_message("user", "hi")
    await conv.end()
    with pytest.raises(RuntimeError, match="has ended"):
        conv.add_message("user", "after the end")


@pytest.mark.parametrize(
    "options",
    [
        {"channel": "no spaces", "transcript": True},
        {"channel": "", "transcript": True},
        {"channel": "x" * 65, "transcript": True},
        {"agent": "bad agent"},
        {"transcript": "yes"},
        {"channel": 5},
    ],
)
async def test_bad_conversation_options_are_refused(client: MemoryClient, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        client.conversation("conv-1", caller=CALLER, **options)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda conv: conv.history(format="xml"), "format"),
        (lambda conv: conv.history(limit=0), "limit"),
        (lambda conv: conv.history(limit=1001), "limit"),
        (lambda conv: conv.history(after_turn=-1), "after_turn"),
        (lambda conv: conv.history(budget=0), "budget"),
        (lambda conv: conv.context(max_tokens=0), "max_tokens"),
        (lambda conv: conv.context(max_tokens=1_000_001), "max_tokens"),
        (lambda conv: conv.context(budget=-1), "budget"),
        (lambda conv: conv.set_summary(5, through_turn=1), "text"),
        (lambda conv: conv.set_summary("x" * 32_001, through_turn=1), "text"),
        (lambda conv: conv.set_summary("s", through_turn=-1), "through_turn"),
        (lambda conv: conv.set_summary("s", through_turn=1, tokens=-1), "tokens"),
        (lambda conv: conv.set_summary("\ud800", through_turn=1), "surrogate"),
        (lambda conv: conv.end(end_reason="hung up"), "end_reason"),
    ],
)
async def test_bad_arguments_of_the_calls_are_refused_before_anything_is_sent(
    client: MemoryClient, call: Any, says: str
) -> None:
    conv = client.conversation("conv-1", caller=CALLER, transcript=True)
    with pytest.raises(ValueError, match=says):
        await call(conv)
    assert client.requests == []  # type: ignore[attr-defined]
