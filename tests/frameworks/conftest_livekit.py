"""What the LiveKit Agents tests share: the fake model, a configured project, a client, sessions in text mode
(no room), offline SIP participants, and a capture of every log line (LiveKit's own JSON formatter, which
prints every ``extra``) checked for phone numbers after each test. Imported by test_livekit.py only."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from caller_memory.sdk import MemoryClient
from caller_memory.sdk.livekit import CallMemory, MemoryAgent
from livekit import rtc
from livekit.agents import AgentSession, RunContext, function_tool
from livekit.agents.cli.log import JsonFormatter
from livekit.plugins import openai
from livekit.rtc._proto import handle_pb2, participant_pb2

from tests.conftest import OPERATOR_TOKEN, TEST_NUMBERS, Api, canonical_digits
from tests.support.fake_llm import FakeLLM

NUMBER = "+14155550100"
#: Every form of the number a log line could hold: E.164, digits only, national, percent-encoded.
FORMS = (NUMBER, "14155550100", "(415) 555-0100", "%2B14155550100")
PROJECT = "cheese-shop"
PROJECT_CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name"],
            "default_region": "US",
            "analytics_enabled": True,
        },
        "conversation": {"enabled": True, "idle_after": "PT10S", "end_after_inactivity": "PT60S"},
    }
}
INSTRUCTIONS = "You are the cheese shop's receptionist."


class Shopkeeper(MemoryAgent):
    """The agent of the tests: one tool of its own that writes conv.state."""

    @function_tool
    async def save_name(self, context: RunContext[Any], name: str) -> str:
        """Remember the caller's first name.

        Args:
            name: the caller's first name
        """
        CallMemory.of(context).state["caller_name"] = name
        return f'{{"name": "{name}"}}'


def sip_participant(
    number: str | None,
    call_id: str | None,
    kind: participant_pb2.ParticipantKind.ValueType = participant_pb2.ParticipantKind.PARTICIPANT_KIND_SIP,
) -> rtc.RemoteParticipant:
    """A real ``rtc.RemoteParticipant`` without a server (handle 0 makes no FFI call), as LiveKit builds
    one for a SIP caller."""
    attributes = {"sip.trunkPhoneNumber": "+14155550199"}
    if number is not None:
        attributes["sip.phoneNumber"] = number
    if call_id is not None:
        attributes["sip.callID"] = call_id
    info = participant_pb2.ParticipantInfo(
        sid="PA_test",
        identity=f"sip_{number}",
        kind=kind,
        attributes=attributes,
    )
    owned = participant_pb2.OwnedParticipant(handle=handle_pb2.FfiOwnedHandle(id=0), info=info)
    return rtc.RemoteParticipant(owned)


class Lines(logging.Handler):
    """Every record as LiveKit's production JSON formatter writes it (message and every extra)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def leaks(self) -> list[str]:
        return [
            line
            for line in self.lines
            if any(form in line for form in FORMS)
            or TEST_NUMBERS.search(line)
            or TEST_NUMBERS.search(canonical_digits(line))
        ]


@pytest.fixture(autouse=True)
def lines() -> Iterator[Lines]:
    """Every log line of the test (framework, OpenAI client, SDK, service), none holding a number."""
    handler = Lines()
    root = logging.getLogger()
    previous = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)
    root.setLevel(previous)
    assert handler.leaks() == [], handler.leaks()[:5]


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """SQLite only: these tests are about the framework; the store contract has its own suite."""
    return f"sqlite:///{tmp_path}/memory.db"


@pytest.fixture
async def fake_llm() -> AsyncIterator[FakeLLM]:
    async with FakeLLM() as fake:
        yield fake


@pytest.fixture
async def tokens(api: Api) -> dict[str, str]:
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=PROJECT_CONFIG)
    assert reply.status in (200, 201), reply.body
    return {role: await api.mint(PROJECT, role) for role in ("agent", "admin")}


def make_client(url: str, token: str, tmp_path: Path, read_budget: float = 1.0) -> MemoryClient:
    """A client whose reads have time on a loaded machine (the budget test sets its own)."""
    return MemoryClient(
        url, token=token, project=PROJECT, read_budget=read_budget, outbox_path=tmp_path / "outbox.db"
    )


class Sessions:
    """Text-mode sessions on the fake model; their OpenAI clients closed after the test (AgentSession's
    aclose() leaves them open, and their sockets would warn)."""

    def __init__(self, fake: FakeLLM) -> None:
        self.fake = fake
        self.llms: list[openai.LLM] = []

    def new(self) -> AgentSession[Any]:
        model = openai.LLM(model="fake-model", base_url=self.fake.base_url, api_key="sk-test")
        self.llms.append(model)
        # No VAD, no turn detector: text mode (else LiveKit builds its inference VAD and turn detector).
        return AgentSession(llm=model, vad=None, turn_handling={"turn_detection": None})

    async def aclose(self) -> None:
        while self.llms:
            await self.llms.pop().aclose()


@pytest.fixture
async def sessions(fake_llm: FakeLLM) -> AsyncIterator[Sessions]:
    made = Sessions(fake_llm)
    yield made
    await made.aclose()
