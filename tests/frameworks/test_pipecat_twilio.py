"""Twilio's signed stream parameters end to end (SPEC section 15, issue 33): the business's voice webhook,
validated as Twilio signs it, writes TwiML whose ``<Parameter>``s carry the caller, the attestation and
``cm_sig`` (``caller_memory.sdk.twilio``); a fake Twilio media stream sends them as the ``start`` message's
``customParameters`` over a real websocket to a Pipecat bot (uvicorn, FastAPI, Pipecat's Twilio serializer);
the bot reads them with ``twilio_caller(call_data)`` and the real service (SQLite) answers its reads. An
A-attested call gets its sensitive field; a forged, stale, borrowed or unsigned ``start`` gets no caller and
no attestation, so nothing is read at all. Every log line is checked for the numbers.

No ``twilio`` package here (these tests also run at the low end of Pipecat's range, without it): the webhook's
signature is made by the helper itself, cross-checked with Twilio's validator in tests/sdk/test_twilio.py."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest
import uvicorn
import websockets
from caller_memory.sdk import MemoryClient
from caller_memory.sdk.pipecat import CallerMemory, install_log_redaction, twilio_caller
from caller_memory.sdk.render import PREAMBLE
from caller_memory.sdk.twilio import SECRET_ENV, stream_parameters, twiml, validate_webhook, webhook_signature
from fastapi import FastAPI, WebSocket
from pipecat.frames.frames import LLMRunFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.runner.utils import parse_telephony_websocket
from pipecat.serializers.twilio import TwilioFrameSerializer
from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport
from pipecat.workers.runner import WorkerRunner

from tests.conftest import OPERATOR_TOKEN, TEST_NUMBERS, Api
from tests.frameworks import conftest_pipecat
from tests.frameworks.conftest_pipecat import Call, Paced, aggregators, make_context, make_llm
from tests.support.fake_llm import FakeLLM

every_log_line = conftest_pipecat.every_log_line
stop_calls = conftest_pipecat.stop_calls

PROJECT = "cheese-shop"
CALLER = "+14155550100"
SECRET = "the-shops-twilio-signing-secret-0123456789"
AUTH_TOKEN = "twilio-auth-token-0123456789abcdef"
WEBHOOK_URL = "https://shop.example.com/twilio/voice"


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/memory.db"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    """A project whose ``verified`` field is sensitive and needs an A-attested call; the caller known."""
    reply = await api.call(
        "PUT",
        f"/v1/projects/{PROJECT}",
        token=OPERATOR_TOKEN,
        json={
            "memory": {
                "repeat_caller": {
                    "state_keys": ["caller_name", "verified"],
                    "default_region": "US",
                    "analytics_enabled": True,
                    "field_classes": {"verified": "sensitive"},
                    "trust": {"sensitive": "A"},
                },
                "conversation": {"enabled": True},
            }
        },
    )
    assert reply.status in (200, 201), reply.body
    tokens = {role: await api.mint(PROJECT, role) for role in ("agent", "admin")}
    reply = await api.call(
        "PATCH",
        f"/v1/projects/{PROJECT}/callers/{CALLER}/memory",
        token=tokens["admin"],
        json={"caller_name": "Ada", "verified": "yes"},
    )
    assert reply.status == 200, reply.body
    return tokens


@pytest.fixture
async def llm() -> AsyncIterator[FakeLLM]:
    async with FakeLLM() as fake:
        yield fake


def voice_webhook(
    call_sid: str, stir_verstat: str | None, *, secret: str = SECRET, now: float | None = None
) -> str:
    """The business's voice webhook: Twilio's request (signed as Twilio signs it), validated, answered with
    the TwiML that connects the call to the bot with the signed parameters."""
    form = {"CallSid": call_sid, "AccountSid": "ACfake", "From": CALLER, "To": "+14155550199"}
    if stir_verstat is not None:
        form["StirVerstat"] = stir_verstat
    signature = webhook_signature(WEBHOOK_URL, form, AUTH_TOKEN)  # what Twilio puts in X-Twilio-Signature
    assert validate_webhook(WEBHOOK_URL, form, signature, AUTH_TOKEN)
    return twiml("wss://bot.example.com/ws", stream_parameters(form, secret=secret, now=now))


def custom_parameters(document: str) -> dict[str, str]:
    """What Twilio sends as the ``start`` message's ``customParameters``: the TwiML's <Parameter>s."""
    stream = ElementTree.fromstring(document).find("./Connect/Stream")
    assert stream is not None
    return {p.attrib["name"]: p.attrib["value"] for p in stream.findall("Parameter")}


async def fake_twilio_call(url: str, call_sid: str, parameters: dict[str, str], bots: dict[str, Any]) -> str:
    """A Twilio media stream (``connected``, ``start``, mu-law ``media``); the greeting; the caller hangs up."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        start = {
            "accountSid": "ACfake",
            "streamSid": f"MZ{call_sid}",
            "callSid": call_sid,
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": parameters,
        }
        await ws.send(
            json.dumps(
                {"event": "start", "sequenceNumber": "1", "streamSid": f"MZ{call_sid}", "start": start}
            )
        )
        silence = base64.b64encode(b"\xff" * 160).decode()
        media = {"track": "inbound", "chunk": "1", "timestamp": "0", "payload": silence}
        await ws.send(json.dumps({"event": "media", "streamSid": f"MZ{call_sid}", "media": media}))
        call: Call = await asyncio.wait_for(bots[call_sid], 10)
        greeting = await call.reply()
        stop = {
            "event": "stop",
            "sequenceNumber": "9",
            "streamSid": f"MZ{call_sid}",
            "stop": {"callSid": call_sid},
        }
        await ws.send(json.dumps(stop))
    return greeting


