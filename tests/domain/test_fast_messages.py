"""The append body's fast reading (transcript_bodies.parse_append without pydantic) against pydantic's
reading of AppendBody: on generated bodies, valid and broken in every member, the fast reading accepts
exactly what pydantic accepts, with the same result, and refuses (leaving the error message to pydantic)
everything else."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.conversations.messages import MAX_BATCH, MAX_INT, SOURCES, incoming
from caller_memory.service.domain.conversations.requests import (
    AppendBody,
    Batch,
    _fast_batch,
    parse_append,
    read_append,
)
from caller_memory.service.domain.documents import parse_document
from caller_memory.service.domain.errors import InvalidInput, MalformedRequest
from caller_memory.service.domain.limits import MAX_STATE_ENTRIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

#: Values that break each kind of member: wrong JSON types, out of range, patterns not met.
ODD = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        -1,
        1.5,
        "",
        "x",
        "a b",
        "\n",
        "-x",
        "x\n",
        [],
        {},
        [1],
        {"a": 1},
        MAX_INT + 1,
        2**63,
    ]
)

#: True one time in five (and False when shrunk: towards the valid).
RARE = st.sampled_from([False] * 4 + [True])


def mostly(valid: st.SearchStrategy[Any], odd: st.SearchStrategy[Any] = ODD) -> st.SearchStrategy[Any]:
    """``valid`` four times in five, else an ``odd`` value (so that most generated bodies are valid, and the
    invalid ones are mostly wrong in one member)."""
    return RARE.flatmap(lambda rare: odd if rare else valid)


def members(
    required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Any]:
    """Objects with ``required`` and any of ``optional``; one in five misses a required member or has one
    no schema has."""
    whole = st.fixed_dictionaries(required, optional=optional)
    broken = st.fixed_dictionaries({}, optional={**required, **optional, "unknown": st.just(1)})
    return RARE.flatmap(lambda odd: broken if odd else whole)


NAMES = mostly(st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,70}\Z"))  # some longer than the 64 allowed
INTS = mostly(
    RARE.flatmap(
        lambda odd: st.sampled_from([-1, MAX_INT + 1]) if odd else st.integers(min_value=0, max_value=MAX_INT)
    )
)
#: Odd values for a text member: anything but text.
NOT_TEXT = ODD.filter(lambda v: not isinstance(v, str))
TEXT = mostly(st.text(max_size=80), NOT_TEXT)
SOURCE = mostly(st.sampled_from(["", *sorted(set().union(*SOURCES.values()))]))


def rarely(draw: st.DrawFn) -> bool:
    return draw(RARE)


@st.composite
def metadata(draw: st.DrawFn, role: Any) -> Any:
    """A message's metadata, mostly fit for its role (the rules tie source and interruption to it)."""
    fitting = sorted(SOURCES.get(role, set())) if isinstance(role, str) else []
    interrupted = role == "assistant" and draw(st.booleans())
    if rarely(draw):
        interrupted = draw(st.booleans())
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        out["source"] = draw(SOURCE if rarely(draw) or not fitting else st.sampled_from(["", *fitting]))
    if interrupted or draw(st.booleans()):
        out["interrupted"] = draw(mostly(st.just(interrupted)))
    if interrupted or rarely(draw):
        if draw(st.booleans()):
            out["interrupt_timestamp"] = draw(INTS)
        if draw(st.booleans()):
            out["original"] = draw(TEXT)
    if draw(st.booleans()):
        out["agent"] = draw(NAMES)
    if rarely(draw):
        out["unknown"] = 1
    return draw(mostly(st.just(out)))


