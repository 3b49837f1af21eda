"""The Twilio voice-webhook helper (``caller_memory.sdk.twilio``, SPEC section 15): its webhook validation
agrees with the ``twilio`` package's own ``RequestValidator`` (with and without ``StirVerstat`` and
``CallToken``, a SharedKey's HMAC-SHA256, the URL with and without its port, multi-valued parameters); the
TwiML it writes is the document ``VoiceResponse`` builds; the signed ``<Parameter>`` set is read back only
with the right secret, for the right call, while fresh; no phone number is in any parameter but the caller
one, or in the log."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import aiohttp
import pytest
from aiohttp import web
from caller_memory.sdk import twilio as cm_twilio
from caller_memory.sdk.twilio import (
    SECRET_ENV,
    StreamCaller,
    attestation_of,
    read_stream_parameters,
    stream_parameters,
    twiml,
    validate_webhook,
    webhook_signature,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from twilio.request_validator import RequestValidator, get_signature_algorithm
from twilio.twiml.voice_response import Connect, Parameter, Stream, VoiceResponse

from tests.conftest import TEST_NUMBERS

AUTH_TOKEN = "12345678901234567890123456789012"
SHARED_KEY = "sharedkey-secret-for-the-tests"
SECRET = "project-signing-secret-0123456789abcdef"
CALLER = "+14155550100"
URL = "https://voice.example.com/twilio/voice?shop=cheese"
CALL_SID = "CAa1b2c3d4e5f60718293a4b5c6d7e8f90"
NOW = 1_796_601_600.0  # 2026-12-07T00:00:00Z


def webhook(**extra: str) -> dict[str, str]:
    """An incoming call's voice-webhook parameters as Twilio posts them."""
    params = {
        "AccountSid": "ACfake0123456789abcdef0123456789ab",
        "ApiVersion": "2010-04-01",
        "CallSid": CALL_SID,
        "CallStatus": "ringing",
        "Called": "+14155550199",
        "Caller": CALLER,
        "Direction": "inbound",
        "From": CALLER,
        "FromCountry": "US",
        "To": "+14155550199",
    }
    return params | extra


STIR = {"StirVerstat": "TN-Validation-Passed-A"}
TOKEN = {"CallToken": '{"parentCallInfoToken":"eyJhbGciOiJFUzI1NiJ9.e30.c2ln","identityHeaderTokens":[]}'}


# The webhook's signature, cross-checked with twilio's RequestValidator ---------------------------------------


@pytest.mark.parametrize(
    "params",
    [webhook(), webhook(**STIR), webhook(**TOKEN), webhook(**STIR, **TOKEN), {}],
    ids=["plain", "stirverstat", "calltoken", "both", "no-parameters"],
)
def test_the_signature_is_the_one_twilios_validator_computes_with_and_without_stirverstat_and_calltoken(
    params: dict[str, str],
) -> None:
    theirs = RequestValidator(AUTH_TOKEN)
    signature = webhook_signature(URL, params, AUTH_TOKEN)
    assert signature == theirs.compute_signature(URL, params)
    assert validate_webhook(URL, params, signature, AUTH_TOKEN) is True
    assert theirs.validate(URL, params, signature) is True


def test_stirverstat_and_calltoken_are_signed_like_any_parameter() -> None:
    """A request signed without them that arrives with them (or the other way round) fails for both
    validators: the helper never drops a parameter to make a signature hold, so a StirVerstat added by
    anyone but Twilio is refused."""
    theirs = RequestValidator(AUTH_TOKEN)
    for added in (STIR, TOKEN, STIR | TOKEN):
        signed_without = webhook_signature(URL, webhook(), AUTH_TOKEN)
        signed_with = webhook_signature(URL, webhook(**added), AUTH_TOKEN)
        assert signed_without != signed_with
        for signature, params in ((signed_without, webhook(**added)), (signed_with, webhook())):
            assert theirs.validate(URL, params, signature) is False
            assert validate_webhook(URL, params, signature, AUTH_TOKEN) is False
    forged = webhook(StirVerstat="TN-Validation-Passed-A")
    signed_c = webhook_signature(URL, webhook(StirVerstat="TN-Validation-Passed-C"), AUTH_TOKEN)
    assert validate_webhook(URL, forged, signed_c, AUTH_TOKEN) is False
    assert theirs.validate(URL, forged, signed_c) is False


