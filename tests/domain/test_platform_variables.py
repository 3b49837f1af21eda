"""A call start's string variables (service/domain/platforms/variables.py), the same for every platform: the
memory as data (framed as render_memory frames it), memory_<key> for every state key, returning_caller and
resume; a value holding a phone number withheld from every one; the fail-open answer complete and empty."""

from __future__ import annotations

import orjson
from caller_memory.sdk.render import PREAMBLE
from caller_memory.service.domain.platforms.ingestion import StartAnswer
from caller_memory.service.domain.platforms.variables import start_variables

KEYS = ["caller_name", "callback", "visits", "booking_day"]
REGIONS = ["US"]


def data_of(text: str) -> dict[str, object]:
    preamble, _, document = text.partition("\n")
    assert preamble == PREAMBLE
    parsed: dict[str, object] = orjson.loads(document)
    return parsed


def test_variables_hold_the_memory_as_data_and_never_a_number() -> None:
    answer = StartAnswer(
        "vapi:c-1",
        {"caller_name": "Ada", "callback": "call me on +1 415 555 0188", "visits": 3},
        returning_caller=True,
    )
    variables = start_variables(answer, KEYS, REGIONS)
    assert data_of(variables["caller_memory"]) == {"caller_memory": {"caller_name": "Ada", "visits": 3}}
    assert variables["memory_caller_name"] == "Ada" and variables["memory_visits"] == "3"
    assert variables["memory_callback"] == "" and variables["memory_booking_day"] == ""
    assert variables["returning_caller"] == "true" and variables["resume"] == ""
    assert "4155550188" not in "".join(variables.values()).replace(" ", "")


def test_the_fail_open_answer_has_every_variable_empty() -> None:
    variables = start_variables(StartAnswer("vapi:c-2", None, fail_open=True, started=False), KEYS, REGIONS)
    assert variables == {
        "caller_memory": "",
        "returning_caller": "false",
        "resume": "",
        **{f"memory_{key}": "" for key in KEYS},
    }


def test_a_resume_is_its_summary_state_and_spoken_turns_as_data() -> None:
    resume = {
        "conversation_id": "vapi:c-0",
        "last_activity_at": "2026-12-06T21:00:00Z",
        "summary": {"text": "Was booking brie.", "through_turn": 2},
        "state": {"cheese": "brie", "callback": "+1 415 555 0188"},
        "last_turns": [
            {"role": "user", "content": "Brie for Friday", "turn_id": 2},
            {"role": "tool", "content": "{}", "turn_id": 2},
        ],
    }
    variables = start_variables(StartAnswer("vapi:c-3", {}, resume=resume), KEYS, REGIONS)
    assert data_of(variables["resume"]) == {
        "dropped_call": {
            "last_activity_at": "2026-12-06T21:00:00Z",
            "summary": "Was booking brie.",
            "state": {"cheese": "brie"},
            "last_turns": [{"role": "user", "content": "Brie for Friday"}],
        }
    }
    assert variables["caller_memory"] == ""
