"""The hosted platforms' hooks in tests/http/test_openapi.py's walkthrough. Agora's notifications, Vapi's server
messages, Retell's inbound webhook and call events and ElevenLabs' post-call webhooks carry no bearer token (the
platform signs each with the connection's secret; Vapi in bearer mode takes a platform token instead), so their
answers are provoked here rather than by the shared answers' loop. ElevenLabs' initiation takes a platform
token: the loop checks its shared answers, and its own outcomes are provoked here.

Each is signed exactly as its adapter verifies (service/platforms/<platform>.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import io
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

BASE = "/v1/projects/{project}/platforms"
AGORA = BASE + "/agora/notifications"
VAPI = BASE + "/vapi/events"
RETELL_INBOUND = BASE + "/retell/inbound"
RETELL_EVENTS = BASE + "/retell/events"
ELEVENLABS_INITIATION = BASE + "/elevenlabs/initiation"
ELEVENLABS_EVENTS = BASE + "/elevenlabs/events"
TELNYX_VARIABLES = BASE + "/telnyx/variables"
TELNYX_EVENTS = BASE + "/telnyx/events"
#: The hooks signed by the platform, with no bearer token: documented with no security (PUBLIC). Vapi's with
#: `auth: bearer` takes a platform token instead, which its description says.
SIGNED = (AGORA, VAPI, RETELL_INBOUND, RETELL_EVENTS, ELEVENLABS_EVENTS, TELNYX_VARIABLES, TELNYX_EVENTS)
#: The call starts among them: past the project's share they answer without memory (200), never 429.
STARTS = (RETELL_INBOUND, TELNYX_VARIABLES)
CONNECTION = BASE + "/{platform}"
TOKENS = "/v1/projects/{project}/tokens"
SECRET = "openapi-platform-secret"
CALLER = "+14155550100"
#: Each hook's own outcomes, which the walkthrough reaches (their 408, 429 and 503: :func:`refused` and
#: :func:`slow`; ElevenLabs' initiation's shared answers: test_openapi.py's check_shared_answers).
_SIGNED_OWN = {"200", "400", "401", "404", "413", "415", "422"}
OWN: dict[str, set[str]] = {
    "agora_notifications": _SIGNED_OWN,
    "vapi_events": _SIGNED_OWN | {"403"},
    "retell_inbound": _SIGNED_OWN,
    "retell_events": _SIGNED_OWN,
    "elevenlabs_initiation": {"200", "404", "422"},
    "elevenlabs_events": _SIGNED_OWN,
    "telnyx_variables": _SIGNED_OWN,
    "telnyx_events": _SIGNED_OWN,
}

Signer = Callable[[bytes, str], dict[str, str]]


class Check(Protocol):
    async def __call__(
        self, method: str, template: str, path: str, status: int, *, token: str | None = ..., **kw: Any
    ) -> Any: ...


def concrete(template: str, project: str = "shop") -> str:
    return template.replace("{project}", project)


def _bytes(document: Any) -> bytes:
    return document if isinstance(document, bytes) else orjson.dumps(document)


def _hex(secret: str, signed: bytes) -> str:
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def signed(document: Any, sign: Signer, secret: str = SECRET) -> dict[str, Any]:
    """The request's body and headers, ``document`` signed by ``sign`` with ``secret``."""
    body = _bytes(document)
    return {"data": body, "headers": {"Content-Type": "application/json", **sign(body, secret)}}


def agora(_: int) -> Signer:
    """``Agora-Signature-V2``: the hex HMAC-SHA256 of the body."""
    return lambda body, secret: {"Agora-Signature-V2": _hex(secret, body)}


def vapi(at_ms: int) -> Signer:
    """``x-signature``: the hex HMAC-SHA256 of ``{x-timestamp}.{body}`` (here in milliseconds)."""
    stamp = str(at_ms)
    return lambda body, secret: {
        "x-timestamp": stamp,
        "x-signature": _hex(secret, stamp.encode() + b"." + body),
    }


