"""The ingestion rules of SPEC 15 (service/domain/platforms/ingestion.py), tested once in the domain with a
small test adapter: a fake platform ("testvoice") that signs its payloads with HMAC-SHA256 over the signed
time and the body, verified the way every adapter verifies (service/domain/platforms/verification.py), then
parsed into the neutral records. On SQLite, Redis and Redis Cluster: call-start retries, both orders of two
end events, an end after supersession and after an inactivity end, an end with no start, a null extraction
that deletes nothing, forged, replayed and expired signatures refused with nothing changed, end_grace instead
of the inactivity end, and the analysis_grace end run after a restart."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from caller_memory.service.app import build_services
from caller_memory.service.config import Settings
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.conversations.call_trust import ConversationTrust
from caller_memory.service.domain.conversations.ending import ConversationService
from caller_memory.service.domain.conversations.events import EndedEvent
from caller_memory.service.domain.conversations.messages import Message
from caller_memory.service.domain.platforms.connections import Connection
from caller_memory.service.domain.platforms.ingestion import EndAnswer, PlatformIngestion, StartAnswer
from caller_memory.service.domain.platforms.records import CallEnd, CallStart, SpokenMessage
from caller_memory.service.domain.platforms.verification import (
    SignatureRefused,
    Window,
    check_first_sighting,
    check_hmac_sha256,
    check_window,
    hmac_sha256,
)
from caller_memory.service.domain.projects import Project
from caller_memory.service.domain.sealing import Sealer
from caller_memory.service.domain.store.transcripts import ConversationKey, TranscriptQuery
from caller_memory.service.domain.webhooks.service import WebhookService
from caller_memory.service.http.app_keys import Services

from tests.conftest import CLUSTER, PSEUDONYM_KEY, empty_store_url

CALLER = "+14155550100"
PLATFORM = "testvoice"
SECRET = "testvoice-signing-secret"
SEALING_KEY = os.urandom(32)
WINDOW = Window(past_ms=5 * 60_000, future_ms=60_000)
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {"state_keys": ["cheese", "booking_day", "caller_name"], "retention": "P30D"},
        "conversation": {"enabled": True, "end_after_inactivity": "PT30M", "idle_after": "PT2M"},
    }
}


def connection(project: str) -> Connection:
    return Connection(
        project=project,
        platform=PLATFORM,
        state_map={"analysis.cheese": "cheese", "analysis.day": "booking_day"},
        channel="phone",
        analysis_qa_key="analysis.success",
        end_grace="PT2H",
        options={},
        sealed_secret=None,
        secret_updated_at=None,
        updated_at=0,
    )


@dataclass
class FakeVoice:
    """The fake platform's adapter: verify (signature, window, event id), parse, call the use case."""

    services: Services
    ingestion: PlatformIngestion
    shop: Project
    clock: FakeClock

    def signed(
        self, payload: dict[str, Any], *, secret: str = SECRET, at_ms: int | None = None
    ) -> tuple[bytes, dict[str, str]]:
        body = orjson.dumps({"event_id": uuid.uuid4().hex, **payload})
        at = self.clock.now_ms() if at_ms is None else at_ms
        signature = hmac_sha256(secret, f"{at}.".encode() + body).hex()
        return body, {"x-testvoice-time": str(at), "x-testvoice-signature": signature}

    async def receive(self, body: bytes, headers: dict[str, str]) -> StartAnswer | EndAnswer:
        now = self.clock.now_ms()
        at = headers.get("x-testvoice-time", "")
        check_hmac_sha256(
            SECRET, f"{at}.".encode() + body, headers.get("x-testvoice-signature"), platform=PLATFORM
        )
        check_window(int(at) if at.isdigit() else None, now, WINDOW, platform=PLATFORM)
        payload = orjson.loads(body)
        await check_first_sighting(
            self.services.store,
            project=self.shop.project_id,
            platform=PLATFORM,
            event_id=payload["event_id"],
            now_ms=now,
            keep_ms=WINDOW.keep_ms,
        )
        conn = connection(self.shop.project_id)
        if payload["type"] == "call_started":
            return await self.ingestion.start(
                self.shop,
                conn,
                CallStart(PLATFORM, f"{PLATFORM}:{payload['attempt']}", payload["from"], budget_s=5.0),
            )
        return await self.ingestion.end(
            self.shop,
            conn,
            CallEnd(
                platform=PLATFORM,
                conversation_id=payload["conversation"],
                caller=payload["from"],
                messages=[SpokenMessage(m["role"], m["text"]) for m in payload.get("transcript", [])],
                summary=payload.get("summary"),
                extracted=payload.get("analysis_data", {}),
                ended_at=payload.get("ended_at"),
                end_reason=payload.get("reason"),
                transfer_label=payload.get("transferred_to"),
                carries_analysis=payload["type"] == "call_analyzed",
            ),
        )

    async def start(self, attempt: str) -> StartAnswer:
        answer = await self.receive(
            *self.signed({"type": "call_started", "attempt": attempt, "from": CALLER})
        )
        assert isinstance(answer, StartAnswer)
        return answer

    async def end(self, conversation: str, kind: str = "call_analyzed", **payload: Any) -> EndAnswer:
        answer = await self.receive(
            *self.signed({"type": kind, "conversation": conversation, "from": CALLER, **payload})
        )
        assert isinstance(answer, EndAnswer)
        return answer


