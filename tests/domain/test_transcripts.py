"""Transcript messages without I/O: the schema's rules, the stored form, redaction, and the conversation
configuration block. tests/http/test_transcripts.py sends the same through a real server on every backend."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import orjson
import phonenumbers
import pytest
from caller_memory.service.domain.conversations.messages import (
    PHONE_MASK,
    Message,
    MessageIn,
    chat_of_row,
    check_batch_order,
    encode_message,
    incoming,
    redact,
    stored_rows,
    turns_of_rows,
)
from caller_memory.service.domain.errors import InvalidConfiguration
from caller_memory.service.domain.identifiers import Pseudonymizer
from caller_memory.service.domain.projects import compile_project, parse_config
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

#: The platform example transcript of SPEC section 14 (timestamps in ms).
EXAMPLE: list[dict[str, Any]] = [
    {"role": "assistant", "content": "How can I help you today?", "turn_id": 1, "timestamp": 1678901234000,
     "metadata": {"source": "greeting"}},
    {"role": "user", "content": "Can you tell me a joke?", "turn_id": 2, "timestamp": 1678901235000,
     "metadata": {"source": "asr"}},
    {"role": "assistant", "content": "Why did the scarecrow ", "turn_id": 2, "timestamp": 1678901236000,
     "tokens": 6,
     "metadata": {"source": "llm", "interrupted": True, "interrupt_timestamp": 1678901237000,
                  "original": "Why did the scarecrow win an award? Because he was outstanding in his field!"}},
    {"role": "user", "content": "You know what? Tell me a story instead.", "turn_id": 3,
     "timestamp": 1678901238000, "metadata": {"source": "asr"}},
    {"role": "assistant", "content": "Once upon a time in a land far away, ...", "turn_id": 3,
     "timestamp": 1678901239000, "metadata": {"source": "llm", "agent": "storyteller"}},
    {"message_id": "m-6", "role": "assistant", "content": "Are you still there?", "turn_id": 4,
     "timestamp": 1678901240000, "metadata": {"source": "command"}},
]  # fmt: skip


def _round_trip(document: dict[str, Any]) -> dict[str, Any]:
    message = MessageIn.model_validate(document)
    body = encode_message(
        incoming(message), message.content, message.metadata.original, message.timestamp or 0
    )
    return dict(Message(body).platform())


@pytest.mark.parametrize("document", EXAMPLE, ids=lambda d: f"{d['role']}-{d['turn_id']}")
def test_the_platform_example_round_trips_exactly(document: dict[str, Any]) -> None:
    assert _round_trip(document) == document


def test_after_the_end_times_are_offsets_from_the_start() -> None:
    message = MessageIn.model_validate(EXAMPLE[2])
    body = encode_message(incoming(message), message.content, message.metadata.original, 1678901236000)
    shown = Message(body).platform(offset_from=1678901234000)
    assert shown["timestamp"] == 2000
    assert shown["metadata"]["interrupt_timestamp"] == 3000


def test_openai_layout_carries_what_was_spoken() -> None:
    message = MessageIn.model_validate(EXAMPLE[2])
    body = encode_message(incoming(message), message.content, message.metadata.original, 0)
    assert Message(body).openai() == {"role": "assistant", "content": "Why did the scarecrow "}


def test_a_missing_source_takes_the_roles_default() -> None:
    shown = _round_trip({"role": "user", "content": "hi", "turn_id": 0, "timestamp": 5})
    assert shown["metadata"] == {"source": "message"}
    shown = _round_trip({"role": "assistant", "content": "hello", "turn_id": 0, "timestamp": 5})
    assert shown["metadata"] == {"source": "llm"}


@pytest.mark.parametrize(
    ("role", "source"),
    [("user", "llm"), ("user", "greeting"), ("assistant", "asr"), ("assistant", "tool"), ("tool", "asr"),
     ("user", "silence"), ("assistant", "message"), ("user", "nonsense")],
)  # fmt: skip
def test_a_source_that_does_not_fit_the_role_is_refused(role: str, source: str) -> None:
    with pytest.raises(ValidationError, match="does not fit role"):
        MessageIn.model_validate({"role": role, "content": "x", "turn_id": 0, "metadata": {"source": source}})


@pytest.mark.parametrize(
    "metadata",
    [
        {"source": "asr", "interrupted": True},  # a user message cannot be interrupted
    ],
)
def test_only_assistant_messages_are_interrupted(metadata: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="only an assistant message"):
        MessageIn.model_validate({"role": "user", "content": "x", "turn_id": 0, "metadata": metadata})


@pytest.mark.parametrize("extra", [{"original": "more"}, {"interrupt_timestamp": 5}])
def test_interruption_details_need_an_interruption(extra: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="only on interrupted messages"):
        MessageIn.model_validate(
            {"role": "assistant", "content": "x", "turn_id": 0, "metadata": {"source": "llm", **extra}}
        )


def test_interrupted_false_is_hidden() -> None:
    shown = _round_trip(
        {"role": "assistant", "content": "x", "turn_id": 0, "timestamp": 1,
         "metadata": {"source": "llm", "interrupted": False}}
    )  # fmt: skip
    assert shown["metadata"] == {"source": "llm"}


@pytest.mark.parametrize(
    "document",
    [
        {"role": "system", "content": "You are a bot", "turn_id": 0},  # system prompts are never stored
        {"role": "user", "content": "x", "turn_id": -1},
        {"role": "user", "content": "x", "turn_id": 2**53},
        {"role": "user", "content": "x", "turn_id": 0, "timestamp": -5},
        {"role": "user", "content": "x", "turn_id": 0, "colour": "red"},
        {"role": "user", "content": "x", "turn_id": 0, "message_id": "bad id"},
        {"role": "user", "content": 5, "turn_id": 0},
    ],
)
def test_malformed_messages_are_refused(document: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        MessageIn.model_validate(document)


def test_a_batch_whose_turns_go_backwards_is_named() -> None:
    messages = [MessageIn.model_validate({"role": "user", "content": "x", "turn_id": t}) for t in (1, 3, 2)]
    assert check_batch_order(messages) == (
        "messages[2].turn_id is lower than the previous message's turn_id; turn ids never decrease"
    )
    assert check_batch_order(messages[:2]) is None


# Redaction -------------------------------------------------------------------------------------------------


def _every(_: str) -> bool:
    return True


@pytest.mark.parametrize(
    "spoken",
    [
        "my number is +1 415 555 0100, call me",
        "my number is (415) 555-0100, call me",
        "my number is 415.555.0100, call me",
        "my number is 4155550100, call me",
        "ring me on +44 20 7946 0018 please",
        "ring me on 020 7946 0018 please",
    ],
)
def test_spoken_numbers_are_masked(spoken: str) -> None:
    redacted = redact(spoken, ["US", "GB"], _every)
    assert PHONE_MASK in redacted
    assert sum(ch.isdigit() for ch in redacted) == 0, redacted


def test_text_without_numbers_is_left_as_it_is() -> None:
    text = "I'd like two gouda wheels on Friday at 10, for 2 people"
    assert redact(text, ["US"], _every) == text


def test_only_the_callers_own_number_is_masked_when_asked() -> None:
    own = "+14155550100"
    text = "mine is 415 555 0100 and my wife's is 415 555 0199"
    redacted = redact(text, ["US"], lambda e164: e164 == own)
    assert redacted == f"mine is {PHONE_MASK} and my wife's is 415 555 0199"
    assert phonenumbers.is_possible_number(phonenumbers.parse("+14155550199"))


# Configuration ---------------------------------------------------------------------------------------------


def test_conversation_defaults_follow_the_spec() -> None:
    cc = parse_config({}).memory.conversation
    assert cc.enabled is False
    assert (cc.transcript_retention, cc.idle_after, cc.end_after_inactivity, cc.resume_window) == (
        timedelta(days=1), timedelta(minutes=2), timedelta(minutes=30), timedelta(minutes=10)
    )  # fmt: skip
    assert (cc.redact_phone_numbers, cc.transcript_scope, cc.cross_channel) == (True, "shared", False)
    assert cc.max_transcript_bytes == 1 << 30


def test_the_inactivity_end_default_fits_a_short_transcript_retention() -> None:
    cc = parse_config({"memory": {"conversation": {"transcript_retention": "PT1M"}}}).memory.conversation
    assert (cc.end_after_inactivity, cc.idle_after) == (timedelta(minutes=1), timedelta(seconds=30))


def test_defaults_shrink_to_fit_a_short_retention() -> None:
    config = parse_config(
        {"memory": {"repeat_caller": {"retention": "PT10S"}, "conversation": {"enabled": True}}}
    )
    cc = config.memory.conversation
    assert cc.transcript_retention == cc.end_after_inactivity == cc.resume_window == timedelta(seconds=10)
    assert cc.idle_after == timedelta(seconds=5)
    project = compile_project("p", config, Pseudonymizer(b"k" * 32))
    assert project.conversation.transcript_retention_ms == 10_000


@pytest.mark.parametrize(
    ("conversation", "field"),
    [
        ({"transcript_retention": "P100D"}, "memory.conversation.transcript_retention"),
        ({"end_after_inactivity": "P91D"}, "memory.conversation.end_after_inactivity"),
        (
            {"transcript_retention": "PT1M", "end_after_inactivity": "PT30M"},
            "memory.conversation.end_after_inactivity",
        ),
        ({"idle_after": "PT30M", "end_after_inactivity": "PT30M"}, "memory.conversation.idle_after"),
        ({"transcript_retention": "PT1H", "resume_window": "PT2H"}, "memory.conversation.resume_window"),
        ({"transcript_scope": "everyone"}, "memory.conversation.transcript_scope"),
        ({"max_transcript_bytes": 10}, "memory.conversation.max_transcript_bytes"),
        ({"idle_after": "2 minutes"}, "memory.conversation.idle_after"),
        ({"colour": "red"}, "memory.conversation.colour"),
    ],
)
def test_invalid_conversation_configuration_names_the_field(conversation: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidConfiguration) as caught:
        parse_config({"memory": {"conversation": conversation}})
    assert caught.value.field == field


#: A stored row as encode_message writes it: role code, content, turn, timestamp, tokens, source, id, extras?
ROWS = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 2]),
        st.text(max_size=30),
        st.integers(0, 6),
        st.one_of(st.none(), st.integers(0, 50)),
        st.sampled_from([None, "booking", "billing"]),
        st.booleans(),
    ).map(
        lambda t: (
            [t[0], t[1], t[2], 1_800_000_000_000, t[3], "asr" if t[0] == 0 else "llm", None]
            + ([{"a": t[4]} | ({"x": 1} if t[5] else {})] if t[4] or t[5] else [])
        )
    ),
    max_size=25,
)


@given(ROWS, st.integers(-1, 5), st.sampled_from([None, "booking", "billing"]))
def test_the_contexts_selection_on_rows_is_what_messages_say(
    rows: list[list[Any]], after_turn: int, agent: str | None
) -> None:
    """turns_of_rows (the context read, without building messages) keeps, groups and counts what the
    Message of each row says: its turn, its role, Message.visible_to and Message.token_count."""
    bodies = [orjson.dumps(row) for row in rows]
    messages = Message.decode_all(bodies)
    turns, costs = turns_of_rows(stored_rows(bodies), after_turn, agent)
    expected: dict[int, list[Message]] = {}
    for m in messages:
        if m.turn_id > after_turn and m.role != "tool" and m.visible_to(agent):
            expected.setdefault(m.turn_id, []).append(m)
    assert list(turns) == list(expected)
    for turn, group in expected.items():
        assert [chat_of_row(row) for row in turns[turn]] == [m.openai() for m in group]
        assert costs[turn] == sum(m.token_count for m in group)
