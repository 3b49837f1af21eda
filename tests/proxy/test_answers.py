"""Reading the assistant's answer out of an upstream's reply as it passes (service/proxy/answers.py): a stream
in chunks cut anywhere (inside a line, a UTF-8 character, CRLF), only a whole answer, choice 0, nothing for
tool calls alone or an answer longer than a transcript message; and the id the answer takes (the one the
next request gives it when spoken whole)."""

from __future__ import annotations

import orjson
import pytest
from caller_memory.service.proxy.answers import MAX_ANSWER_BYTES, AnswerReader
from caller_memory.service.proxy.requests import read_completion


def event(content: str | None = None, index: int = 0, **delta: object) -> bytes:
    if content is not None:
        delta["content"] = content
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def read(body: bytes, *, stream: bool = True, size: int = 1) -> str | None:
    reader = AnswerReader(stream=stream)
    for at in range(0, len(body), size):
        reader.feed(body[at : at + size])
    return reader.text()


@pytest.mark.parametrize("size", [1, 3, 7, 64, 10_000])
def test_a_stream_cut_anywhere_reads_whole(size: int) -> None:
    body = (
        b": keep-alive\n\n"
        + event("", role="assistant")
        + event("Bonjour, ")
        + event("ignored", index=1)
        + event("été!").replace(b"\n\n", b"\r\n\r\n")
        + b"event: ignored\ndata: not json\n\n"
        + b"data: [DONE]\n\n"
    )
    assert read(body, size=size) == "Bonjour, été!"


def test_no_answer_without_its_end_or_words() -> None:
    assert read(event("Half")) is None  # no [DONE]: cut
    tool_calls = event(tool_calls=[{"index": 0, "function": {"name": "book"}}]) + b"data: [DONE]\n\n"
    assert read(tool_calls) is None
    too_long = event("x" * (MAX_ANSWER_BYTES + 1)) + b"data: [DONE]\n\n"
    assert read(too_long, size=4096) is None
    assert read(event("x" * MAX_ANSWER_BYTES) + b"data: [DONE]\n\n", size=4096) == "x" * MAX_ANSWER_BYTES


def test_a_whole_completion() -> None:
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Cheddar."}}]}
    assert read(orjson.dumps(whole), stream=False, size=5) == "Cheddar."
    assert read(orjson.dumps(whole)[:-3], stream=False) is None
    assert read(orjson.dumps({"choices": [{"index": 0, "message": {"content": None}}]}), stream=False) is None


def test_the_answer_takes_the_id_the_next_request_gives_it() -> None:
    first = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"}]}
    answer = read_completion(orjson.dumps(first)).answer("Hello")
    assert answer is not None
    recorded, before = answer
    assert before == 0 and recorded.turn_id == 1
    spoken = {"messages": [*first["messages"], {"role": "assistant", "content": "Hello"}]}
    assert read_completion(orjson.dumps(spoken)).recorded()[-1] == recorded
    # Cut short, it is another message: the next request's.
    cut = {"messages": [*first["messages"], {"role": "assistant", "content": "Hel"}]}
    assert read_completion(orjson.dumps(cut)).recorded()[-1].message_id != recorded.message_id
    # With Agora's turns, the id is the turn's, whatever was spoken.
    agora = {**first, "turn_id": 4}
    turn_answer = read_completion(orjson.dumps(agora)).answer("Hello")
    assert turn_answer is not None
    next_request = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "Hel", "turn_id": 4, "metadata": {"interrupted": True}},
        ]
    }
    assert read_completion(orjson.dumps(next_request)).recorded()[-1].message_id == turn_answer[0].message_id
