"""Caller-ID trust through the SDK (SPEC sections 13 and 14): the call's attestation and step-up go with every
read, the start, the message batches and the end; what the call does not qualify for is withheld from
``conv.memory`` and cannot be written by its end. Against the real service (SQLite and Redis stores), and
against fake servers for answers of an older service or of the wrong shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import MemoryClient, RetryPolicy

from tests.conftest import OPERATOR_TOKEN, Api
from tests.sdk.conftest import Forwarder, Serve, valid_end

CALLER = "+14155550100"
PROJECT = "cheese-shop"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=0.5)
#: ``verified`` is sensitive: only an A-attested call, or one whose caller passed a step-up check, reads it
#: and writes it. ``caller_name`` is personal (every call).
TRUST = {
    "state_keys": ["caller_name", "verified", "booking_day"],
    "default_region": "US",
    "field_classes": {"verified": "sensitive"},
    "trust": {"sensitive": "A"},
}


async def configure(api: Api, repeat_caller: dict[str, Any], conversation: bool = False) -> dict[str, str]:
    memory: dict[str, Any] = {"repeat_caller": repeat_caller}
    if conversation:
        memory["conversation"] = {"enabled": True}
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json={"memory": memory})
    assert reply.status in (200, 201), reply.body
    return {role: await api.mint(PROJECT, role) for role in ("agent", "admin")}


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    tokens = await configure(api, TRUST)
    reply = await api.call(
        "PATCH",
        f"/v1/projects/{PROJECT}/callers/{CALLER}/memory",
        token=tokens["admin"],
        json={"caller_name": "Ada", "verified": "yes"},
    )
    assert reply.status == 200, reply.body
    return tokens


def client_for(url: str, token: str, tmp_path: Path, **options: Any) -> MemoryClient:
    options.setdefault("read_budget", 2.0)  # a loaded machine: the budgets are tested elsewhere
    return MemoryClient(url, token=token, project=PROJECT, outbox_path=tmp_path / "outbox.db", **options)


async def stored(api: Api, admin: str) -> dict[str, Any]:
    """The caller's memory as an admin reads it (an admin's read is no call: nothing is withheld)."""
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/callers/{CALLER}/memory", token=admin)
    assert reply.status == 200, reply.body
    fields: dict[str, Any] = reply.body["fields"]
    return fields


# Against the real service ---------------------------------------------------------------------------------


async def test_a_spoofed_call_gets_no_sensitive_field_and_cannot_overwrite_it(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation="TN-Validation-Failed-A")
        memory = await conv.begin_turn()
        assert memory.available and memory.fields() == {"caller_name": "Ada"}
        assert memory.withheld == ("verified",) and "verified" not in memory
        assert memory.attestation == "failed" and conv.attestation == "TN-Validation-Failed-A"
        conv.state.update(verified="no", caller_name="Eve")
        result = await conv.end()
        assert result.withheld == ("verified",) and "verified" not in result.persisted
        assert result.persisted == ("caller_name",) and not result.queued
    assert await stored(api, shop["admin"]) == {"caller_name": "Eve", "verified": "yes"}


async def test_a_call_without_the_trust_cannot_delete_a_sensitive_field_either(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation="TN-Validation-Passed-B")
        await conv.begin_turn()
        conv.state["verified"] = None  # a delete
        result = await conv.end()
        assert result.withheld == ("verified",) and result.persisted == ()
    assert (await stored(api, shop["admin"]))["verified"] == "yes"


@pytest.mark.parametrize("attestation", ["TN-Validation-Passed-A", "TN-Validation-Passed", "a", " Verified "])
async def test_an_a_attested_call_reads_and_writes_everything(
    api: Api, shop: dict[str, str], tmp_path: Path, attestation: str
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation=attestation)
        memory = await conv.begin_turn()
        assert memory.fields() == {"caller_name": "Ada", "verified": "yes"}
        assert memory.withheld == () and memory.attestation == "A"
        conv.state["verified"] = "again"
        result = await conv.end()
        assert result.withheld == () and result.persisted == ("verified",)
    assert (await stored(api, shop["admin"]))["verified"] == "again"


async def test_a_call_without_attestation_counts_as_the_projects_unknown(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        memory = await client.conversation("conv-1", caller=CALLER).begin_turn()
        assert memory.withheld == ("verified",) and memory.attestation == "unknown"  # unknown counts as C
    await configure(api, {**TRUST, "unknown_attestation": "A"})  # a project outside North America
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        memory = await client.conversation("conv-2", caller=CALLER).begin_turn()
        assert memory.withheld == () and memory.fields()["verified"] == "yes"


async def test_a_step_up_mid_call_reads_and_writes_what_it_needs(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation="No-TN-Validation")
        assert (await conv.begin_turn()).withheld == ("verified",) and not conv.step_up
        conv.prefetch()  # the caller starts speaking; the agent then checks their PIN
        conv.step_up_passed()
        conv.step_up_passed()  # once is enough; again does nothing
        assert conv.step_up
        memory = await conv.begin_turn()  # the prefetch made before the step-up is not taken
        assert memory.withheld == () and memory.fields() == {"caller_name": "Ada", "verified": "yes"}
        conv.state["verified"] = "pin"
        result = await conv.end()
        assert result.withheld == () and result.persisted == ("verified",)
    assert (await stored(api, shop["admin"]))["verified"] == "pin"


async def test_a_step_up_passed_before_the_call_is_given_at_its_start(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, step_up=True)
        assert conv.step_up and conv.attestation is None
        memory = await conv.begin_turn()
        assert memory.withheld == () and memory.attestation == "unknown"
        memory = await client.read_memory(CALLER, attestation="C", step_up=True)
        assert memory.withheld == () and memory.attestation == "C"
        memory = await client.read_memory(CALLER, attestation="C")
        assert memory.withheld == ("verified",)


async def test_an_attestation_the_service_does_not_read_is_the_callers_error(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation="TN-Validation-Passed-Q")
        memory = await conv.begin_turn()
        assert not memory.available and "attestation" in (memory.reason or "")
        assert not client.circuit.is_open  # the caller's error, not an outage
        assert "TN-Validation-Passed-Q" not in (memory.reason or "")  # the service does not echo it


async def test_the_trust_goes_with_every_request_of_a_transcript_conversation(
    api: Api, tmp_path: Path, serve: Serve
) -> None:
    tokens = await configure(api, TRUST, conversation=True)
    async with aiohttp.ClientSession() as session:
        recorder = Recorder(api.base_url, session)
        url = await serve(recorder.handle)
        async with client_for(url, tokens["agent"], tmp_path) as client:
            conv = client.conversation(
                "conv-1", caller=CALLER, attestation="TN-Validation-Passed-B", transcript=True
            )
            await conv.begin_turn()  # the start and the first read
            conv.add_message("user", "my PIN is 1234")
            assert (await conv.context()).profile.withheld == ("verified",)
            conv.step_up_passed()
            await conv.begin_turn()
            conv.state["booking_day"] = "Friday"
            conv.add_message("assistant", "thank you")
            await conv.history()
            assert (await conv.context()).profile.withheld == ()
            await conv.end()
    seen = {(method, path.rsplit("/", 1)[-1]) for method, path, _, _ in recorder.sent}
    assert {("GET", "memory"), ("POST", "start"), ("POST", "messages"), ("GET", "history")} <= seen
    assert {("GET", "context"), ("POST", "end")} <= seen
    stepped = False
    for method, path, query, body in recorder.sent:  # in the order they were made
        sent = query if method == "GET" else body
        assert sent["attestation"] == "TN-Validation-Passed-B", (method, path)
        says = sent.get("step_up") in ("true", True)
        assert says or not stepped, (method, path, sent)  # once passed, every later request says so
        stepped = stepped or says
    first_step_up = next(
        i for i, (_, _, q, b) in enumerate(recorder.sent) if "step_up" in q or "step_up" in (b or {})
    )
    assert recorder.sent[first_step_up][1].endswith("/memory")  # the first read after step_up_passed()
    assert recorder.sent[-1][1].endswith("/end") and recorder.sent[-1][3]["step_up"] is True


async def test_a_resumed_call_gets_the_dropped_calls_state_only_as_far_as_it_qualifies(
    api: Api, tmp_path: Path
) -> None:
    tokens = await configure(api, TRUST, conversation=True)
    async with client_for(api.base_url, tokens["agent"], tmp_path) as client:
        first = client.conversation("conv-1", caller=CALLER, attestation="A", transcript=True)
        await first.begin_turn()
        first.add_message("user", "I am Ada, my PIN is 1234")
        first.state.update(caller_name="Ada", verified="yes")
        await first.begin_turn()  # sends the checkpoint
        await first.history()  # waits for it
        assert (await first.end(end_reason="dropped")).persisted == ("caller_name", "verified")
        again = client.conversation(
            "conv-2", caller=CALLER, attestation="TN-Validation-Passed-C", transcript=True
        )
        memory = await again.begin_turn()
        assert memory.withheld == ("verified",) and memory.fields() == {"caller_name": "Ada"}
        resume = again.resume
        assert resume is not None and resume.conversation_id == "conv-1"
        assert resume.withheld == ("verified",)
        assert resume.state is not None and "verified" not in resume.state
        await again.end()


async def test_without_trust_nothing_of_it_is_sent(api: Api, tmp_path: Path, serve: Serve) -> None:
    """A service from before caller-ID trust refuses members it does not know: code that does not use it
    sends none."""
    tokens = await configure(api, {"state_keys": ["booking_day"], "default_region": "US"}, conversation=True)
    async with aiohttp.ClientSession() as session:
        recorder = Recorder(api.base_url, session)
        url = await serve(recorder.handle)
        async with client_for(url, tokens["agent"], tmp_path) as client:
            conv = client.conversation("conv-1", caller=CALLER, transcript=True, attestation="  ")
            assert conv.attestation is None  # an empty attestation is none
            await conv.begin_turn()
            conv.add_message("user", "hello")
            conv.state["booking_day"] = "Friday"
            await conv.context()
            result = await conv.end()
            assert result.withheld == () and result.persisted == ("booking_day",)
    assert recorder.sent
    for _, _, query, body in recorder.sent:
        assert not {"attestation", "step_up"} & (set(query) | set(body or {}))


class Recorder(Forwarder):
    """A :class:`Forwarder` that also keeps what each request sent: its query and its JSON body."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        super().__init__(target, session)
        self.sent: list[tuple[str, str, dict[str, str], Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()  # kept by aiohttp: the forwarding reads it again
        self.sent.append(
            (request.method, request.path, dict(request.query), orjson.loads(raw) if raw else None)
        )
        return await super().handle(request)


# Against fake servers: an older service, answers of the wrong shape ---------------------------------------

MEMORY: dict[str, Any] = {
    "identifier": CALLER,
    "fields": {"caller_name": "Ada"},
    "expires_at": "2030-01-01T00:00:00Z",
    "blacklisted": False,
}


async def test_an_older_service_withholds_nothing(serve: Serve, tmp_path: Path) -> None:
    async def older(request: web.Request) -> web.Response:
        return web.json_response(MEMORY if request.method == "GET" else valid_end(request))

    url = await serve(older)
    async with client_for(url, "t", tmp_path, retry=FAST) as client:
        conv = client.conversation("conv-1", caller=CALLER)
        memory = await conv.begin_turn()
        assert memory.available and memory.withheld == () and memory.attestation is None
        assert (await conv.end()).withheld == ()


@pytest.mark.parametrize(
    "change",
    [
        {"withheld": "verified"},
        {"withheld": [1]},
        {"withheld": None},
        {"withheld": [["verified"]]},
        {"attestation": "TN-Validation-Passed-A"},  # the service answers it normalised, or not at all
        {"attestation": "a"},
        {"attestation": 1},
    ],
)
async def test_a_read_with_a_malformed_trust_answer_is_no_answer(
    serve: Serve, tmp_path: Path, change: dict[str, Any]
) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({**MEMORY, "withheld": [], "attestation": "A", **change})

    url = await serve(answer)
    async with client_for(url, "t", tmp_path, retry=FAST) as client:
        memory = await client.conversation("conv-1", caller=CALLER, attestation="A").begin_turn()
        assert not memory.available and len(memory) == 0 and memory.withheld == ()
        assert "not the service's" in (memory.reason or "")


@pytest.mark.parametrize("withheld", ["verified", [1], None, {"verified": True}])
async def test_an_end_with_a_malformed_withheld_keeps_the_write(
    serve: Serve, tmp_path: Path, withheld: Any
) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({**valid_end(request), "withheld": withheld})

    url = await serve(answer)
    async with client_for(url, "t", tmp_path, retry=FAST) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation="A")
        conv.state["booking_day"] = "Friday"
        result = await conv.end()
        assert result.queued and result.withheld == ()
        [entry] = await client.outbox.pending()
        assert orjson.loads(entry.body)["attestation"] == "A"  # the retry says the same


async def test_the_withheld_of_a_read_survives_a_304_and_a_stale_serve(serve: Serve, tmp_path: Path) -> None:
    answers = {"mode": "fresh"}

    async def answer(request: web.Request) -> web.Response:
        if answers["mode"] == "fresh":
            body = {
                **MEMORY,
                "valid_until": "2999-01-01T00:00:00Z",
                "withheld": ["verified"],
                "attestation": "C",
            }
            return web.json_response(body, headers={"ETag": '"v1"'})
        if answers["mode"] == "unchanged":
            return web.Response(status=304, headers={"ETag": '"v1"'})
        return web.Response(status=503)

    url = await serve(answer)
    async with client_for(url, "t", tmp_path, retry=FAST) as client:
        conv = client.conversation("conv-1", caller=CALLER, attestation="C")
        assert (await conv.begin_turn()).withheld == ("verified",)
        answers["mode"] = "unchanged"
        memory = await conv.begin_turn()
        assert memory.withheld == ("verified",) and memory.attestation == "C" and not memory.stale
        answers["mode"] = "down"
        memory = await conv.begin_turn()
        assert memory.stale and memory.withheld == ("verified",) and memory.attestation == "C"
        assert "withheld ['verified']" in repr(memory)


# Arguments ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attestation",
    [1, b"A", ["A"], "x" * 65, "TN-Validation\nPassed-A", "TN\u2010Validation\u2010Passed", "\x00"],
)
async def test_an_attestation_no_provider_sends_is_refused_at_once(
    serve: Serve, tmp_path: Path, attestation: Any
) -> None:
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response(MEMORY)

    url = await serve(answer)
    async with client_for(url, "t", tmp_path) as client:
        with pytest.raises(ValueError, match="attestation"):
            client.conversation("conv-1", caller=CALLER, attestation=attestation)
        with pytest.raises(ValueError, match="attestation"):
            await client.read_memory(CALLER, attestation=attestation)
    assert seen == []