@st.composite
def message(draw: st.DrawFn) -> Any:
    role = draw(mostly(st.sampled_from(["user", "assistant", "tool"])))
    out: dict[str, Any] = {"role": role, "content": draw(TEXT), "turn_id": draw(INTS)}
    for name, value in (
        ("message_id", mostly(st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,130}\Z"))),
        ("timestamp", INTS),
        ("tokens", mostly(st.integers(min_value=-1, max_value=1_000_001))),
        ("metadata", metadata(role)),
    ):
        if draw(st.booleans()):
            out[name] = draw(value)
    if rarely(draw):
        del out[draw(st.sampled_from(["role", "content", "turn_id"]))]
    return draw(mostly(st.just(out)))


MESSAGE = message()


BODY = mostly(
    members(
        {},
        {
            "caller": mostly(st.one_of(st.text(max_size=12), st.text(min_size=63, max_size=66)), NOT_TEXT),
            "channel": NAMES,
            "agent": NAMES,
            "messages": mostly(
                st.one_of(
                    st.lists(MESSAGE, max_size=4),
                    st.sampled_from([MAX_BATCH, MAX_BATCH + 1]).map(
                        lambda n: [{"role": "user", "content": "x", "turn_id": 0}] * n
                    ),
                )
            ),
            "state": mostly(
                st.one_of(
                    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                    st.sampled_from([MAX_STATE_ENTRIES, MAX_STATE_ENTRIES + 1]).map(
                        lambda n: {str(i): i for i in range(n)}
                    ),
                )
            ),
            "sent_at": INTS,
        },
    )
)


def pydantic_reading(document: Any) -> Batch | None:
    try:
        body = AppendBody.model_validate(document)
    except ValidationError:
        return None
    messages = [incoming(m) for m in body.messages]
    return Batch(body.caller, body.channel, body.agent, messages, body.state, body.sent_at)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODY)
def test_the_fast_reading_accepts_what_pydantic_accepts_with_the_same_result(document: Any) -> None:
    assert _fast_batch(document) == pydantic_reading(document)


@settings(max_examples=4000, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=2))
def test_the_fast_reading_of_messages_agrees_with_pydantic(messages: list[Any]) -> None:
    """The messages alone, many more of them: the rules tying metadata to the role are met or broken in
    few generated bodies."""
    document = {"messages": messages}
    assert _fast_batch(document) == pydantic_reading(document)


VALID = {
    "caller": "+14155552671",
    "channel": "pstn",
    "agent": "front-desk",
    "messages": [
        {"role": "assistant", "content": "Hello", "turn_id": 0, "metadata": {"source": "greeting"}},
        {"message_id": "m-1", "role": "user", "content": "Hi", "turn_id": 1, "timestamp": 5, "tokens": 1},
        {
            "role": "assistant",
            "content": "Why did",
            "turn_id": 1,
            "metadata": {
                "interrupted": True,
                "interrupt_timestamp": 9,
                "original": "Why did the",
                "agent": "a",
            },
        },
        {"role": "tool", "content": "{}", "turn_id": 1, "metadata": {"source": ""}},
    ],
    "state": {"step": "booking"},
    "sent_at": 7,
}


