"""ElevenLabs' mapping tables, row by row, without a server (service/platforms/elevenlabs.py; docs/elevenlabs.md):
the end reason, the roles, the data collection, the conversation an end names, and the signature header."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import pytest
from caller_memory.service.domain.platforms.verification import SignatureRefused
from caller_memory.service.platforms import elevenlabs
from caller_memory.service.platforms.elevenlabs import Conversation, Event

NOW_S = 1_800_000_000


@pytest.mark.parametrize(
    ("status", "metadata", "expected"),
    [
        ("done", {"termination_reason": "Call ended by remote party"}, "completed"),
        ("done", {"termination_reason": "The remote party hung up."}, "completed"),
        ("done", {"termination_reason": "end_call tool was called."}, "completed"),
        ("done", {"termination_reason": "Client disconnected: 1000"}, "completed"),
        ("done", {"termination_reason": "transfer_to_number tool was called."}, "transferred"),
        ("done", {"termination_reason": "Ending conversation after 40 seconds of silence."}, "dropped"),
        ("done", {"termination_reason": "voicemail_detection tool was called."}, "dropped"),
        ("done", {"termination_reason": "Maximum duration exceeded"}, "dropped"),
        ("done", {"termination_reason": "This request exceeds your quota limit."}, "dropped"),
        ("done", {"phone_call": {"call_result": "busy"}}, "dropped"),
        ("done", {"phone_call": {"call_result": "no_answer"}}, "dropped"),
        ("done", {"phone_call": {"call_result": "answered"}, "termination_reason": "Something new"}, None),
        ("failed", {"termination_reason": "Call ended by remote party"}, "dropped"),
        ("done", {"error": {"code": 1011, "reason": "internal"}}, "dropped"),
        ("done", {}, None),
    ],
)
def test_end_reason_rows(status: str, metadata: dict[str, Any], expected: str | None) -> None:
    assert elevenlabs.end_reason(status, metadata) == expected


def test_roles_interruptions_and_tool_calls() -> None:
    conversation = Conversation.model_validate(
        {
            "transcript": [
                {"role": "agent", "message": "Hi", "time_in_call_secs": 0},
                {"role": "user", "message": "Hello", "time_in_call_secs": 1},
                {
                    "role": "agent",
                    "message": None,
                    "tool_calls": [{"tool_name": "x"}],
                    "time_in_call_secs": 2,
                },
                {"role": "agent", "message": "Sure", "interrupted": False, "original_message": "Sure!"},
                {"role": "agent", "message": "We", "interrupted": True, "original_message": "We have it."},
                {"role": "system", "message": "ignored"},
            ]
        }
    )
    assert [(m.role, m.content, m.original) for m in elevenlabs.messages_of(conversation)] == [
        ("assistant", "Hi", None),
        ("user", "Hello", None),
        ("assistant", "Sure", None),
        ("assistant", "We", "We have it."),
    ]


def test_data_collection_becomes_extracted_values() -> None:
    analysis = {
        "data_collection_results": {
            "name": {"data_collection_id": "name", "value": "Ada", "rationale": "r"},
            "count": {"data_collection_id": "count", "value": 3, "rationale": "r"},
            "unset": {"data_collection_id": "unset", "rationale": "r"},
        }
    }
    assert elevenlabs.extracted_of(analysis) == {"name": "Ada", "count": 3}
    assert elevenlabs.extracted_of(None) == {} and elevenlabs.extracted_of({"x": 1}) == {}


def test_the_conversation_an_end_names() -> None:
    named = {
        "conversation_initiation_client_data": {
            "dynamic_variables": {"caller_memory_conversation": "elevenlabs:ab"}
        }
    }
    assert elevenlabs.conversation_id_of(Conversation.model_validate({**named, "conversation_id": "c1"})) == (
        "elevenlabs:ab"
    )
    extra = {
        "conversation_initiation_client_data": {
            "custom_llm_extra_body": {"caller_memory_conversation": "elevenlabs:cd"}
        }
    }
    assert elevenlabs.conversation_id_of(Conversation.model_validate(extra)) == "elevenlabs:cd"
    bad = {
        "conversation_initiation_client_data": {"dynamic_variables": {"caller_memory_conversation": "a b"}}
    }
    assert elevenlabs.conversation_id_of(Conversation.model_validate({**bad, "conversation_id": "c1"})) == (
        "elevenlabs:c1"
    )
    assert elevenlabs.conversation_id_of(Conversation.model_validate({})) is None
    assert elevenlabs.end_of(Event(type="post_call_audio", data={"conversation_id": "c"})) is None


def _header(body: bytes, secret: str, at: int) -> str:
    digest = hmac.new(secret.encode(), f"{at}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={at},v0={digest}"


def test_the_signature_header() -> None:
    body = b'{"type":"post_call_transcription"}'
    good = _header(body, "s3cret", NOW_S)
    assert elevenlabs.verify("s3cret", body, good, NOW_S * 1000).signed_at_ms == NOW_S * 1000
    # A secret being rotated: two v0, one matching.
    other = _header(body, "old", NOW_S).split(",")[1]
    assert elevenlabs.verify("s3cret", body, f"{other},{good}", NOW_S * 1000)
    refused = [
        ("s3cret", None),
        ("s3cret", ""),
        ("s3cret", good.replace("t=", "ts=")),
        ("s3cret", f"t={NOW_S}"),
        ("s3cret", f"t=-5,{good.split(',')[1]}"),
        ("wrong", good),
        (None, good),
    ]
    for secret, header in refused:
        with pytest.raises(SignatureRefused):
            elevenlabs.verify(secret, body, header, NOW_S * 1000)
    with pytest.raises(SignatureRefused, match="too old"):
        elevenlabs.verify("s3cret", body, _header(body, "s3cret", NOW_S - 1801), NOW_S * 1000)
    with pytest.raises(SignatureRefused, match="future"):
        elevenlabs.verify("s3cret", body, _header(body, "s3cret", NOW_S + 301), NOW_S * 1000)
    assert elevenlabs.verify("s3cret", body, _header(body, "s3cret", NOW_S - 1799), NOW_S * 1000)
    assert elevenlabs.verify("s3cret", body, _header(body, "s3cret", NOW_S + 299), NOW_S * 1000)