TRANSCRIPT = [
    {"role": "assistant", "text": "Cheese shop, how can I help?"},
    {"role": "user", "text": "Gouda for Friday please"},
    {"role": "system", "text": "tool schema the caller never heard"},
    {"role": "assistant", "text": "Gouda for Friday it is."},
]
ANALYSIS = {"analysis": {"cheese": "gouda", "day": "Friday", "success": True}}


def ingestion_of(services: Services) -> PlatformIngestion:
    return PlatformIngestion(
        services.store,
        services.memory,
        services.transcripts,
        services.lifecycle,
        services.conversations,
        services.clock,
        Sealer(SEALING_KEY),
    )


@pytest.fixture(params=["sqlite", "redis", CLUSTER])
def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return empty_store_url(request, request.param, tmp_path)


async def open_services(url: str, clock: FakeClock) -> Services:
    built = build_services(
        Settings(pseudonym_key=PSEUDONYM_KEY, store_url=url, store_timeout=5.0), clock=clock
    )
    await built.store.open()
    return built


@pytest.fixture
async def voice(store_url: str, clock: FakeClock) -> AsyncIterator[FakeVoice]:
    services = await open_services(store_url, clock)
    voice = FakeVoice(
        services, ingestion_of(services), (await services.projects.apply("shop", CONFIG, actor="t"))[0], clock
    )
    try:
        yield voice
    finally:
        await voice.services.store.close()  # the one a test's restart left open


async def memory(voice: FakeVoice) -> dict[str, Any]:
    view = await voice.services.memory.read(voice.shop, CALLER)
    return {name: orjson.loads(value) for name, value in view.fields.items()}


async def header_of(voice: FakeVoice, conversation_id: str) -> Any:
    header, messages = await voice.services.store.read_conversation(
        ConversationKey("shop", conversation_id), voice.clock.now_ms(), TranscriptQuery()
    )
    return header, messages


async def test_a_call_start_retry_is_answered_from_the_conversation_it_started(voice: FakeVoice) -> None:
    first = await voice.start("a1")
    assert first.conversation_id == f"{PLATFORM}:a1" and not first.retried and first.memory == {}
    assert first.returning_caller is False
    voice.clock.advance(30)
    again = await voice.start("a2")  # the platform's retry: another random id, the same caller
    assert again.retried and again.conversation_id == f"{PLATFORM}:a1"
    header, _ = await header_of(voice, f"{PLATFORM}:a1")
    assert header.ended_by == ""  # never superseded by its retry
    assert (await header_of(voice, f"{PLATFORM}:a2"))[0] is None
    # Past the retry window, a start is a new call: the earlier one is superseded.
    voice.clock.advance(61)
    later = await voice.start("a3")
    assert not later.retried and later.conversation_id == f"{PLATFORM}:a3"
    assert later.returning_caller is True
    assert (await header_of(voice, f"{PLATFORM}:a1"))[0].ended_by == "superseded"