def test_a_valid_body_takes_the_fast_reading() -> None:
    fast = _fast_batch(VALID)
    assert fast is not None and fast == pydantic_reading(VALID)
    assert [m.source for m in fast.messages] == ["greeting", "message", "llm", "tool"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"messages": [{"role": "user", "content": "x", "turn_id": 0, "metadata": {"source": "llm"}}]},
            "source",
        ),
        ({"messages": [{"role": "user", "content": "x", "turn_id": True}]}, "turn_id"),
        ({"messages": [{"role": "user", "content": "x"}]}, "turn_id"),
        ({"messages": [{"role": "user", "content": "x", "turn_id": 0}] * (MAX_BATCH + 1)}, "messages"),
        ({"channel": "has space"}, "channel"),
        ({"sent_at": -1}, "sent_at"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_body_the_fast_reading_refuses_gets_pydantics_message(change: dict[str, Any], named: str) -> None:
    document = {**VALID, **change}
    assert _fast_batch(document) is None
    with pytest.raises(InvalidInput) as refused:
        parse_append(document)
    assert named in str(refused.value)


#: Values each member is set to in turn, in each valid body below: every JSON type, the edges of each range.
EDGES = [None, True, False, 0, -1, 1, 1.5, MAX_INT, MAX_INT + 1, 1_000_000, 1_000_001, 2**63, "", "x", "a b",
         "x\n", "-x", "llm", "asr", "message", "command", "tool", "user", "assistant", "A" * 64, "A" * 65,
         "A" * 128, "A" * 129, [], {}, [1], {"a": 1}]  # fmt: skip
FULL_METADATA = {"source": "llm", "interrupted": True, "interrupt_timestamp": 9, "original": "Why did the",
                 "agent": "a"}  # fmt: skip
BASES: list[dict[str, Any]] = [
    {"caller": "+14155552671", "channel": "pstn", "agent": "desk", "state": {"a": 1}, "sent_at": 1,
     "messages": [{"message_id": "m-1", "role": "assistant", "content": "Why", "turn_id": 1, "timestamp": 5,
                   "tokens": 1, "metadata": FULL_METADATA}]},
    {"messages": [{"role": "user", "content": "Hi", "turn_id": 0, "metadata": {"source": "asr"}}]},
    {"messages": [{"role": "tool", "content": "{}", "turn_id": 0, "metadata": {}}]},
]  # fmt: skip


def _paths(document: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every member's path in ``document``, and the paths of the optional members it leaves out."""
    out: list[tuple[Any, ...]] = []
    if isinstance(document, dict):
        names = set(document) | (set(FULL_METADATA) if path and path[-1] == "metadata" else set())
        for name in sorted(names):
            out.append((*path, name))
            if name in document:
                out += _paths(document[name], (*path, name))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            out += _paths(value, (*path, index))
    return out


def _with(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    copy = orjson.loads(orjson.dumps(document))
    target = copy
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return copy


@pytest.mark.parametrize("base", range(len(BASES)))
def test_each_member_set_to_each_edge_value_reads_as_pydantic_reads_it(base: int) -> None:
    cases = 0
    for path in _paths(BASES[base]):
        for value in EDGES:
            document = _with(BASES[base], path, value)
            assert _fast_batch(document) == pydantic_reading(document), (path, value)
            cases += 1
    assert cases > 300


# Reading the raw body in one pass (read_append) ---------------------------------------------------------------


def _mutations() -> list[Callable[[bytes], bytes]]:
    """Byte-level changes that make a body inexact or odd in ways a document cannot show: a member given
    twice, a float, an integer beyond JSON's exact range, an escaped colon, whitespace."""
    return [
        lambda raw: raw.replace(b'{"', b'{"caller":"x","', 1),
        lambda raw: raw.replace(b'"role":', b'"role":"user","role":', 1),
        lambda raw: re.sub(rb'"turn_id":(\d+)', rb'"turn_id":\1.0', raw, count=1),
        lambda raw: re.sub(rb'"sent_at":\d+', b'"sent_at":99999999999999999999', raw, count=1),
        lambda raw: raw.replace(b'"content":"', b'"content":"\\u003a', 1),
        lambda raw: raw.replace(b'"content":"', b'"content":"a:b', 1),
        lambda raw: raw.replace(b",", b", \n", 2),
        lambda raw: raw.replace(b'"state":{', b'"state":{"n":1e400,', 1),
        lambda raw: raw.replace(b'"metadata":{', b'"metadata":{"source":"llm","source":"asr",', 1),
    ]


def _outcome(read: Callable[[], Any]) -> Any:
    try:
        return ("read", read())
    except (InvalidInput, MalformedRequest) as exc:
        return ("refused", type(exc).__name__, exc.detail)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODY, st.lists(st.sampled_from(range(len(_mutations()))), max_size=2))
def test_reading_the_raw_body_in_one_pass_agrees_with_parsing_then_validating(
    document: Any, changes: list[int]
) -> None:
    try:
        raw = orjson.dumps(document)
    except TypeError:  # an integer orjson does not write (beyond 64 bits): not a body a client sends
        return
    for change in changes:
        raw = _mutations()[change](raw)
    expected = _outcome(lambda: parse_append(parse_document(raw)))
    assert _outcome(lambda: parse_append(read_append(raw))) == expected


def test_the_one_pass_reading_is_taken_for_a_plain_valid_body() -> None:
    raw = orjson.dumps(VALID)
    assert isinstance(read_append(raw), Batch)
    # Not provable in one pass (a colon in a string and an escape elsewhere): parsed, then validated.
    unproven = raw.replace(b'"Hello"', b'"Hel:lo"').replace(b'"Hi"', b'"H\\u00efi"')
    assert isinstance(read_append(unproven), dict)
    assert parse_append(read_append(unproven)).messages[1].content == "H\u00efi"
    with pytest.raises(InvalidInput, match="twice"):
        read_append(raw.replace(b'"sent_at":7', b'"sent_at":7,"sent_at":7'))