def retell(at_ms: int) -> Signer:
    """``x-retell-signature: v=<unix ms>,d=<hex HMAC-SHA256 of the body followed by v>``."""
    stamp = str(at_ms)
    return lambda body, secret: {"x-retell-signature": f"v={stamp},d={_hex(secret, body + stamp.encode())}"}


def elevenlabs(at_ms: int) -> Signer:
    """``ElevenLabs-Signature: t=<unix s>,v0=<hex HMAC-SHA256 of '<t>.<body>'>``."""
    stamp = str(at_ms // 1000)
    return lambda body, secret: {
        "ElevenLabs-Signature": f"t={stamp},v0={_hex(secret, stamp.encode() + b'.' + body)}"
    }


def _ed25519(secret: str) -> Ed25519PrivateKey:
    """The Ed25519 key a "secret" names here (Telnyx signs with a key pair: the connection holds the public
    half)."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(secret.encode()).digest())


def telnyx_public_key(secret: str = SECRET) -> str:
    raw = _ed25519(secret).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def telnyx(at_ms: int) -> Signer:
    """``telnyx-signature-ed25519``: the base64 Ed25519 signature of ``<telnyx-timestamp>|<body>``."""
    stamp = str(at_ms // 1000)

    def sign(body: bytes, secret: str) -> dict[str, str]:
        signature = _ed25519(secret).sign(stamp.encode() + b"|" + body)
        return {"telnyx-timestamp": stamp, "telnyx-signature-ed25519": base64.b64encode(signature).decode()}

    return sign


async def _refusals(
    check: Check,
    template: str,
    sign: Signer,
    *,
    connection: dict[str, Any],
    good: Any,
    malformed: Any,
    platform_max_body: int,
) -> None:
    """No project, no connection (404), then one made: unsigned and forged (401), a signed body that is not
    JSON (400) or not what the platform sends (422), too large (413), not JSON's media type (415)."""
    path = concrete(template)
    platform = template.split("/")[-2]
    await check("POST", template, concrete(template, "nope"), 404, token=None, **signed(good, sign))
    await check("POST", template, path, 404, token=None, **signed(good, sign))
    await check("PUT", CONNECTION, f"/v1/projects/shop/platforms/{platform}", 201, json=connection)
    await check("POST", template, path, 401, token=None, json=good)
    await check("POST", template, path, 401, token=None, **signed(good, sign, "another-secret"))
    await check("POST", template, path, 400, token=None, **signed(b"{", sign))
    await check("POST", template, path, 422, token=None, **signed(malformed, sign))
    big = b'{"x": "' + b"y" * platform_max_body + b'"}'
    headers = {"Content-Type": "application/json"}
    await check("POST", template, path, 413, token=None, data=io.BytesIO(big), headers=headers)
    await check("POST", template, path, 415, token=None, data=b"{}", headers={"Content-Type": "text/plain"})


async def walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """Every platform hook to its own outcomes (the project ``shop`` exists, with conversation memory on)."""
    await agora_walkthrough(check, now_ms, platform_max_body)
    await vapi_walkthrough(check, now_ms, platform_max_body)
    await retell_walkthrough(check, now_ms, platform_max_body)
    await elevenlabs_walkthrough(check, now_ms, platform_max_body)
    await telnyx_walkthrough(check, now_ms, platform_max_body)


def notice(event_type: int, now_ms: int, **payload: Any) -> dict[str, Any]:
    return {
        "noticeId": f"n-{event_type}-{now_ms}",
        "productId": 17,
        "eventType": event_type,
        "notifyMs": now_ms,
        "payload": payload,
    }


async def agora_walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """The refusals, then a notice Caller Memory does not use and an agent-left naming a conversation (200)."""
    sign = agora(now_ms)
    await _refusals(
        check,
        AGORA,
        sign,
        connection={"secret": SECRET},
        good=notice(101, now_ms),
        malformed={"eventType": 102},
        platform_max_body=platform_max_body,
    )
    path = concrete(AGORA)
    await check("POST", AGORA, path, 200, token=None, **signed(notice(111, now_ms), sign))
    left = notice(102, now_ms, status="STOPPED", message="OK", labels={"caller_memory_conversation": "c-1"})
    await check("POST", AGORA, path, 200, token=None, **signed(left, sign))


def vapi_message(kind: str, **fields: Any) -> dict[str, Any]:
    call = {"id": "vapi-openapi-1", "customer": {"number": CALLER}}
    return {"message": {"type": kind, "call": call, **fields}}


async def vapi_walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """With ``auth: hmac``: the refusals, a stale ``x-timestamp`` and a replay (401); the call's start (the
    assistant), its status-update (held), its report (ended) and a message Caller Memory does not use (200).
    Then with ``auth: bearer``: no token (401), a token of another role (403), a platform token (200)."""
    sign = vapi(now_ms)
    start = vapi_message("assistant-request")
    await _refusals(
        check,
        VAPI,
        sign,
        connection={"secret": SECRET, "options": {"auth": "hmac", "assistant_id": "asst-openapi"}},
        good=start,
        malformed={"message": {"call": {}}},
        platform_max_body=platform_max_body,
    )
    path = concrete(VAPI)
    await check("POST", VAPI, path, 401, token=None, **signed(start, vapi(now_ms - 6 * 60_000)))
    answer = await check("POST", VAPI, path, 200, token=None, **signed(start, sign))
    assert answer["assistantId"] == "asst-openapi", answer
    await check("POST", VAPI, path, 401, token=None, **signed(start, sign))  # the same signature: a replay
    ended = vapi_message("status-update", status="ended", endedReason="customer-ended-call")
    assert (await check("POST", VAPI, path, 200, token=None, **signed(ended, sign)))["outcome"] == "held"
    report = vapi_message(
        "end-of-call-report",
        endedReason="customer-ended-call",
        artifact={"messages": [{"role": "user", "message": "Hello"}, {"role": "bot", "message": "Hi."}]},
        analysis={"summary": "Said hello."},
    )
    assert (await check("POST", VAPI, path, 200, token=None, **signed(report, sign)))["outcome"] == "ended"
    other = vapi_message("speech-update", status="started", role="user")
    assert (await check("POST", VAPI, path, 200, token=None, **signed(other, sign)))["outcome"] == "ignored"

    bearer = {"options": {"auth": "bearer", "assistant_id": "asst-openapi"}}
    await check("PUT", CONNECTION, "/v1/projects/shop/platforms/vapi", 200, json=bearer)
    agent = await check("POST", TOKENS, concrete(TOKENS), 201, json={"role": "agent"})
    platform = await check("POST", TOKENS, concrete(TOKENS), 201, json={"role": "platform"})
    again = vapi_message("assistant-request", call={"id": "vapi-openapi-2", "customer": {"number": CALLER}})
    await check("POST", VAPI, path, 401, token=None, json=again)
    await check("POST", VAPI, path, 403, token=agent["token"], json=again)
    await check("POST", VAPI, path, 403, json=again)  # the operator's token is not a platform token either
    answer = await check("POST", VAPI, path, 200, token=platform["token"], json=again)
    assert answer["assistantId"] == "asst-openapi", answer


def retell_call(**fields: Any) -> dict[str, Any]:
    return {
        "call_id": "retell-openapi-1",
        "direction": "inbound",
        "from_number": CALLER,
        "to_number": "+14155550123",
        **fields,
    }


async def retell_walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """The inbound webhook: the refusals, then the call's memory (200), and the same delivery again (200,
    without memory). The call events: the refusals, then call_started (ignored), call_ended (held), the same
    again (duplicate), call_analyzed (ended)."""
    sign = retell(now_ms)
    inbound = {"event": "call_inbound", "call_inbound": {"from_number": CALLER, "to_number": "+14155550123"}}
    connection = {"secret": SECRET}
    await _refusals(
        check,
        RETELL_INBOUND,
        sign,
        connection=connection,
        good=inbound,
        malformed={"event": "call_started"},
        platform_max_body=platform_max_body,
    )
    path = concrete(RETELL_INBOUND)
    answer = await check("POST", RETELL_INBOUND, path, 200, token=None, **signed(inbound, sign))
    conversation = answer["call_inbound"]["metadata"]["caller_memory_conversation"]
    answer = await check("POST", RETELL_INBOUND, path, 200, token=None, **signed(inbound, sign))
    assert "metadata" not in answer["call_inbound"], answer  # a delivery seen before: no memory, no start

    await check("DELETE", CONNECTION, "/v1/projects/shop/platforms/retell", 204)
    metadata = {"caller_memory_conversation": conversation}
    said = [{"role": "user", "content": "Hello"}, {"role": "agent", "content": "Hi."}]
    ended = {"event": "call_ended", "call": retell_call(metadata=metadata, transcript_object=said)}
    await _refusals(
        check,
        RETELL_EVENTS,
        sign,
        connection=connection,
        good=ended,
        malformed={"event": "call_ended"},
        platform_max_body=platform_max_body,
    )
    path = concrete(RETELL_EVENTS)

    async def outcome(event: dict[str, Any]) -> str:
        answer = await check("POST", RETELL_EVENTS, path, 200, token=None, **signed(event, sign))
        return str(answer["outcome"])

    assert await outcome({"event": "call_started", "call": retell_call(metadata=metadata)}) == "ignored"
    assert await outcome(ended) == "held"
    assert await outcome(ended) == "duplicate"
    analysis = {"call_summary": "Said hello.", "call_successful": True}
    analyzed = {"event": "call_analyzed", "call": retell_call(metadata=metadata, call_analysis=analysis)}
    assert await outcome(analyzed) == "ended"


async def elevenlabs_walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """The initiation: no connection (404), a body that is not an initiation request (422), the call's memory
    for a platform token (200). The post-call webhooks: the refusals, then the call's transcription (ended),
    the same delivered again (401), the audio (ignored)."""
    initiation = {"caller_id": CALLER, "agent_id": "agent-openapi", "called_number": "+14155550123"}
    path = concrete(ELEVENLABS_INITIATION)
    await check("POST", ELEVENLABS_INITIATION, path, 404, json=initiation)
    connection = {"secret": SECRET, "options": {"agent_variables": ["store_hours"]}}
    await check("PUT", CONNECTION, "/v1/projects/shop/platforms/elevenlabs", 201, json=connection)
    await check("POST", ELEVENLABS_INITIATION, path, 422, json=[initiation])
    platform = await check("POST", TOKENS, concrete(TOKENS), 201, json={"role": "platform"})
    answer = await check("POST", ELEVENLABS_INITIATION, path, 200, token=platform["token"], json=initiation)
    assert answer["dynamic_variables"]["store_hours"] == "", answer
    conversation = answer["custom_llm_extra_body"]["caller_memory_conversation"]

    await check("DELETE", CONNECTION, "/v1/projects/shop/platforms/elevenlabs", 204)
    sign = elevenlabs(now_ms)
    data = {
        "conversation_id": "el-openapi-1",
        "status": "done",
        "transcript": [{"role": "user", "message": "Hello"}, {"role": "agent", "message": "Hi."}],
        "metadata": {"phone_call": {"external_number": CALLER}},
        "analysis": {"transcript_summary": "Said hello."},
        "conversation_initiation_client_data": {
            "dynamic_variables": {"caller_memory_conversation": conversation}
        },
    }
    transcription = {"type": "post_call_transcription", "event_timestamp": now_ms // 1000, "data": data}
    await _refusals(
        check,
        ELEVENLABS_EVENTS,
        sign,
        connection=connection,
        good=transcription,
        malformed={"data": {}},
        platform_max_body=platform_max_body,
    )
    path = concrete(ELEVENLABS_EVENTS)
    answer = await check("POST", ELEVENLABS_EVENTS, path, 200, token=None, **signed(transcription, sign))
    assert answer["outcome"] == "ended" and answer["conversation_id"] == conversation, answer
    await check("POST", ELEVENLABS_EVENTS, path, 401, token=None, **signed(transcription, sign))  # again
    audio = {"type": "post_call_audio", "data": {"conversation_id": "el-openapi-1", "full_audio": "AAAA"}}
    answer = await check("POST", ELEVENLABS_EVENTS, path, 200, token=None, **signed(audio, sign))
    assert answer["outcome"] == "ignored", answer


def telnyx_event(kind: str, event_id: str, **payload: Any) -> dict[str, Any]:
    ids = {"call_control_id": "v3:openapi-leg", "call_session_id": "0ccc7b54-4df3-4bca-a65a-3da1ecc777f0"}
    return {
        "data": {
            "record_type": "event",
            "id": event_id,
            "event_type": kind,
            "occurred_at": "2026-12-07T10:00:00Z",
            "payload": ids | payload,
        }
    }


async def telnyx_walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """The variables webhook: the refusals, a stale timestamp (401), then the call's memory (200), and the
    same delivery again (200, without memory). The call events: the refusals, then call.initiated
    (attested), the conversation's end (held), the same again (duplicate), the insights (ended), another
    event (ignored)."""
    sign = telnyx(now_ms)
    connection = {"options": {"public_key": telnyx_public_key()}}
    variables = telnyx_event(
        "assistant.initialization",
        "openapi-init-1",
        telnyx_end_user_target=CALLER,
        telnyx_end_user_target_verified=True,
    )
    await _refusals(
        check,
        TELNYX_VARIABLES,
        sign,
        connection=connection,
        good=variables,
        malformed={"data": {"payload": {}}},
        platform_max_body=platform_max_body,
    )
    path = concrete(TELNYX_VARIABLES)
    await check(
        "POST", TELNYX_VARIABLES, path, 401, token=None, **signed(variables, telnyx(now_ms - 6 * 60_000))
    )
    answer = await check("POST", TELNYX_VARIABLES, path, 200, token=None, **signed(variables, sign))
    assert set(answer) == {"dynamic_variables"}, answer
    await check("POST", TELNYX_VARIABLES, path, 200, token=None, **signed(variables, sign))  # seen before

    await check("DELETE", CONNECTION, "/v1/projects/shop/platforms/telnyx", 204)
    said = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]
    ended = telnyx_event("call.conversation.ended", "openapi-ended-1", messages=said, **{"from": CALLER})
    await _refusals(
        check,
        TELNYX_EVENTS,
        sign,
        connection=connection,
        good=ended,
        malformed={"data": {"id": "x"}},
        platform_max_body=platform_max_body,
    )
    path = concrete(TELNYX_EVENTS)

    async def outcome(event: dict[str, Any]) -> str:
        answer = await check("POST", TELNYX_EVENTS, path, 200, token=None, **signed(event, sign))
        return str(answer["outcome"])

    initiated = telnyx_event(
        "call.initiated",
        "openapi-initiated-1",
        direction="incoming",
        shaken_stir_attestation="A",
        shaken_stir_validated=True,
    )
    assert await outcome(initiated) == "attested"
    assert await outcome(ended) == "held"
    assert await outcome(ended) == "duplicate"
    insights = telnyx_event(
        "call.conversation_insights.generated",
        "openapi-insights-1",
        results=[{"insight_id": "i-1", "result": "ok"}],
    )
    assert await outcome(insights) == "ended"
    assert await outcome(telnyx_event("call.answered", "openapi-answered-1")) == "ignored"


async def refused(check: Check, status: int) -> None:
    """503 on every signed hook while the service has its limit of requests in flight (refused before the
    route runs); 429 while the project holds its share, on the hooks that carry a call's end (a call start
    past the share is answered without memory instead: tests/platforms/test_platform_share.py). The project
    here does not exist (its PUT is the request holding the slot): Vapi's hook refuses a body that is not a
    call start (``{}`` here) before it reads the project."""
    for template in SIGNED:
        if status == 429 and template in STARTS:
            continue
        await check("POST", template, concrete(template), status, token=None, json={})


async def slow(check: Check, stalled: Any) -> None:
    """408 on every signed hook for a body that does not arrive (each reads its body first)."""
    for template in SIGNED:
        never = asyncio.Event()
        headers = {"Content-Type": "application/json"}
        await check(
            "POST", template, concrete(template), 408, token=None, data=stalled(never), headers=headers
        )
