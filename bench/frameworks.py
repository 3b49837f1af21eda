"""Caller Memory's Pipecat drop-in against Pipecat's own Mem0 memory service, side by side (issue 16).

    python bench/frameworks.py            # about 2 minutes: 5 calls of 10 turns per configuration
    python bench/frameworks.py --quick    # about a minute: 2 calls per configuration
    python bench/frameworks.py --smoke    # seconds: 1 call of 3 turns; checks the script only

It needs ``pipecat-ai[mem0]==1.14.0`` in the Python that runs it (bench/requirements.txt; ``--sides
none,caller-memory`` runs without mem0ai). ``--help`` works without either.

Every side is the same real Pipecat pipeline, in a process of its own, run by ``PipelineWorker`` and
``WorkerRunner``: user context aggregator -> the memory processor -> ``OpenAILLMService`` (pointed at the
loopback fake model of tests/support/fake_llm.py, which answers at once) -> assistant aggregator. A turn is a
``UserStartedSpeakingFrame`` (the caller starts talking), ``--lead`` seconds of speech (0.3 s), then the
caller's words as ``LLMMessagesAppendFrame(run_llm=True)``; a call is 10 turns, then the bot hangs up
(``EndFrame``) or the caller does (``worker.cancel()``: a ``CancelFrame``), in turn. One uncounted warm-up call
first. The sides:

- ``none``: no memory processor; the baseline of "latency added".
- ``caller-memory``: ``caller_memory.sdk.pipecat.CallerMemory`` with the SDK's defaults (read budget
  150 ms, transcript on), the real service (``python -m caller_memory.service serve``, SQLite) behind a
  loopback proxy that holds every answer back ``--delay`` (100 ms): memory reads, the conversation's start,
  transcript batches, the end. Two configurations, in alternate calls: ``prefetch`` (the default: the read
  starts at the ``UserStartedSpeakingFrame``) and ``no-prefetch`` (``prefetch=False``: it starts at the
  inference). Both read at the pipeline's start (the greeting's read), which the first turn takes.
- ``mem0``: ``pipecat.services.mem0.Mem0MemoryService`` as documented (``api_key``, ``host``, ``user_id``),
  with the Mem0 platform replaced at the network boundary: ``host`` is a loopback stub that holds every answer
  back ``--delay`` too and answers ``GET /v1/ping/`` (the API-key check the client's constructor makes),
  ``POST /v3/memories/search/`` (3 memories) and ``POST /v3/memories/add/``; everything above the socket (the
  ``mem0ai`` ``MemoryClient``, its sync httpx client in ``asyncio.to_thread``, Pipecat's service) is real.
  ``MEM0_TELEMETRY=false`` (no PostHog client is made) and ``MEM0_DIR`` a temporary directory.

Measured per configuration: the context's messages after the last turn (and how many are memory messages),
what the model was sent in the last turn, each turn's latency from the moment its frame is queued to the moment
the fake model has the request, at p50/p99 and minus the ``none`` side's ("added"), how many turns had memory,
what was sent to the memory service, and the end of the call: the hang-up to ``runner.run()`` returning, the
requests to the memory service still unanswered then, and for caller-memory ``memory.finished()``. Results:
bench/results/frameworks.json (every turn, machine, load average at start and end, versions, settings) and
the tables on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "frameworks.json"
PROJECT = "bench-frameworks"
#: A documented example number (555-01xx): never a real caller.
CALLER = "+14155550142"
MEMORY_FIELDS = {"caller_name": "Ada", "favourite_cheese": "Wensleydale", "last_order": "two cheddars"}
#: What the Mem0 stub's search answers: the same three facts, as Mem0 memories.
MEM0_MEMORIES = ["Name is Ada", "Favourite cheese is Wensleydale", "Last order was two cheddars"]
CHEESES = [
    "brie",
    "gouda",
    "stilton",
    "comte",
    "feta",
    "manchego",
    "gruyere",
    "roquefort",
    "cheddar",
    "halloumi",
]
SYSTEM = "You answer the phone for a cheese shop."
SIDES = ("none", "caller-memory", "mem0")
#: How long after the runner returned a request to the memory service may still come, before it counts as
#: never sent.
GRACE = 0.5
#: The configurations of each side, run in alternate calls within its process.
CONFIGS = {"none": ["none"], "caller-memory": ["prefetch", "no-prefetch"], "mem0": ["mem0"]}
LABELS = {
    "none": "none (no memory)",
    "prefetch": "caller-memory, prefetch",
    "no-prefetch": "caller-memory, no prefetch",
    "mem0": "mem0 (Pipecat's Mem0MemoryService)",
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# The memory backends: the delaying proxy and the Mem0 stub (processes of their own) ------------------------


def route_of(method: str, path: str) -> str:
    """A request's kind, without the caller's number or the conversation id that its path holds."""
    for pattern, name in (
        (r"/callers/[^/]+/memory$", "memory read"),
        (r"/conversations/[^/]+/start$", "start"),
        (r"/conversations/[^/]+/messages$", "transcript batch"),
        (r"/conversations/[^/]+/end$", "end"),
        (r"/v1/ping/?$", "ping"),
        (r"/v3/memories/search/?$", "search"),
        (r"/v3/memories/add/?$", "add"),
    ):
        if re.search(pattern, path):
            return name
    return f"{method} other"


def serve_backend(port: int, delay: float, target: str | None) -> None:
    """An aiohttp server on loopback that holds every answer back ``delay`` seconds: a proxy to ``target``
    (the Caller Memory service), or without one the Mem0 stub. ``GET /_bench/hits`` lists what it was asked
    (kind, bytes, messages in the body, monotonic times received and answered: comparable across processes on
    Linux); ``POST /_bench/reset`` forgets it."""
    import aiohttp
    from aiohttp import web

    hits: list[dict[str, Any]] = []
    session: list[aiohttp.ClientSession] = []

    async def bench_route(request: web.Request) -> web.Response:
        if request.method == "POST":
            hits.clear()
        return web.json_response(hits)

    async def mem0_answer(kind: str) -> web.Response:
        if kind == "ping":
            return web.json_response({"org_id": "org-bench", "project_id": "proj-bench", "user_email": None})
        if kind == "search":
            found = [{"id": f"m{i}", "memory": text, "score": 0.9} for i, text in enumerate(MEM0_MEMORIES)]
            return web.json_response({"results": found})
        if kind == "add":
            return web.json_response({"status": "PENDING", "event_id": secrets.token_hex(8)})
        return web.json_response({"detail": "not stubbed"}, status=404)

    async def handle(request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        body = await request.read()
        kind = route_of(request.method, request.path)
        hit: dict[str, Any] = {"kind": kind, "bytes": len(body), "received": received, "answered": None}
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            listed = json.loads(body).get("messages") if body else None
            hit["messages"] = len(listed) if isinstance(listed, list) else None
        hits.append(hit)
        await asyncio.sleep(delay)
        if target is None:
            response = await mem0_answer(kind)
        else:
            headers = {
                k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
            }
            async with session[0].request(
                request.method, target + request.raw_path, headers=headers, data=body
            ) as resp:
                kept = ("Content-Type", "ETag", "Idempotent-Replayed", "Retry-After")
                response = web.Response(
                    status=resp.status,
                    body=await resp.read(),
                    headers={k: resp.headers[k] for k in kept if k in resp.headers},
                )
        hit["status"] = response.status
        hit["answered"] = time.monotonic()
        return response

    async def open_session(app: web.Application) -> None:
        session.append(aiohttp.ClientSession())

    async def close_session(app: web.Application) -> None:
        await session[0].close()

    app = web.Application(client_max_size=16 << 20)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/_bench/hits", bench_route)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, shutdown_timeout=1.0)


# One side: a process with Pipecat ----------------------------------------------------------------------------


def _masked(text: str) -> str:
    return re.sub(r"\d(?:[\s\-().]*\d){6,}", "[digits]", text)[:300]


class Side:
    """The pipelines of one side, its fake model and (caller-memory) its SDK client."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.side: str = spec["side"]
        self.arrivals: list[float] = []  # when the fake model got each request (perf_counter)
        self.warnings: list[str] = []
        self.client: Any = None
        self.fake: Any = None

    def reply(self, messages: list[dict[str, Any]]) -> Any:
        from tests.support.fake_llm import Reply

        self.arrivals.append(time.perf_counter())
        return Reply(["Noted, ", "we have that."])

    async def backend(self, method: str) -> list[dict[str, Any]]:
        import aiohttp

        if not self.spec["backend"]:  # the side without memory
            return []
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.spec["backend"] + "/_bench/hits") as resp,
        ):
            hits: list[dict[str, Any]] = await resp.json()
            return hits

    async def quiet_backend(self, returned: float, limit: float = 5.0) -> list[dict[str, Any]]:
        """The backend's requests of this call, once none is in flight (or ``limit`` seconds passed), and not
        before ``GRACE`` after the runner returned: what has not even been sent by then counts as never sent."""
        await asyncio.sleep(max(0.0, returned + GRACE - time.monotonic()))
        deadline = time.monotonic() + limit
        while True:
            hits = await self.backend("GET")
            if all(h["answered"] is not None for h in hits) or time.monotonic() > deadline:
                return hits
            await asyncio.sleep(0.05)

    def processor(self, config: str, conversation_id: str) -> tuple[Any, float]:
        """The memory processor of a configuration, and how long building it took (the Mem0 client's
        constructor makes a blocking request)."""
        started = time.perf_counter()
        if config in ("prefetch", "no-prefetch"):
            from caller_memory.sdk.pipecat import CallerMemory

            made: Any = CallerMemory(self.client, conversation_id, CALLER, prefetch=config == "prefetch")
        elif config == "mem0":
            from pipecat.services.mem0.memory import Mem0MemoryService

            made = Mem0MemoryService(
                api_key="m0-bench-key", host=self.spec["backend"], user_id="bench-caller"
            )
        else:
            made = None
        return made, time.perf_counter() - started

    async def call(self, config: str, index: int, turns: int, hang_up: str) -> dict[str, Any]:
        from pipecat.frames.frames import EndFrame, LLMMessagesAppendFrame, UserStartedSpeakingFrame
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.worker import PipelineWorker
        from pipecat.processors.aggregators.llm_context import LLMContext
        from pipecat.processors.aggregators.llm_response_universal import (
            LLMContextAggregatorPair,
            LLMUserAggregatorParams,
        )
        from pipecat.services.openai.llm import OpenAILLMService
        from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
        from pipecat.workers.runner import WorkerRunner

        await self.backend("POST")
        conversation_id = f"bench-{config}-{index}-{secrets.token_hex(4)}"
        memory, built = self.processor(config, conversation_id)
        llm = OpenAILLMService(
            api_key="sk-bench",
            base_url=self.fake.base_url,
            settings=OpenAILLMService.Settings(model="bench-model", system_instruction=SYSTEM),
        )
        context = LLMContext()
        pair = LLMContextAggregatorPair(
            context, user_params=LLMUserAggregatorParams(user_turn_strategies=ExternalUserTurnStrategies())
        )
        processors = [pair.user(), *([memory] if memory is not None else []), llm, pair.assistant()]
        worker = PipelineWorker(
            Pipeline(processors), enable_rtvi=False, idle_timeout_secs=None, cancel_timeout_secs=5
        )
        replies: asyncio.Queue[str] = asyncio.Queue()
        started = asyncio.Event()

        @pair.assistant().event_handler("on_assistant_turn_stopped")
        async def said(aggregator: Any, message: Any) -> None:
            await replies.put(message.content)

        @worker.event_handler("on_pipeline_started")
        async def on_started(worker: Any, frame: Any) -> None:
            started.set()

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        run = asyncio.create_task(runner.run())
        await asyncio.wait_for(started.wait(), 10)
        records = []
        for turn in range(turns):
            await worker.queue_frame(UserStartedSpeakingFrame())
            await asyncio.sleep(self.spec["lead"])
            before = (len(self.arrivals), sum(1 for m in context.messages if _is_memory(m)))
            text = f"Turn {turn + 1}: do you have any {CHEESES[turn % len(CHEESES)]} today?"
            queued = time.perf_counter()
            await worker.queue_frame(
                LLMMessagesAppendFrame(messages=[{"role": "user", "content": text}], run_llm=True)
            )
            await asyncio.wait_for(replies.get(), 15)
            records.append(self.turn_record(turn, queued, before, memory, context))
        hung_up = time.monotonic()
        if hang_up == "bot":
            await worker.queue_frame(EndFrame())
        else:
            await worker.cancel(reason="the caller hung up")
        await asyncio.wait_for(run, 30)
        returned = time.monotonic()
        end: dict[str, Any] = {"hang_up": hang_up, "hang_up_to_runner_ms": (returned - hung_up) * 1000}
        end["turns"] = turns
        if config in ("prefetch", "no-prefetch"):
            result = await asyncio.wait_for(memory.finished(), 30)
            end["runner_to_finished_ms"] = (time.monotonic() - returned) * 1000
            end["ended_by"] = memory.ended_by
            end["end_result"] = None if result is None else {"queued": result.queued, "late": result.late}
        await llm._client.close()  # Pipecat never closes its AsyncOpenAI client
        hits = await self.quiet_backend(returned)
        end.update(backend_at_return(hits, returned))
        spoken = sum(
            1 for m in context.messages if isinstance(m, dict) and m.get("role") in ("user", "assistant")
        )
        end["conversation_messages"] = spoken
        if config == "mem0":  # Mem0 gets the history at each inference: never the last answer
            end["adds_sent"] = sum(1 for h in hits if h["kind"] == "add")
            end["most_messages_in_an_add"] = max(
                (h.get("messages") or 0 for h in hits if h["kind"] == "add"), default=0
            )
        if config in ("prefetch", "no-prefetch"):
            end["stored_transcript_messages"] = await self.stored_messages(conversation_id)
        return {
            "config": config,
            "constructor_ms": built * 1000,
            "turns": records,
            "llm_requests": len(self.arrivals),
            "context_messages": len(context.messages),
            "memory_messages": sum(1 for m in context.messages if _is_memory(m)),
            "last_request": last_request(self.fake.requests[-1]),
            "backend": backend_summary(hits),
            "end": end,
        }

    def turn_record(
        self, turn: int, queued: float, before: tuple[int, int], memory: Any, context: Any
    ) -> dict[str, Any]:
        requests, memory_before = before
        arrived = self.arrivals[requests] if len(self.arrivals) > requests else float("nan")
        record: dict[str, Any] = {"turn": turn + 1, "latency_ms": (arrived - queued) * 1000}
        record["llm_requests"] = len(self.arrivals) - requests
        record["memory_messages"] = sum(1 for m in context.messages if _is_memory(m))
        conv = getattr(memory, "conv", None)
        if conv is not None:
            got = conv.memory
            record["memory"] = "stale" if got.stale else ("fresh" if got.available else "none")
            record["held_ms"] = memory.turn_waits[-1] * 1000 if memory.turn_waits else None
        elif self.side == "mem0":
            # Mem0MemoryService adds a message when its search found memories, and nothing when it failed.
            record["memory"] = "fresh" if record["memory_messages"] > memory_before else "none"
        return record

    async def stored_messages(self, conversation_id: str) -> dict[str, int] | None:
        import aiohttp

        url = f"{self.spec['service']}/v1/projects/{PROJECT}/conversations/{conversation_id}/history"
        headers = {"Authorization": f"Bearer {self.spec['admin_token']}"}
        async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
            if resp.status != 200:
                return None
            roles: dict[str, int] = {}
            for message in (await resp.json())["contents"]:
                roles[message["role"]] = roles.get(message["role"], 0) + 1
            return roles

    async def run(self) -> dict[str, Any]:
        from tests.support.fake_llm import FakeLLM

        spec = self.spec
        calls: list[dict[str, Any]] = []
        async with FakeLLM(reply=self.reply) as fake, contextlib.AsyncExitStack() as stack:
            self.fake = fake
            if self.side == "caller-memory":
                from caller_memory.sdk import MemoryClient

                self.client = await stack.enter_async_context(
                    MemoryClient(
                        spec["backend"],
                        token=spec["agent_token"],
                        project=PROJECT,
                        outbox_path=Path(spec["work"]) / "outbox.db",
                    )
                )
            configs = CONFIGS[self.side]
            await self.call(configs[0], 0, 2, "bot")  # warm-up: imports, first connections, the store
            for index in range(spec["calls"]):
                for config in configs:
                    self.arrivals.clear()
                    fake.requests.clear()
                    hang_up = "bot" if index % 2 == 0 else "caller"
                    calls.append(await self.call(config, index + 1, spec["turns"], hang_up))
        return {"calls": calls, "warnings": self.warnings[:20], "versions": versions()}