async def test_an_end_stores_the_transcript_summary_and_mapped_state(voice: FakeVoice) -> None:
    started = await voice.start("b1")
    voice.clock.advance(90)
    answer = await voice.end(
        started.conversation_id,
        transcript=TRANSCRIPT,
        summary="Booked gouda for Friday.",
        analysis_data=ANALYSIS,
        ended_at=(voice.clock.now_ms() - 5_000) / 1000,  # seconds: checked against the start
        reason="completed",
        transferred_to="+1 415 555 0199",
    )
    assert answer.outcome == "ended"
    header, messages = await header_of(voice, started.conversation_id)
    assert header.ended_by == "explicit" and header.end_reason == "completed"
    assert [Message(m.body).platform(header.started_at)["content"] for m in messages] == [
        "Cheese shop, how can I help?",
        "Gouda for Friday please",
        "Gouda for Friday it is.",
    ]
    assert [m.turn_id for m in messages] == [0, 1, 1]
    assert b"Booked gouda for Friday." in (header.summary or b"")
    assert await memory(voice) == {"cheese": "gouda", "booking_day": "Friday"}
    end_data = orjson.loads(header.end_data) if header.end_data else {}
    assert "4155550199" not in orjson.dumps(end_data).decode()
    # The same end again: a duplicate, answered, nothing twice.
    again = await voice.end(started.conversation_id, transcript=TRANSCRIPT, analysis_data=ANALYSIS)
    assert again.outcome == "duplicate"
    assert len((await header_of(voice, started.conversation_id))[1]) == 3


@pytest.mark.parametrize("analysis_first", [False, True])
async def test_two_end_events_make_one_end_in_either_order(voice: FakeVoice, analysis_first: bool) -> None:
    started = await voice.start("c1")
    voice.clock.advance(60)
    ended = {"transcript": TRANSCRIPT, "reason": "completed"}
    analyzed = {"summary": "Gouda on Friday.", "analysis_data": ANALYSIS}
    if analysis_first:
        assert (await voice.end(started.conversation_id, "call_analyzed", **analyzed)).outcome == "ended"
        assert (await voice.end(started.conversation_id, "call_ended", **ended)).outcome == "duplicate"
    else:
        assert (await voice.end(started.conversation_id, "call_ended", **ended)).outcome == "held"
        assert (await header_of(voice, started.conversation_id))[0].ended_by == ""  # waits for the analysis
        assert (await voice.end(started.conversation_id, "call_analyzed", **analyzed)).outcome == "ended"
        header, messages = await header_of(voice, started.conversation_id)
        assert header.end_reason == "completed" and len(messages) == 3  # the first event's parts kept
    assert await memory(voice) == {"cheese": "gouda", "booking_day": "Friday"}
    # Nothing is left held to end it again.
    voice.clock.advance(3600)
    assert await voice.ingestion.run_held_ends(voice.services.projects) == 0


async def test_an_end_after_supersession_and_after_an_inactivity_end_is_late(voice: FakeVoice) -> None:
    first = await voice.start("d1")
    turn = {"role": "user", "content": "Brie?", "turn_id": 1, "metadata": {"source": "asr"}}
    await voice.services.transcripts.append(voice.shop, first.conversation_id, {"messages": [turn]})
    voice.clock.advance(120)
    second = await voice.start("d2")  # supersedes d1
    late = await voice.end(
        first.conversation_id,
        transcript=TRANSCRIPT,
        summary="Asked for brie.",
        analysis_data={"analysis": {"cheese": "brie"}},
    )
    assert late.outcome == "late"
    assert (await memory(voice))["cheese"] == "brie"
    # Its summary added once: a second late end (another summary) leaves it.
    again = await voice.end(first.conversation_id, summary="Something else.", analysis_data={})
    assert again.outcome == "conflict"  # a different late end after the first: answered, not refused
    header, messages = await header_of(voice, first.conversation_id)
    assert header.ended_by == "superseded" and len(messages) == 1
    assert orjson.loads(header.summary or b"{}")["text"] == "Asked for brie."
    # The second call: the service ends it for inactivity end_grace (2 h) after its start.
    voice.clock.advance(2 * 3600 + 1)
    assert await voice.services.lifecycle.run_inactivity_ends(voice.services.projects) == 1
    assert (await header_of(voice, second.conversation_id))[0].ended_by == "inactivity"
    again = await voice.end(
        second.conversation_id,
        transcript=TRANSCRIPT,
        summary="Monday then.",
        analysis_data={"analysis": {"day": "Monday"}},
    )
    assert again.outcome == "late"
    assert await memory(voice) == {"cheese": "brie", "booking_day": "Monday"}
    # Its transcript (it had none: the platform sends nothing during a call) and summary were added, once.
    header, messages = await header_of(voice, second.conversation_id)
    assert header.ended_by == "inactivity" and len(messages) == 3
    assert orjson.loads(header.summary or b"{}")["text"] == "Monday then."
    assert (await voice.end(second.conversation_id, transcript=TRANSCRIPT)).outcome == "conflict"
    assert len((await header_of(voice, second.conversation_id))[1]) == 3


