"""The Retell adapter's tables and parsing without a server (service/platforms/retell.py; docs/retell.md): every
``disconnection_reason`` retell-sdk 6.2.13 lists is mapped, each role and each analysis field lands where the
guide says, and the signature is read as retell-sdk's ``verify`` reads it."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import orjson
import pytest
from caller_memory.service.domain.errors import InvalidInput, MalformedRequest
from caller_memory.service.domain.platforms.verification import SignatureRefused
from caller_memory.service.platforms import retell

#: ``PhoneCallResponse.disconnection_reason`` in retell-sdk 6.2.13 (``retell/types/phone_call_response.py``),
#: in its order, with the class docs/retell.md gives each.
REASONS: dict[str, str] = {
    "user_hangup": "completed",
    "agent_hangup": "completed",
    "user_requested_dnc": "completed",
    "user_requested_callback": "completed",
    "call_transfer": "transferred",
    "voicemail_reached": "completed",
    "ivr_reached": "completed",
    "inactivity": "dropped",
    "max_duration_reached": "dropped",
    "concurrency_limit_reached": "dropped",
    "no_concurrency_fallback": "dropped",
    "no_valid_payment": "dropped",
    "credit_exhausted": "dropped",
    "budget_reached": "dropped",
    "scam_detected": "completed",
    "dial_busy": "completed",
    "dial_failed": "dropped",
    "dial_no_answer": "completed",
    "invalid_destination": "dropped",
    "telephony_provider_permission_denied": "dropped",
    "telephony_provider_unavailable": "dropped",
    "sip_routing_error": "dropped",
    "marked_as_spam": "completed",
    "network_blocked": "completed",
    "user_declined": "completed",
    "error_llm_websocket_open": "dropped",
    "error_llm_websocket_lost_connection": "dropped",
    "error_llm_websocket_runtime": "dropped",
    "error_llm_websocket_corrupt_payload": "dropped",
    "error_no_audio_received": "dropped",
    "error_asr": "dropped",
    "error_retell": "dropped",
    "error_unknown": "dropped",
    "error_user_not_joined": "dropped",
    "registered_call_timeout": "dropped",
    "transfer_bridged": "transferred",
    "transfer_cancelled": "dropped",
    "manual_stopped": "completed",
    "call_take_over": "transferred",
}
KEY = "key_" + "0f" * 16
NOW = 1_790_000_000_000


def call(**fields: Any) -> retell.Call:
    return retell.Call.model_validate({"call_id": "call_1", **fields})


def test_every_disconnection_reason_has_its_class() -> None:
    assert len(REASONS) == 39
    assert dict(retell.END_REASONS) == REASONS
    for reason, expected in REASONS.items():
        end = retell.end_of(retell.ANALYZED, call(disconnection_reason=reason))
        assert end.end_reason == expected, reason
    assert retell.end_of(retell.ANALYZED, call(disconnection_reason="new_in_2027")).end_reason is None


def test_roles_and_what_is_not_kept() -> None:
    utterances = [
        {"role": "agent", "content": "Hello", "words": [{"word": "Hello", "start": 0.1, "end": 0.4}]},
        {"role": "user", "content": "Hi", "metadata": {"response_id": 1}},
        {"role": "transfer_target", "content": "Cellar desk"},
        {"role": "tool_call_invocation", "content": "{}"},
        {"role": "user", "content": "  "},
    ]
    messages = retell.messages_of(call(transcript_object=utterances))
    assert [(m.role, m.content, m.original, m.turn_id) for m in messages] == [
        ("assistant", "Hello", None, None),
        ("user", "Hi", None, None),
    ]
    # An utterance longer than a stored message may be is cut (whole characters), not the end refused.
    (long,) = retell.messages_of(call(transcript_object=[{"role": "user", "content": "fromage é " * 2000}]))
    assert len(long.content.encode()) <= retell.MAX_UTTERANCE_BYTES
    assert long.content and "fromage é ".startswith(long.content[:10])
    # transcript_with_tool_calls is never read.
    with_tools = call(transcript_with_tool_calls=[{"role": "tool_call_result", "content": "secret"}])
    assert retell.messages_of(with_tools) == []


def test_the_analysis_becomes_summary_and_extracted_data() -> None:
    analysis = {
        "call_summary": "Asked for Brie.",
        "call_successful": True,
        "user_sentiment": "Positive",
        "custom_analysis_data": {"customer_name": "Ada", "call_analysis": "custom wins"},
    }
    analyzed = call(call_analysis=analysis, collected_dynamic_variables={"order": "42"})
    end = retell.end_of(retell.ANALYZED, analyzed)
    assert end.carries_analysis and end.summary == "Asked for Brie."
    assert end.extracted == {
        "customer_name": "Ada",
        "call_analysis": "custom wins",
        "collected_dynamic_variables": {"order": "42"},
    }
    plain = retell.end_of(retell.ANALYZED, call(call_analysis={"call_successful": False}))
    assert plain.extracted == {"call_analysis": {"call_successful": False}} and plain.summary is None
    # call_ended carries no analysis (Retell sends it without; anything there is not read).
    ended = retell.end_of(retell.ENDED, analyzed)
    assert not ended.carries_analysis and ended.summary is None and dict(ended.extracted) == {}
    # An analysis that is not an object is not read.
    odd = retell.end_of(retell.ANALYZED, call(call_analysis={"custom_analysis_data": ["x"]}))
    assert "x" not in orjson.dumps(dict(odd.extracted)).decode()


def test_conversation_caller_times_and_transfer_label() -> None:
    named = call(metadata={"caller_memory_conversation": "retell:abc"}, from_number="+14155550100")
    end = retell.end_of(retell.ENDED, named)
    assert end.conversation_id == "retell:abc" and end.caller == "+14155550100"
    assert retell.conversation_of(call(metadata={"caller_memory_conversation": "no spaces allowed"})) == (
        "retell:call_1"
    )
    assert retell.conversation_of(call(metadata="not an object")) == "retell:call_1"
    with pytest.raises(InvalidInput):
        retell.conversation_of(retell.Call.model_validate({"call_id": "a b"}))
    outbound = call(direction="outbound", from_number="+14155550199", to_number="+14155550100")
    assert retell.caller_of(outbound) == "+14155550100"
    assert retell.caller_of(call(call_type="web_call")) == ""
    timed = retell.end_of(retell.ENDED, call(start_timestamp=NOW - 60_000, end_timestamp=NOW))
    assert (timed.started_at, timed.ended_at) == (NOW - 60_000, NOW)
    sip = call(transfer_destination="sip:cellar@shop.example;transport=tls")
    assert retell.transfer_label(sip) == "sip:cellar@shop.example"
    assert retell.transfer_label(call()) is None


def sign(body: bytes, at: int = NOW, key: str = KEY) -> str:
    return f"v={at},d={hmac.new(key.encode(), body + str(at).encode(), hashlib.sha256).hexdigest()}"


def test_the_signature_is_read_as_retell_writes_it() -> None:
    body = '{"event":"call_inbound","call_inbound":{"from_number":"+14155550100","note":"crème"}}'.encode()
    assert retell.verify(KEY, body, sign(body), NOW) == NOW
    assert retell.verify(KEY, body, sign(body, NOW - 300_000), NOW) == NOW - 300_000
    assert retell.verify(KEY, body, sign(body, NOW + 300_000), NOW) == NOW + 300_000
    refused = [
        (KEY, body, None),
        (KEY, body, ""),
        (KEY, body, sign(body).upper()),
        (KEY, body, sign(body).replace("v=", "t=")),
        (KEY, body + b" ", sign(body)),
        ("key_other", body, sign(body)),
        (None, body, sign(body)),
        (KEY, body, sign(body, NOW - 300_001)),
        (KEY, body, sign(body, NOW + 300_001)),
    ]
    for secret, signed, signature in refused:
        with pytest.raises(SignatureRefused) as caught:
            retell.verify(secret, signed, signature, NOW)
        assert KEY not in str(caught.value)


def test_bodies_that_are_not_retells_are_named_never_echoed() -> None:
    with pytest.raises(MalformedRequest):
        retell.read_event(b"{not json")
    with pytest.raises(InvalidInput) as caught:
        retell.read_inbound(b'{"event": "call_inbound", "call_inbound": {"from_number": ["+14155550100"]}}')
    assert "call_inbound.from_number" in str(caught.value) and "415" not in str(caught.value)
    with pytest.raises(InvalidInput):
        retell.read_inbound(b'{"event": "call_ended", "call": {}}')
    assert retell.read_event(b'{"event": "transcript_updated", "call": {}}') == ("transcript_updated", None)
    with pytest.raises(InvalidInput) as caught:
        retell.read_event(b'{"event": "call_analyzed", "call": {"from_number": "+14155550100"}}')
    assert "call.call_id" in str(caught.value)


def test_the_inbound_answer_is_retells_shape() -> None:
    answer = retell.InboundAnswer({"caller_memory": ""}, "retell:abc").body()
    assert answer == {
        "call_inbound": {
            "dynamic_variables": {"caller_memory": ""},
            "metadata": {"caller_memory_conversation": "retell:abc"},
        }
    }
    assert retell.InboundAnswer({}, None).body() == {"call_inbound": {"dynamic_variables": {}}}
    made = {retell.new_conversation_id() for _ in range(100)}
    assert len(made) == 100 and all(c.startswith("retell:") and len(c) == 31 for c in made)