def _is_memory(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "developer"


def last_request(body: dict[str, Any]) -> dict[str, Any]:
    messages = body.get("messages", [])
    return {
        "messages": len(messages),
        "memory_messages": sum(1 for m in messages if _is_memory(m)),
        "bytes": len(json.dumps(messages)),
    }


def backend_summary(hits: list[dict[str, Any]]) -> dict[str, Any]:
    kinds: dict[str, dict[str, Any]] = {}
    for hit in hits:
        kind = kinds.setdefault(hit["kind"], {"requests": 0, "bytes": 0, "max_messages": 0})
        kind["requests"] += 1
        kind["bytes"] += hit["bytes"]
        kind["max_messages"] = max(kind["max_messages"], hit.get("messages") or 0)
    return kinds


def backend_at_return(hits: list[dict[str, Any]], returned: float) -> dict[str, Any]:
    """What the memory service had been asked when ``runner.run()`` returned, and after."""
    pending = [h for h in hits if h["received"] <= returned and (h["answered"] or 1e18) > returned]
    after = [h for h in hits if h["received"] > returned]
    answered = [h["answered"] for h in hits if h["answered"] is not None]
    last = max(answered) if answered else returned
    return {
        "unanswered_at_return": sorted(h["kind"] for h in pending),
        "sent_after_return": sorted(h["kind"] for h in after),
        "never_answered": sum(1 for h in hits if h["answered"] is None),
        "last_answer_after_return_ms": max(0.0, (last - returned) * 1000),
    }


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("pipecat-ai", "mem0ai", "openai", "httpx", "aiohttp", "caller-memory"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def side_main(spec_path: Path, out: Path) -> None:
    spec = json.loads(spec_path.read_text())
    # Before any import of Pipecat or mem0: both read these once.
    os.environ["MEM0_TELEMETRY"] = "false"
    os.environ["MEM0_DIR"] = str(Path(spec["work"]) / "mem0")
    os.environ["PIPECAT_LOG_LLM_CONTEXT"] = "off"  # every side alike (the drop-in sets it anyway)
    sys.path.insert(0, str(ROOT))
    from loguru import logger

    side = Side(spec)
    logger.remove()  # Pipecat's default sink writes every DEBUG line to stderr
    logger.add(lambda m: side.warnings.append(_masked(str(m).strip())), level="WARNING")
    result = asyncio.run(side.run())
    if spec["side"] == "mem0":
        from mem0.memory.telemetry import client_telemetry

        result["mem0_telemetry_client"] = client_telemetry.posthog is not None
    out.write_text(json.dumps(result))


# The run: the service, the backends, a process per side ---------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def code_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=ROOT, check=False
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "sdk", "service")),
    }