@pytest.mark.parametrize(
    ("signed_url", "received_url"),
    [
        ("https://voice.example.com/voice", "https://voice.example.com:443/voice"),
        ("https://voice.example.com:443/voice", "https://voice.example.com/voice"),
        ("http://voice.example.com:8080/voice?a=1&b=2", "http://voice.example.com:8080/voice?a=1&b=2"),
        ("https://voice.example.com/voice", "https://voice.example.com/other"),
        ("https://voice.example.com/voice", "http://voice.example.com/voice"),
        ("https://voice.example.com/voice?b=2&a=1", "https://voice.example.com/voice?a=1&b=2"),
    ],
)
def test_the_url_with_and_without_its_port_as_twilios_validator_takes_it(
    signed_url: str, received_url: str
) -> None:
    signature = webhook_signature(signed_url, webhook(**STIR), AUTH_TOKEN)
    expected = RequestValidator(AUTH_TOKEN).validate(received_url, webhook(**STIR), signature)
    assert validate_webhook(received_url, webhook(**STIR), signature, AUTH_TOKEN) is expected


@pytest.mark.parametrize(
    "settings_header",
    [None, "", "key=webhooks_sharedkey_1,algorithm=HMAC_SHA256", "algorithm=HMAC_SHA1", "algorithm=HMAC_MD5"],
)
def test_a_sharedkey_signature_and_its_settings_header(settings_header: str | None) -> None:
    algorithm = get_signature_algorithm(settings_header)
    theirs = RequestValidator(SHARED_KEY)
    if algorithm in ("HMAC_SHA1", "HMAC_SHA256"):
        signature = theirs.compute_signature(URL, webhook(**STIR), algorithm)
        assert webhook_signature(URL, webhook(**STIR), SHARED_KEY, algorithm=algorithm) == signature
        assert validate_webhook(URL, webhook(**STIR), signature, SHARED_KEY, settings_header=settings_header)
        other = "HMAC_SHA1" if algorithm == "HMAC_SHA256" else "HMAC_SHA256"
        wrong = theirs.compute_signature(URL, webhook(**STIR), other)
        assert not validate_webhook(URL, webhook(**STIR), wrong, SHARED_KEY, settings_header=settings_header)
    else:  # an algorithm neither knows: refused by both
        signature = webhook_signature(URL, webhook(), SHARED_KEY)
        with pytest.raises(ValueError, match="algorithm"):
            webhook_signature(URL, webhook(), SHARED_KEY, algorithm=algorithm)
        assert theirs.validate(URL, webhook(), signature, algorithm) is False
        assert (
            validate_webhook(URL, webhook(), signature, SHARED_KEY, settings_header=settings_header) is False
        )


class MultiDict(dict[str, list[str]]):
    """A framework's parsed form (aiohttp, Starlette and Werkzeug: ``getall``/``getlist``)."""

    def getall(self, name: str) -> list[str]:
        return self[name]


def test_a_parameter_sent_several_times_and_a_frameworks_multi_dict() -> None:
    form = MultiDict({"From": [CALLER], "Digits": ["2", "1", "2"], "CallSid": [CALL_SID]})
    signature = RequestValidator(AUTH_TOKEN).compute_signature(URL, form)
    assert webhook_signature(URL, form, AUTH_TOKEN) == signature
    assert validate_webhook(URL, form, signature, AUTH_TOKEN)
    assert validate_webhook(
        URL, {"From": CALLER, "Digits": ["1", "2"], "CallSid": CALL_SID}, signature, AUTH_TOKEN
    )


def test_a_wrong_token_or_a_missing_or_mangled_signature_is_refused() -> None:
    signature = webhook_signature(URL, webhook(**STIR), AUTH_TOKEN)
    assert not validate_webhook(URL, webhook(**STIR), signature, "another-auth-token-0123456789abcd")
    assert not validate_webhook(URL, webhook(**STIR), None, AUTH_TOKEN)
    assert not validate_webhook(URL, webhook(**STIR), "", AUTH_TOKEN)
    assert not validate_webhook(URL, webhook(**STIR), signature[:-2] + "é=", AUTH_TOKEN)
    assert not validate_webhook("https://[broken/voice", webhook(), signature, AUTH_TOKEN)


