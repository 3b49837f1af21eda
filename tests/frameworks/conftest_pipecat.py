"""What the Pipecat tests share: a real pipeline without a transport (the caller's speech goes in as the frames
an STT and a VAD would make), the real ``OpenAILLMService`` pointed at the loopback FakeLLM, a delaying or
failing proxy in front of the real service, and every loguru and std-logging line of a test kept to be
checked for phone numbers. Imported by test_pipecat.py (not a conftest.py: the frameworks' tests run in their
own processes and share nothing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from caller_memory.sdk.pipecat import CallerMemory
from loguru import logger

try:
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
except ImportError:  # Pipecat 1.13 (docs/frameworks.md, "Supported versions")
    from pipecat.adapters.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMMessagesAppendFrame,
    LLMRunFrame,
    LLMTextFrame,
    TranscriptionFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext, LLMStandardMessage
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
from pipecat.utils.time import time_now_iso8601
from pipecat.workers.runner import WorkerRunner

from tests.conftest import TEST_NUMBERS, canonical_digits

# Pipecat's default loguru sink writes everything at DEBUG to stderr: the tests keep their own sink instead.
logger.remove()


class Paced(FrameProcessor):
    """Stands in for TTS and the output transport: each LLM text frame takes ``seconds`` to "speak" (more than
    the model takes to stream it, so that text waits here, as it waits for speech on a call). An interruption
    then finds the assistant turn still open; without it the LLM's own end frame, pushed as its stream is
    cancelled, closes the turn first and the turn is not marked interrupted."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if self.seconds and isinstance(frame, LLMTextFrame) and direction == FrameDirection.DOWNSTREAM:
            await asyncio.sleep(self.seconds)
        await self.push_frame(frame, direction)


def make_llm(llm_url: str) -> OpenAILLMService:
    return OpenAILLMService(
        api_key="sk-fake",
        base_url=llm_url,
        settings=OpenAILLMService.Settings(
            model="fake-model", system_instruction="You answer the cheese shop."
        ),
    )


def make_context(memory: CallerMemory) -> LLMContext:
    return LLMContext(
        tools=ToolsSchema(
            standard_tools=[
                memory.state_tool("save_name", "Remember the caller's name.", {"name": "caller_name"})
            ]
        )
    )


def aggregators(context: LLMContext) -> LLMContextAggregatorPair:
    # External turn strategies: the turn ends with UserStoppedSpeakingFrame (no VAD, no smart-turn model).
    return LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(user_turn_strategies=ExternalUserTurnStrategies())
    )


@dataclass
class Call:
    """One call through a real pipeline: [user aggregator, CallerMemory, LLM, Paced, assistant aggregator]."""

    memory: CallerMemory
    llm: OpenAILLMService
    context: LLMContext
    worker: PipelineWorker
    replies: asyncio.Queue[tuple[str, bool]] = field(default_factory=asyncio.Queue)
    run: asyncio.Task[None] | None = None
    runner: WorkerRunner | None = None
    hung_up_at: float = 0.0
    runner_done_at: float = 0.0
    finished_at: float = 0.0

    @classmethod
    def build(cls, memory: CallerMemory, llm_url: str, *, pace: float = 0.0, tracing: bool = False) -> Call:
        llm = make_llm(llm_url)
        context = make_context(memory)
        pair = aggregators(context)
        pipeline = Pipeline([pair.user(), memory, llm, Paced(pace), pair.assistant()])
        worker = PipelineWorker(
            pipeline,
            enable_rtvi=False,
            idle_timeout_secs=None,
            params=PipelineParams(),
            cancel_timeout_secs=5,
            enable_tracing=tracing,  # Pipecat's own spans, on the test session's provider
        )
        call = cls(memory, llm, context, worker)
        LIVE.append(call)

        @pair.assistant().event_handler("on_assistant_turn_stopped")
        async def said(aggregator: Any, message: Any) -> None:
            if message.content:
                await call.replies.put((message.content, message.interrupted))

        return call

    async def start(self) -> None:
        started = asyncio.Event()

        @self.worker.event_handler("on_pipeline_started")
        async def on_started(worker: Any, frame: Any) -> None:
            started.set()

        self.runner = runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self.worker)
        self.run = asyncio.create_task(runner.run())
        await asyncio.wait_for(started.wait(), 10)

    async def reply(self) -> str:
        text, _ = await asyncio.wait_for(self.replies.get(), 10)
        return text

    async def greet(self) -> str:
        await self.worker.queue_frame(LLMRunFrame())
        return await self.reply()

    async def speak(self, text: str, *, interrupting: bool = False) -> None:
        """The caller says ``text``: the frames an STT and a VAD make (the read is prefetched at the first)."""
        frames: list[Frame] = [UserStartedSpeakingFrame()]
        if interrupting:
            frames.append(InterruptionFrame())
        await self.worker.queue_frames(frames)
        await asyncio.sleep(0.05)  # the caller talks for a moment
        await self.worker.queue_frames(
            [
                TranscriptionFrame(text=text, user_id="caller", timestamp=time_now_iso8601()),
                UserStoppedSpeakingFrame(),
            ]
        )

    async def says(self, text: str) -> str:
        await self.speak(text)
        return await self.reply()

    async def typed(self, text: str) -> str:
        """A turn with no speech frames at all (so no prefetch): the full read happens at the inference."""
        await self.worker.queue_frame(
            LLMMessagesAppendFrame(messages=[{"role": "user", "content": text}], run_llm=True)
        )
        return await self.reply()

    async def bot_hangs_up(self) -> None:
        self.hung_up_at = time.perf_counter()
        await self.worker.queue_frame(EndFrame())
        await self.done()

    async def caller_hangs_up(self) -> None:
        self.hung_up_at = time.perf_counter()
        await self.worker.cancel(reason="the caller hung up")
        await self.done()

    async def worker_shuts_down(self) -> None:
        """The runner is cancelled (what its SIGINT/SIGTERM handlers do on a worker's shutdown)."""
        assert self.runner is not None
        self.hung_up_at = time.perf_counter()
        await self.runner.cancel(reason="shutdown")
        await self.done()

    async def done(self) -> None:
        assert self.run is not None
        await asyncio.wait_for(self.run, 15)
        self.runner_done_at = time.perf_counter()
        await self.llm._client.close()  # Pipecat never closes its AsyncOpenAI client (a ResourceWarning)

    async def ended(self) -> Any:
        result = await asyncio.wait_for(self.memory.finished(), 15)
        self.finished_at = time.perf_counter()
        return result

    @property
    def developer_messages(self) -> list[LLMStandardMessage]:
        return [m for m in self.context.messages if isinstance(m, dict) and m.get("role") == "developer"]