@pytest.mark.parametrize("step_up", [1, "true", None])
async def test_step_up_is_true_or_false(serve: Serve, tmp_path: Path, step_up: Any) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response(MEMORY)

    url = await serve(answer)
    async with client_for(url, "t", tmp_path) as client:
        with pytest.raises(ValueError, match="step_up"):
            client.conversation("conv-1", caller=CALLER, step_up=step_up)
        with pytest.raises(ValueError, match="step_up"):
            await client.read_memory(CALLER, step_up=step_up)


# The SDK's own log lines ------------------------------------------------------------------------------------


@pytest.mark.parametrize("caller", ["account:A-1234567", "email:Ada.L@example.com", "ACCOUNT%3Aab.c_9"])
async def test_an_error_document_echoing_an_identifier_is_logged_masked(
    serve: Serve, tmp_path: Path, caller: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def echo(request: web.Request) -> web.Response:  # a proxy's error page quoting the path
        problem = {"title": "Not found", "status": 404, "detail": f"no route for {request.raw_path}"}
        return web.json_response(problem, status=404, content_type="application/problem+json")

    url = await serve(echo)
    caplog.set_level("DEBUG")
    async with client_for(url, "t", tmp_path) as client:
        memory = await client.conversation("conv-1", caller=caller).begin_turn()
        assert not memory.available
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("caller_memory.sdk"))
    assert "memory read refused" in logged
    assert "A-1234567" not in logged and "ada.l" not in logged.lower() and "ab.c_9" not in logged
    assert "account:[id]" in logged or "[email]" in logged