async def test_signed_parameters_give_the_attested_caller_and_a_forged_stale_or_unsigned_start_nothing(
    api: Api,
    shop: dict[str, str],
    llm: FakeLLM,
    tmp_path: Path,
    every_log_line: list[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the bot's and the webhook's secret, as both read it
    logging.getLogger("websockets.client").setLevel(logging.INFO)  # the test client's own frames
    bots: dict[str, asyncio.Future[Call]] = {}
    results: dict[str, asyncio.Future[Any]] = {}
    read: dict[str, Any] = {}

    async with MemoryClient(
        api.base_url,
        token=shop["agent"],
        project=PROJECT,
        outbox_path=tmp_path / "outbox.db",
        read_budget=2.0,
    ) as client:
        install_log_redaction()
        app = FastAPI()

        @app.websocket("/ws")
        async def media_stream(websocket: WebSocket) -> None:  # the bot, as docs/twilio.md writes it
            await websocket.accept()
            _, call_data = await parse_telephony_websocket(websocket)
            serializer = TwilioFrameSerializer(  # the caller hangs up: no REST hang-up, no credentials
                stream_sid=call_data.stream_id or "",
                call_sid=call_data.call_id,
                params=TwilioFrameSerializer.InputParams(auto_hang_up=False),
            )
            transport = FastAPIWebsocketTransport(
                websocket,
                FastAPIWebsocketParams(
                    audio_in_enabled=True, audio_out_enabled=True, add_wav_header=False, serializer=serializer
                ),
            )
            caller = read[call_data.call_id or ""] = twilio_caller(call_data)
            memory = CallerMemory(client, call_data.call_id, caller.number, attestation=caller.attestation)
            llm_service = make_llm(llm.base_url)
            context = make_context(memory)
            pair = aggregators(context)
            pipeline = Pipeline(
                [
                    transport.input(),
                    pair.user(),
                    memory,
                    llm_service,
                    Paced(0),
                    transport.output(),
                    pair.assistant(),
                ]
            )
            worker = PipelineWorker(
                pipeline,
                enable_rtvi=False,
                idle_timeout_secs=None,
                params=PipelineParams(audio_in_sample_rate=8000, audio_out_sample_rate=8000),
            )
            call = Call(memory, llm_service, context, worker)

            @pair.assistant().event_handler("on_assistant_turn_stopped")
            async def said(aggregator: Any, message: Any) -> None:
                if message.content:
                    await call.replies.put((message.content, message.interrupted))

            @transport.event_handler("on_client_connected")
            async def connected(transport: Any, websocket: Any) -> None:
                await worker.queue_frame(LLMRunFrame())

            @transport.event_handler("on_client_disconnected")
            async def gone(transport: Any, websocket: Any) -> None:
                await worker.cancel(reason="the caller hung up")

            runner = WorkerRunner(handle_sigint=False)
            await runner.add_workers(worker)
            bots[call_data.call_id or ""].set_result(call)
            await runner.run()
            await llm_service._client.close()
            results[call_data.call_id or ""].set_result(await memory.finished())

        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="debug", lifespan="off", log_config=None)
        )
        serving = asyncio.create_task(server.serve())
        attested = custom_parameters(voice_webhook("CA0001", "TN-Validation-Passed-A"))
        starts = {
            "CA0001": attested,
            # Anyone at the stream URL: the parameters of the days before signing, claiming A.
            "CA0002": {"from_number": CALLER, "StirVerstat": "TN-Validation-Passed-A"},
            # Signed with another secret, or for a C call and raised to A, or ten minutes old.
            "CA0003": custom_parameters(voice_webhook("CA0003", "TN-Validation-Passed-A", secret="x" * 40)),
            "CA0004": custom_parameters(voice_webhook("CA0004", "TN-Validation-Passed-C"))
            | {"cm_attestation": "A"},
            "CA0005": custom_parameters(
                voice_webhook("CA0005", "TN-Validation-Passed-A", now=time.time() - 600)
            ),
            # The first call's set, copied into another call's stream.
            "CA0006": attested,
        }
        replies: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        try:
            while not server.started:  # noqa: ASYNC110 (uvicorn has no event for it)
                await asyncio.sleep(0.01)
            url = f"ws://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/ws"
            loop = asyncio.get_running_loop()
            with caplog.at_level(logging.WARNING, logger="caller_memory.sdk.twilio"):
                for sid, parameters in starts.items():
                    bots[sid], results[sid] = loop.create_future(), loop.create_future()
                    seen = len(llm.requests)
                    greeting = await fake_twilio_call(url, sid, parameters, bots)
                    await asyncio.wait_for(asyncio.shield(results[sid]), 10)
                    replies[sid] = (greeting, llm.requests[seen:])
        finally:
            server.should_exit = True
            await serving

    # The attested call: the caller, A, and the sensitive field in the memory the model was given.
    assert read["CA0001"].signed and read["CA0001"].attestation == "A"
    greeting, requests = replies["CA0001"]
    assert greeting == "Welcome back, Ada!"
    [memory_message] = [m["content"] for m in requests[0]["messages"] if m["content"].startswith(PREAMBLE)]
    assert '"caller_name":"Ada"' in memory_message and '"verified":"yes"' in memory_message
    conv = bots["CA0001"].result().memory.conv
    assert conv is not None and conv.memory.attestation == "A" and conv.memory.withheld == ()
    # Every other start: refused, so no caller and no attestation; the call goes on with no memory at all.
    for sid in ("CA0002", "CA0003", "CA0004", "CA0005", "CA0006"):
        assert read[sid].number is None and read[sid].attestation is None and read[sid].refused, sid
        greeting, requests = replies[sid]
        assert greeting == "Hello! What's your name?", sid
        sent = json.dumps([r["messages"] for r in requests])
        assert "Ada" not in sent and "verified" not in sent, sid
        assert bots[sid].result().memory.conv is None and results[sid].result() is None, sid
    reasons = {sid: read[sid].refused for sid in read}
    assert "no cm_sig" in reasons["CA0002"] and "stale" in reasons["CA0005"]
    for sid in ("CA0003", "CA0004", "CA0006"):
        assert "does not match" in reasons[sid]
    refusals = [r.getMessage() for r in caplog.records if r.name == "caller_memory.sdk.twilio"]
    assert len(refusals) == 5 and not any(TEST_NUMBERS.search(text) for text in refusals)
    # The service knows of one conversation, the attested one (the refused calls never reached it).
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/analytics/conversations", token=shop["admin"])
    assert reply.status == 200, reply.body
    assert {row["conversation_id"]: row["attestation"] for row in reply.body["conversations"]} == {
        "CA0001": "A"
    }