def prepare_service(h: Any, work: Path) -> tuple[Any, str, str]:
    """The service on SQLite, a project with conversation memory and the caller's three fields."""
    service = h.start_service(
        "service-sqlite", f"sqlite:///{work}/memory.db", work, secrets.token_urlsafe(32).encode(), None
    )
    config = {
        "memory": {
            "repeat_caller": {
                "state_keys": list(MEMORY_FIELDS),
                "retention": "P30D",
                "default_region": "US",
                "analytics_enabled": True,
            },
            "conversation": {"enabled": True},
        }
    }
    status, body = h.http("PUT", f"{service.url}/v1/projects/{PROJECT}", h.OPERATOR_TOKEN, config)
    if status not in (200, 201):
        raise RuntimeError(f"creating the project failed: {status} {body}")
    tokens = {}
    for role in ("agent", "admin"):
        status, body = h.http(
            "POST", f"{service.url}/v1/projects/{PROJECT}/tokens", h.OPERATOR_TOKEN, {"role": role}
        )
        if status != 201:
            raise RuntimeError(f"minting a token failed: {status} {body}")
        tokens[role] = body["token"]
    url = f"{service.url}/v1/projects/{PROJECT}/callers/%2B{CALLER[1:]}/memory"
    status, body = h.http("PATCH", url, tokens["admin"], MEMORY_FIELDS)
    if status != 200:
        raise RuntimeError(f"writing the caller's memory failed: {status} {body}")
    return service, tokens["agent"], tokens["admin"]