async def test_a_platform_conversation_ends_for_inactivity_only_end_grace_after_its_start(
    voice: FakeVoice,
) -> None:
    started = await voice.start("e1")
    voice.clock.advance(31 * 60)  # past the project's end_after_inactivity (30 min)
    assert await voice.services.lifecycle.run_inactivity_ends(voice.services.projects) == 0
    assert (await header_of(voice, started.conversation_id))[0].ended_by == ""
    voice.clock.advance(90 * 60)  # 2 h from the start
    assert await voice.services.lifecycle.run_inactivity_ends(voice.services.projects) == 1


async def test_turns_recorded_during_the_call_do_not_bring_the_inactivity_end_forward(
    voice: FakeVoice,
) -> None:
    started = await voice.start("e2")
    voice.clock.advance(60)
    # What the memory proxy records of a turn: an append (its activity makes the conversation due
    # end_after_inactivity later, which the platform's end_grace overrides).
    turn = {"role": "user", "content": "Hello", "turn_id": 1, "metadata": {"source": "asr"}}
    await voice.services.transcripts.append(voice.shop, started.conversation_id, {"messages": [turn]})
    voice.clock.advance(31 * 60)
    assert await voice.services.lifecycle.run_inactivity_ends(voice.services.projects) == 0
    assert (await header_of(voice, started.conversation_id))[0].ended_by == ""
    voice.clock.advance(90 * 60)
    assert await voice.services.lifecycle.run_inactivity_ends(voice.services.projects) == 1


async def test_an_end_with_no_start_starts_and_ends_one(voice: FakeVoice) -> None:
    answer = await voice.end(f"{PLATFORM}:never-started", transcript=TRANSCRIPT, analysis_data=ANALYSIS)
    assert answer.outcome == "started_and_ended"
    header, messages = await header_of(voice, f"{PLATFORM}:never-started")
    assert header.ended_by == "explicit" and len(messages) == 3
    assert await memory(voice) == {"cheese": "gouda", "booking_day": "Friday"}


async def test_a_null_or_empty_extraction_deletes_nothing(voice: FakeVoice) -> None:
    first = await voice.start("f1")
    await voice.end(first.conversation_id, analysis_data=ANALYSIS)
    voice.clock.advance(3600)
    second = await voice.start("f2")
    assert second.memory == {"cheese": "gouda", "booking_day": "Friday"} and second.returning_caller
    answer = await voice.end(
        second.conversation_id, analysis_data={"analysis": {"cheese": None, "day": ""}, "other": None}
    )
    assert answer.outcome == "ended"
    assert await memory(voice) == {"cheese": "gouda", "booking_day": "Friday"}