@settings(max_examples=200, deadline=None)
@given(
    params=st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=20), max_size=8),
    path=st.text(alphabet="abcxyz/-_.~", max_size=20),
)
def test_any_form_is_signed_as_twilios_validator_signs_it(params: dict[str, str], path: str) -> None:
    url = f"https://voice.example.com/{path}"
    theirs = RequestValidator(AUTH_TOKEN)
    signature = theirs.compute_signature(url, params)
    assert webhook_signature(url, params, AUTH_TOKEN) == signature
    assert validate_webhook(url, params, signature, AUTH_TOKEN) is theirs.validate(url, params, signature)


# The attestation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stir_verstat", "normalised"),
    [
        ("TN-Validation-Passed-A", "A"),
        ("TN-Validation-Passed-B", "B"),
        ("TN-Validation-Passed-C", "C"),
        ("TN-Validation-Passed-A-Diverted", "A"),
        ("tn-validation-passed-b", "B"),
        (" TN-Validation-Passed-C ", "C"),
        ("TN-Validation-Failed-A", "failed"),
        ("TN-Validation-Failed-B-Diverted", "failed"),
        ("TN-Validation-Failed", "failed"),
        ("No-TN-Validation", "unknown"),
        ("No-TN-Validation-Diverted", "unknown"),
        (None, "unknown"),
        ("", "unknown"),
        ("TN-Validation-Passed", "failed"),  # Telnyx's bare A: not a value Twilio writes
        ("TN-Validation-Passed-D", "failed"),
        ("A", "failed"),
        ("TN-Validation-Pa\u017fsed-A", "failed"),  # a long s is no s
        (1, "failed"),
    ],
)
def test_stirverstat_is_normalised(stir_verstat: Any, normalised: str) -> None:
    assert attestation_of(stir_verstat) == normalised


# The signed <Parameter>s ---------------------------------------------------------------------------------------


def test_the_parameters_carry_the_caller_the_attestation_the_time_and_the_signature_and_no_other_number() -> (
    None
):
    pairs = stream_parameters(webhook(**STIR, **TOKEN), secret=SECRET, now=NOW)
    names = [name for name, _ in pairs]
    assert names == ["from_number", "cm_attestation", "cm_time", "cm_sig"]
    values = dict(pairs)
    assert values["from_number"] == CALLER
    assert values["cm_attestation"] == "A"
    assert values["cm_time"] == "2026-12-07T00:00:00Z"
    for name, value in pairs:
        if name != "from_number":
            assert not TEST_NUMBERS.search(value), name
            assert CALLER[2:] not in value and "4155550199" not in value, name
    assert set(values["cm_sig"]) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert len(values["cm_sig"]) == 43  # 32 bytes, base64url without padding


def test_a_call_without_a_usable_number_gets_no_caller_parameter() -> None:
    for sender in ("anonymous", "client:alice", ""):
        pairs = stream_parameters(webhook(From=sender), secret=SECRET, now=NOW)
        assert [name for name, _ in pairs] == ["cm_attestation", "cm_time", "cm_sig"]
        read = read_stream_parameters(dict(pairs), CALL_SID, secret=SECRET, now=NOW)
        assert read == StreamCaller(None, "unknown", signed=True)
    # An outbound call: the caller memory is about the callee, named by the business.
    pairs = stream_parameters(webhook(From="+14155550199"), secret=SECRET, caller=CALLER, now=NOW)
    assert dict(pairs)["from_number"] == CALLER