def start_backend(h: Any, name: str, work: Path, delay: float, target: str | None) -> str:
    port = h.free_port()
    cmd = [sys.executable, __file__, "--serve", name, "--port", str(port), "--delay", str(delay)]
    if target is not None:
        cmd += ["--target", target]
    log = work / f"{name}.log"
    proc = h.spawn(cmd, log=log)
    h.wait_http(f"http://127.0.0.1:{port}/_bench/hits", proc, log, 30.0)
    return f"http://127.0.0.1:{port}"


def run_side(side: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    spec_path, out = work / f"{side}.spec.json", work / f"{side}.result.json"
    spec_path.write_text(json.dumps({**spec, "side": side}))
    cmd = [sys.executable, __file__, "--side", str(spec_path), "--out", str(out)]
    started = time.perf_counter()
    with (work / f"{side}.log").open("wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600, check=False, cwd=work)
    if proc.returncode != 0:
        raise RuntimeError(f"side {side} failed:\n{(work / f'{side}.log').read_text()[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summarize(sides: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for side, result in sides.items():
        for config in CONFIGS[side]:
            calls = [c for c in result["calls"] if c["config"] == config]
            latencies = [t["latency_ms"] for c in calls for t in c["turns"]]
            memory = [t.get("memory") for c in calls for t in c["turns"]]
            ends = [c["end"] for c in calls]
            summary[config] = {
                "side": side,
                "calls": len(calls),
                "turns": len(latencies),
                "p50_ms": percentile(latencies, 50),
                "p99_ms": percentile(latencies, 99),
                "max_ms": max(latencies),
                "context_messages": statistics.median(c["context_messages"] for c in calls),
                "memory_messages": statistics.median(c["memory_messages"] for c in calls),
                "last_request": calls[-1]["last_request"],
                "turn_memory": {k: memory.count(k) for k in sorted({m for m in memory if m is not None})},
                "turns_without_memory": sorted(
                    {t["turn"] for c in calls for t in c["turns"] if t.get("memory") in ("none", "stale")}
                ),
                "backend_per_call": calls[-1]["backend"],
                "llm_requests_per_call": [c["llm_requests"] for c in calls],
                "constructor_ms_max": max(c["constructor_ms"] for c in calls),
                "ends": ends,
            }
    base = summary.get("none")
    for row in summary.values():
        if base is not None:
            row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
            row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
            # The baseline's own tail is a few outliers in 50 turns (a scheduler hiccup shows there as a
            # negative "added p99"): the tail against the baseline's typical turn too.
            row["p99_minus_none_p50_ms"] = row["p99_ms"] - base["p50_ms"]
    return summary


def report(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    lines = [
        f"{settings['calls']} calls of {settings['turns']} turns per configuration; memory service answers "
        f"held back {settings['delay'] * 1000:.0f} ms; the caller speaks {settings['lead'] * 1000:.0f} ms "
        "before each turn's frame",
        "",
        f"{'configuration':36} {'ctx msgs':>8} {'memory':>6} {'p50 ms':>7} {'p99 ms':>7} {'added p50':>9} "
        f"{'added p99':>9}  turns with memory",
    ]
    for config, row in summary.items():
        added = f"{'-':>9} {'-':>9}"
        if "added_p50_ms" in row and config != "none":
            added = f"{row['added_p50_ms']:9.1f} {row['added_p99_ms']:9.1f}"
        memory = ", ".join(f"{k} {v}" for k, v in row["turn_memory"].items()) or "-"
        lines.append(
            f"{LABELS[config]:36} {row['context_messages']:8.0f} {row['memory_messages']:6.0f} "
            f"{row['p50_ms']:7.1f} {row['p99_ms']:7.1f} {added}  {memory}/{row['turns']}"
        )
    for config, row in summary.items():
        if row["turns_without_memory"]:
            turns = ", ".join(map(str, row["turns_without_memory"]))
            lines.append(f"  {LABELS[config]}: turns that had no fresh memory in some call: {turns}")
    lines += ["", "What the memory service was sent in one call (the last), and the end of the call:"]
    for config, row in summary.items():
        if config == "none":
            continue
        sent = ", ".join(
            f"{kind} {v['requests']}x {v['bytes'] / 1024:.1f} KiB"
            for kind, v in sorted(row["backend_per_call"].items())
        )
        lines.append(
            f"  {LABELS[config]}: {sent}; building the processor took up to {row['constructor_ms_max']:.0f} ms"
        )
        for end in row["ends"]:
            lines.append("    " + end_line(end))
    return "\n".join(lines)


def end_line(end: dict[str, Any]) -> str:
    text = f"{end['hang_up']} hangs up: runner returned after {end['hang_up_to_runner_ms']:.0f} ms"
    unanswered = end["unanswered_at_return"]
    text += f"; unanswered then: {', '.join(unanswered) if unanswered else 'none'}"
    if end["sent_after_return"]:
        text += f"; sent after: {', '.join(end['sent_after_return'])}"
    if "runner_to_finished_ms" in end:
        text += f"; finished() {end['runner_to_finished_ms']:.0f} ms later"
        text += f", transcript stored {end.get('stored_transcript_messages')}"
    if "adds_sent" in end:
        text += f"; {end['adds_sent']} adds for {end['turns']} turns"
    if "most_messages_in_an_add" in end:
        text += f"; adds carried at most {end['most_messages_in_an_add']} of {end['conversation_messages']} messages"
    text += f"; last answer {end['last_answer_after_return_ms']:.0f} ms after return"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 calls per configuration (about a minute)")
    parser.add_argument("--smoke", action="store_true", help="1 call of 3 turns: checks the script (seconds)")
    parser.add_argument("--calls", type=int, help="calls per configuration (default 5; --quick 2; --smoke 1)")
    parser.add_argument("--turns", type=int, help="turns per call (default 10; --smoke 3)")
    parser.add_argument(
        "--delay", type=float, default=0.1, help="seconds every memory answer is held back (0.1)"
    )
    parser.add_argument(
        "--lead", type=float, help="seconds the caller speaks before each turn (0.3; --smoke 0.05)"
    )
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument(
        "--output", type=Path, help=f"the JSON results (default {RESULTS}; --smoke: its temporary directory)"
    )
    parser.add_argument("--serve", choices=["proxy", "mem0-stub"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_backend(args.port, args.delay, args.target)
        return 0
    if args.side:
        side_main(args.side, args.out)
        return 0
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := set(sides) - set(SIDES):
        parser.error(f"unknown sides: {', '.join(sorted(unknown))}")
    for module, package, needed in (("pipecat", "pipecat-ai", True), ("mem0", "mem0ai", "mem0" in sides)):
        if needed and importlib.util.find_spec(module) is None:
            say(
                f"{package} is not installed in {sys.executable}: pip install -r bench/requirements.txt"
                + (" (or run --sides none,caller-memory)" if module == "mem0" else "")
            )
            return 2
    settings = {
        "calls": args.calls or (1 if args.smoke else 2 if args.quick else 5),
        "turns": args.turns or (3 if args.smoke else 10),
        "delay": args.delay,
        "lead": args.lead if args.lead is not None else (0.05 if args.smoke else 0.3),
        "sides": sides,
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "read_budget": 0.15,
    }
    return run(settings, args.output)


def run(settings: dict[str, Any], output: Path | None) -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    import harness as h

    machine = machine_info()
    work = Path(tempfile.mkdtemp(prefix="bench-frameworks-"))
    results: dict[str, Any] = {}
    try:
        say(f"starting the service, the proxy and the Mem0 stub in {work}")
        service, agent, admin = prepare_service(h, work)
        backends = {
            "caller-memory": start_backend(h, "proxy", work, settings["delay"], service.url),
            "mem0": start_backend(h, "mem0-stub", work, settings["delay"], None),
            "none": "",
        }
        for side in settings["sides"]:
            say(f"side {side}: {settings['calls']} calls per configuration ...")
            spec = {**settings, "work": str(work), "backend": backends[side], "service": service.url}
            spec.update(agent_token=agent, admin_token=admin)
            results[side] = run_side(side, spec, work)
            say(f"side {side}: {results[side]['wall_s']:.1f} s")
    finally:
        h.stop_all()
    machine["loadavg_end"] = os.getloadavg()
    summary = summarize(results)
    text = report(summary, settings)
    print(text)
    stubbed = (
        "mem0: the Mem0 platform API only (host= a loopback aiohttp stub): GET /v1/ping/ (the API-key check "
        "MemoryClient's constructor makes), POST /v3/memories/search/ (answers 3 memories), POST "
        "/v3/memories/add/ (answers PENDING), every answer held back `delay`; mem0ai's MemoryClient, its "
        "httpx client and Pipecat's Mem0MemoryService are real; MEM0_TELEMETRY=false, MEM0_DIR a temp dir"
    )
    document = {
        "what": "bench/frameworks.py: Pipecat pipelines with Caller Memory, with Pipecat's Mem0 service, and none",
        "settings": settings,
        "stubbed": stubbed,
        "machine": machine,
        "code": code_info(),
        "summary": summary,
        "sides": results,
        "table": text,
    }
    if output is None:  # a smoke run's figures mean nothing: they do not replace the results
        output = work / "frameworks.json" if settings["mode"] == "smoke" else RESULTS
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2, default=str) + "\n")
    say(f"results in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