async def test_forged_replayed_and_expired_signatures_are_refused_changing_nothing(voice: FakeVoice) -> None:
    payload = {"type": "call_started", "attempt": "g1", "from": CALLER}
    forged = voice.signed(payload, secret="not-the-secret")
    expired = voice.signed(payload, at_ms=voice.clock.now_ms() - WINDOW.past_ms - 1)
    future = voice.signed(payload, at_ms=voice.clock.now_ms() + WINDOW.future_ms + 1)
    body, headers = voice.signed(payload)
    unsigned = (body, {"x-testvoice-time": headers["x-testvoice-time"]})
    tampered = (body.replace(b"g1", b"g9"), headers)
    for attempt, says in [
        (forged, "does not match"),
        (expired, "too old"),
        (future, "in the future"),
        (unsigned, "not signed"),
        (tampered, "does not match"),
    ]:
        with pytest.raises(SignatureRefused, match=says) as refused:
            await voice.receive(*attempt)
        assert refused.value.status == 401
    assert (await header_of(voice, f"{PLATFORM}:g1"))[0] is None
    assert (await header_of(voice, f"{PLATFORM}:g9"))[0] is None
    # Accepted once; the same delivery again is a replay, refused, and starts nothing new.
    assert isinstance(await voice.receive(body, headers), StartAnswer)
    with pytest.raises(SignatureRefused, match="delivered before"):
        await voice.receive(body, headers)
    # The forged ones' event ids were never remembered: the genuine event with the expired one's id would
    # still pass (verification before the sighting).
    end_body, end_headers = voice.signed(
        {
            "type": "call_analyzed",
            "conversation": f"{PLATFORM}:g1",
            "from": CALLER,
            "analysis_data": ANALYSIS,
        },
        secret="wrong",
    )
    with pytest.raises(SignatureRefused):
        await voice.receive(end_body, end_headers)
    assert await memory(voice) == {}


async def test_an_unanswered_first_end_runs_analysis_grace_later_after_a_restart(
    voice: FakeVoice, store_url: str, clock: FakeClock
) -> None:
    started = await voice.start("h1")
    voice.clock.advance(60)
    held = await voice.end(
        started.conversation_id, "call_ended", transcript=TRANSCRIPT, reason="dropped", analysis_data=ANALYSIS
    )
    assert held.outcome == "held"
    # What the store holds is sealed: no number, nothing said, nothing extracted in the clear.
    document = await voice.services.store.take_platform_end("shop", started.conversation_id)
    assert document is not None
    for clear in (b"4155550100", b"Gouda", b"gouda", b"Cheese shop"):
        assert clear not in document
    await voice.services.store.hold_platform_end(
        "shop", started.conversation_id, document, clock.now_ms() + 600_000
    )
    # The process goes; another starts on the same store.
    await voice.services.store.close()
    restarted = await open_services(store_url, clock)
    voice.services = restarted
    ingestion = ingestion_of(restarted)
    clock.advance(9 * 60)
    assert await ingestion.run_held_ends(restarted.projects) == 0  # not due yet
    clock.advance(61)
    assert await ingestion.run_held_ends(restarted.projects) == 1
    header, messages = await header_of(voice, started.conversation_id)
    assert header.ended_by == "explicit" and header.end_reason == "dropped" and len(messages) == 3
    assert await memory(voice) == {"cheese": "gouda", "booking_day": "Friday"}
    assert await ingestion.run_held_ends(restarted.projects) == 0


async def test_a_start_fails_open_within_its_budget(voice: FakeVoice) -> None:
    answer = await voice.ingestion.start(
        voice.shop, connection("shop"), CallStart(PLATFORM, f"{PLATFORM}:i1", CALLER, budget_s=0.0)
    )
    assert answer.fail_open and answer.memory is None and answer.conversation_id == f"{PLATFORM}:i1"


class Heard:
    """An end listener that keeps what it is told."""

    def __init__(self) -> None:
        self.events: list[EndedEvent] = []

    async def conversation_ended(self, project: Project, event: EndedEvent) -> None:
        self.events.append(event)


async def test_a_platform_end_is_explicit_with_the_platform_as_its_source(voice: FakeVoice) -> None:
    heard = Heard()
    services = voice.services
    told = ConversationService(
        services.store, services.memory, services.analytics, voice.clock, listeners=(heard,)
    )
    voice.ingestion = PlatformIngestion(
        services.store,
        services.memory,
        services.transcripts,
        services.lifecycle,
        told,
        voice.clock,
        Sealer(SEALING_KEY),
    )
    started = await voice.start("j1")
    await voice.end(
        started.conversation_id, analysis_data=ANALYSIS, reason="transferred", transferred_to="Sales desk"
    )
    (event,) = heard.events
    assert (event.ended_by, event.source, event.end_reason) == ("explicit", PLATFORM, "transferred")
    assert event.outcome["handoff_to"] == "Sales desk" and event.outcome["qa"] == "true"
    data = WebhookService._ended_data(event)
    assert data["source"] == PLATFORM and data["ended_by"] == "explicit"