def test_the_secret_comes_from_the_environment_and_must_be_long_enough(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        stream_parameters(webhook(), now=NOW)
    with pytest.raises(ValueError, match="at least 32"):
        stream_parameters(webhook(), secret="short", now=NOW)
    with pytest.raises(ValueError, match="CallSid"):
        stream_parameters({"From": CALLER}, secret=SECRET, now=NOW)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    from_environment = stream_parameters(webhook(**STIR), now=NOW)
    assert from_environment == stream_parameters(webhook(**STIR), secret=SECRET, now=NOW)
    assert read_stream_parameters(dict(from_environment), CALL_SID, now=NOW).signed


def test_the_signed_set_is_read_back_for_its_call_while_fresh() -> None:
    parameters = dict(stream_parameters(webhook(**STIR), secret=SECRET, now=NOW))
    assert read_stream_parameters(parameters, CALL_SID, secret=SECRET, now=NOW + 299) == StreamCaller(
        CALLER, "A", signed=True
    )
    assert read_stream_parameters(parameters, CALL_SID, secret=SECRET, now=NOW - 59).signed
    # The business's own parameters beside them are left alone (and are not signed).
    assert read_stream_parameters(parameters | {"plan": "gold"}, CALL_SID, secret=SECRET, now=NOW).signed


def refused(parameters: Any, call_sid: Any = CALL_SID, **options: Any) -> str:
    options.setdefault("secret", SECRET)
    options.setdefault("now", NOW)
    read = read_stream_parameters(parameters, call_sid, **options)
    assert read.number is None and read.attestation is None and read.signed is False
    assert read.refused is not None
    return read.refused


def test_a_forged_stale_or_borrowed_set_is_refused_and_gives_neither_caller_nor_attestation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    signed = dict(stream_parameters(webhook(StirVerstat="TN-Validation-Passed-C"), secret=SECRET, now=NOW))
    assert "stale" in refused(signed, now=NOW + 301)
    assert "future" in refused(signed, now=NOW - 61)
    assert "does not match" in refused(signed, "CAanother0000000000000000000000000")  # another call's set
    assert "does not match" in refused(signed | {"cm_attestation": "A"})  # C raised to A
    assert "does not match" in refused(signed | {"from_number": "+14155550123"})  # another caller
    assert "does not match" in refused(signed | {"cm_time": "2026-12-07T00:04:00Z"})  # made fresh again
    assert "does not match" in refused(signed, secret="another-secret-0123456789abcdefghijkl")
    assert "does not match" in refused(signed | {"cm_sig": "x" * 43})
    assert "does not match" in refused(signed | {"cm_sig": "é" * 43})
    assert "malformed" in refused(signed | {"cm_attestation": "TN-Validation-Passed-A"})
    assert "malformed" in refused(signed | {"from_number": 14155550100})
    assert "malformed" in refused(signed | {"cm_attestation": ["A"]})  # JSON can send any shape
    assert "cm_sig" in refused(signed | {"cm_sig": {"forged": True}})
    assert "cm_time" in refused(signed | {"cm_time": "1796601600"})
    assert "cm_time" in refused(signed | {"cm_time": "2026-13-45T00:00:00Z"})
    assert "callSid" in refused(signed, None)
    # With a secret, an unsigned set (the old TwiML, or anyone at the stream URL) is refused too.
    assert "no cm_sig" in refused({"from_number": CALLER, "StirVerstat": "TN-Validation-Passed-A"})
    assert "no cm_sig" in refused({})
    # A signed set reaching a bot that has no secret cannot be checked: refused.
    assert SECRET_ENV in refused(signed, secret=None)
    assert "no cm_sig" in refused(None)


def test_without_a_secret_unsigned_parameters_are_read_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    unsigned = {"from_number": CALLER, "StirVerstat": "TN-Validation-Passed-A"}
    assert read_stream_parameters(unsigned, CALL_SID) == StreamCaller(
        CALLER, "TN-Validation-Passed-A", signed=False
    )
    assert read_stream_parameters({}, CALL_SID) == StreamCaller(None, None, signed=False)
    assert read_stream_parameters(None, None) == StreamCaller(None, None, signed=False)


def test_a_refusal_is_logged_with_its_reason_and_never_a_value(caplog: pytest.LogCaptureFixture) -> None:
    signed = dict(stream_parameters(webhook(**STIR), secret=SECRET, now=NOW))
    with caplog.at_level(logging.DEBUG, logger="caller_memory.sdk.twilio"):
        refused(signed | {"from_number": "+14155550123"})
        refused({"from_number": CALLER})
        refused(signed, now=time.time())
    assert len(caplog.records) == 3
    for record in caplog.records:
        text = record.getMessage()
        assert record.levelno == logging.WARNING and "refused" in text
        assert not TEST_NUMBERS.search(text) and signed["cm_sig"] not in text


# The TwiML ---------------------------------------------------------------------------------------------------


def tree(document: str) -> list[tuple[str, dict[str, str]]]:
    return [(element.tag, dict(element.attrib)) for element in ElementTree.fromstring(document).iter()]


def test_the_twiml_is_the_document_twilios_voiceresponse_builds() -> None:
    pairs = [*stream_parameters(webhook(**STIR), secret=SECRET, now=NOW), ("note", 'a "quoted" <b> & c')]
    ours = twiml("wss://bot.example.com/ws?x=1&y=2", pairs)
    response, connect = VoiceResponse(), Connect()
    stream = Stream(url="wss://bot.example.com/ws?x=1&y=2")
    for name, value in pairs:
        stream.append(Parameter(name=name, value=value))
    connect.append(stream)
    response.append(connect)
    assert tree(ours) == tree(response.to_xml())
    assert ours.startswith('<?xml version="1.0" encoding="UTF-8"?><Response><Connect><Stream ')


def test_the_conversationrelay_twiml_is_the_document_twilios_voiceresponse_builds() -> None:
    pairs = stream_parameters(webhook(**STIR), secret=SECRET, now=NOW)
    ours = twiml("wss://bot.example.com/relay", pairs, relay=True, welcomeGreeting="Hello!")
    response = VoiceResponse()
    relay = response.connect().conversation_relay(
        url="wss://bot.example.com/relay", welcome_greeting="Hello!"
    )
    for name, value in pairs:
        relay.parameter(name=name, value=value)
    assert tree(ours) == tree(str(response))


def test_the_module_needs_no_twilio_package() -> None:
    source = cm_twilio.__file__
    assert source is not None
    with open(source) as module:
        text = module.read()
    assert "import twilio" not in text and "from twilio" not in text


# docs/twilio.md's webhook, run as written ------------------------------------------------------------------------


def the_documented_webhook() -> str:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "twilio.md").read_text()
    section = doc.split("## The voice webhook\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0]


async def test_the_documented_webhook_answers_twilios_request_with_signed_parameters_and_refuses_a_forgery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", AUTH_TOKEN)
    monkeypatch.setenv("BOT_STREAM_URL", "wss://bot.example.com/ws")
    namespace: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        runner: web.AppRunner | None = None
        try:
            # The URL Twilio is configured with: the test server's, once it has a port.
            monkeypatch.setenv("TWILIO_VOICE_URL", "http://127.0.0.1/twilio/voice")
            exec(compile(the_documented_webhook(), "docs/twilio.md", "exec"), namespace)
            runner = web.AppRunner(namespace["app"], access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/twilio/voice"
            namespace["VOICE_URL"] = url  # as if TWILIO_VOICE_URL had named the port
            form = webhook(**STIR, **TOKEN)
            signature = RequestValidator(AUTH_TOKEN).compute_signature(url, form)
            async with session.post(url, data=form, headers={"X-Twilio-Signature": signature}) as reply:
                assert reply.status == 200 and reply.content_type == "application/xml"
                document = await reply.text()
            stream = ElementTree.fromstring(document).find("./Connect/Stream")
            assert stream is not None and stream.attrib["url"] == "wss://bot.example.com/ws"
            parameters = {p.attrib["name"]: p.attrib["value"] for p in stream.findall("Parameter")}
            assert read_stream_parameters(parameters, CALL_SID) == StreamCaller(CALLER, "A", signed=True)
            # The same request with StirVerstat raised from C to A after Twilio signed it: 403.
            signed_c = RequestValidator(AUTH_TOKEN).compute_signature(
                url, webhook(StirVerstat="TN-Validation-Passed-C")
            )
            forged = webhook(StirVerstat="TN-Validation-Passed-A")
            async with session.post(url, data=forged, headers={"X-Twilio-Signature": signed_c}) as reply:
                assert reply.status == 403
            async with session.post(url, data=form) as reply:  # no signature at all
                assert reply.status == 403
        finally:
            if runner is not None:
                await runner.cleanup()
