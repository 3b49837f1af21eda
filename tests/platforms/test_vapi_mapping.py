"""The Vapi adapter's tables without a server (service/platforms/vapi.py; docs/vapi.md): ``endedReason`` classes
by rule (every value of vapi-server-sdk 3.0.0's enum is checked in tests/vendors/test_vapi.py), roles, the
``x-timestamp`` units, the answer's shape, and the handoff label."""

from __future__ import annotations

import pytest
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.platforms import vapi


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("customer-ended-call", "completed"),
        ("customer-ended-call-during-transfer", "completed"),
        ("assistant-ended-call-with-hangup-task", "completed"),
        ("assistant-said-end-call-phrase", "completed"),
        ("vonage-completed", "completed"),
        ("call.ending.hook-executed-say", "completed"),
        ("assistant-forwarded-call", "transferred"),
        ("call.ringing.hook-executed-transfer", "transferred"),
        ("assistant-request-returned-forwarding-phone-number", "transferred"),
        ("call.forwarding.operator-busy", "dropped"),
        ("call.in-progress.error-warm-transfer-max-duration", "dropped"),
        ("pipeline-error-openai-llm-failed", "dropped"),
        ("twilio-failed-to-connect-call", "dropped"),
        ("silence-timed-out", "dropped"),
        ("exceeded-max-duration", "dropped"),
        ("vonage-disconnected", "dropped"),
        ("worker-shutdown", "dropped"),
        ("assistant-not-found", "dropped"),
        ("customer-busy", None),
        ("voicemail", None),
        ("hangup", None),
        ("", None),
        (None, None),
    ],
)
def test_ended_reasons_are_classified_by_rule(reason: str | None, expected: str | None) -> None:
    assert vapi.end_reason(reason) == expected


def test_roles_keep_what_was_said_and_never_the_prompt_or_tool_arguments() -> None:
    items = [
        vapi.Item(role="system", message="prompt"),
        vapi.Item(role="bot", message="Hello"),
        vapi.Item(role="assistant", message="Hi again"),
        vapi.Item(role="user", message="Brie?"),
        vapi.Item(role="tool_calls", message=""),
        vapi.Item(role="tool_call_result", toolCallId="t", result="in stock"),
        vapi.Item(role="function_result", toolCallId="t", result="42"),
        vapi.Item(role="user", message=""),
    ]
    assert [(m.role, m.content) for m in vapi.spoken(items)] == [
        ("assistant", "Hello"),
        ("assistant", "Hi again"),
        ("user", "Brie?"),
        ("tool", "in stock"),
        ("tool", "42"),
    ]


@pytest.mark.parametrize(
    ("sent", "ms"),
    [
        ("1796558400", 1796558400000),
        ("1796558400000", 1796558400000),
        ("1796558400.25", 1796558400250),
        ("2026-12-06T12:00:00Z", 1796558400000),
        ("2026-12-06T12:00:00+00:00", 1796558400000),
        ("2026-12-06T12:00:00", None),  # no zone: not a time
        ("soon", None),
        ("", None),
        (None, None),
    ],
)
def test_x_timestamp_in_seconds_milliseconds_or_iso(sent: str | None, ms: int | None) -> None:
    assert vapi.signed_time_ms(sent) == ms


def test_an_end_needs_a_call_id_and_names_it_without_echoing() -> None:
    message = vapi.read_message(b'{"message": {"type": "end-of-call-report", "customer": {"number": "x"}}}')
    with pytest.raises(InvalidInput) as refused:
        vapi.call_end(message)
    assert "message.call.id" in str(refused.value)
    assert vapi.call_end(vapi.read_message(b'{"message": {"type": "speech-update"}}')) is None


def test_the_report_carries_the_analysis_and_the_status_does_not() -> None:
    body = (
        b'{"message": {"type": "%s", "status": "ended", "endedReason": "customer-ended-call",'
        b' "call": {"id": "c1", "customer": {"number": "+14155550100"}},'
        b' "destination": {"type": "sip", "name": "billing desk"},'
        b' "analysis": {"summary": "s", "structuredData": {"a": 1}}, "endedAt": "2026-12-06T12:00:00Z"}}'
    )
    report = vapi.call_end(vapi.read_message(body % b"end-of-call-report"))
    status = vapi.call_end(vapi.read_message(body % b"status-update"))
    assert report is not None and status is not None
    assert report.end.carries_analysis and not status.end.carries_analysis
    assert report.end.summary == "s" and report.end.extracted == {"a": 1}
    assert status.end.summary is None and status.end.extracted == {}
    assert report.end.conversation_id == "vapi:c1" and report.end.transfer_label == "billing desk"
    assert report.end.ended_at == 1796558400000 and report.end.end_reason == "completed"


def test_the_answer_is_the_assistant_with_its_variables() -> None:
    assert vapi.assistant_answer("asst-1", {"resume": ""}) == {
        "assistantId": "asst-1",
        "assistantOverrides": {"variableValues": {"resume": ""}},
    }