async def test_an_end_naming_another_callers_conversation_is_answered_and_changes_nothing(
    voice: FakeVoice,
) -> None:
    started = await voice.start("k1")
    other = "+14155550123"
    answer = await voice.receive(
        *voice.signed(
            {
                "type": "call_analyzed",
                "conversation": started.conversation_id,
                "from": other,
                "transcript": TRANSCRIPT,
                "analysis_data": ANALYSIS,
            }
        )
    )
    assert isinstance(answer, EndAnswer) and answer.outcome == "conflict"
    header, messages = await header_of(voice, started.conversation_id)
    assert header.ended_by == "" and messages == []
    assert (await voice.services.memory.read(voice.shop, other)).fields == {}
    assert voice.ingestion.transcripts_refused == 1


async def test_a_start_fails_open_when_the_store_is_down(voice: FakeVoice, clock: FakeClock) -> None:
    down = build_services(
        Settings(pseudonym_key=PSEUDONYM_KEY, store_url="redis://127.0.0.1:1/0", store_timeout=0.2),
        clock=clock,
    )
    began = time.monotonic()
    answer = await ingestion_of(down).start(
        voice.shop, connection("shop"), CallStart(PLATFORM, f"{PLATFORM}:m1", CALLER, budget_s=1.0)
    )
    assert time.monotonic() - began < 1.0
    assert answer.fail_open and answer.memory is None and not answer.started
    await down.store.close()


async def test_a_platform_end_uses_the_trust_stored_with_its_conversation(voice: FakeVoice) -> None:
    bank_config: dict[str, Any] = {
        "memory": {
            "repeat_caller": {
                "state_keys": ["cheese", "booking_day"],
                "field_classes": {"booking_day": "sensitive"},
                "trust": {"sensitive": "step_up"},
                "retention": "P30D",
            },
            "conversation": {"enabled": True},
        }
    }
    voice.shop, _ = await voice.services.projects.apply("shop", bank_config, actor="test")
    trust = ConversationTrust(voice.services.store, voice.clock, voice.services.audit)
    unverified = await voice.start("n1")
    answer = await voice.end(unverified.conversation_id, analysis_data=ANALYSIS)
    assert answer.outcome == "ended" and answer.persisted == ("cheese",)
    assert await memory(voice) == {"cheese": "gouda"}  # the sensitive field was not written
    voice.clock.advance(3600)
    verified = await voice.start("n2")
    await trust.raise_step_up(voice.shop, verified.conversation_id, {"step_up": True}, actor="test")
    answer = await voice.end(verified.conversation_id, analysis_data=ANALYSIS)
    assert sorted(answer.persisted) == ["booking_day", "cheese"]
    assert await memory(voice) == {"cheese": "gouda", "booking_day": "Friday"}


async def test_an_end_time_outside_the_call_is_clamped_and_counted(voice: FakeVoice) -> None:
    seen: list[str] = []
    voice.ingestion.observe = seen.append  # what the service's metrics are told
    started = await voice.start("p1")
    voice.clock.advance(120)
    in_call = voice.clock.now_ms() - 60_000
    await voice.end(started.conversation_id, ended_at=in_call)  # milliseconds, inside: as it is
    assert voice.ingestion.clamped_times == 0
    second = await voice.start("p2")
    voice.clock.advance(120)
    await voice.end(
        second.conversation_id, ended_at=(voice.clock.now_ms() + 3_600_000) / 1000
    )  # seconds, late
    assert voice.ingestion.clamped_times == 1
    third = await voice.start("p3")
    voice.clock.advance(120)
    await voice.end(
        third.conversation_id, ended_at=(voice.clock.now_ms() - 86_400_000) * 1000
    )  # microseconds
    assert voice.ingestion.clamped_times == 2
    assert seen == ["clamped_time", "clamped_time"]