#: The calls a test made: a test that fails mid-call leaves its pipeline running, and a running pipeline
#: keeps the event loop from closing (its tasks outlast the loop's own cancellation): see stop_calls.
LIVE: list[Call] = []


@pytest.fixture(autouse=True)
async def stop_calls() -> AsyncIterator[None]:
    yield
    while LIVE:
        call = LIVE.pop()
        if call.run is not None and not call.run.done() and call.runner is not None:
            await call.runner.cancel(reason="the test is over")
            await asyncio.wait_for(asyncio.shield(call.run), 10)
        await call.llm._client.close()


class SlowService:
    """A proxy in front of the real service: ``memory_delay`` holds memory reads back, ``end_delay`` the
    ends of conversations; ``down`` answers
    every request 503 at once (the service never sees it)."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.memory_delay = 0.0
        self.end_delay = 0.0
        self.down = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            return web.Response(status=503)
        if request.method == "GET" and request.path.endswith("/memory") and self.memory_delay:
            await asyncio.sleep(self.memory_delay)
        if request.method == "POST" and request.path.endswith("/end") and self.end_delay:
            await asyncio.sleep(self.end_delay)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.session.request(
            request.method, self.target + request.raw_path, headers=headers, data=await request.read()
        ) as resp:
            body = await resp.read()
            kept = ("Content-Type", "ETag", "Idempotent-Replayed", "Retry-After")
            return web.Response(
                status=resp.status, body=body, headers={k: resp.headers[k] for k in kept if k in resp.headers}
            )


@pytest.fixture
async def slow_service(api: Any) -> AsyncIterator[tuple[SlowService, str]]:
    async with aiohttp.ClientSession() as session:
        proxy = SlowService(api.base_url, session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield proxy, f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            proxy.memory_delay = 0.0
            await runner.cleanup()


class _StdLines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"std {record.name}: {record.getMessage()}")


def leaks(lines: list[str]) -> list[str]:
    """The lines with a test phone number in any form (+E.164, digits, national, percent-encoded)."""
    return [
        line for line in lines if TEST_NUMBERS.search(line) or TEST_NUMBERS.search(canonical_digits(line))
    ]


@pytest.fixture(autouse=True)
def every_log_line() -> Iterator[list[str]]:
    """Every loguru line (Pipecat's, at TRACE) and std-logging line (ours, the service's, uvicorn's, at
    DEBUG) of the test, as a sink would get it; none may hold a phone number."""
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(f"{m.record['name']}: {m.record['message']}"), level="TRACE")
    handler = _StdLines(lines)
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)
        logger.remove(sink)
    found = leaks(lines)
    assert found == [], f"phone numbers were logged: {found[:5]}"
