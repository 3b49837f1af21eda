"""When tracing is on and what it costs (SPEC section 18): off, our code imports no OpenTelemetry module (a
fresh process, the suite's own provider aside); on through the standard variables, the service exports to
a real collector on loopback; a collector that hangs or is down adds no latency, and the spans it could
not take are dropped, counted on /metrics, and do not hold the service's stop."""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.telemetry import SHUTDOWN_WAIT_S, Telemetry
from caller_memory.service.telemetry.setup import configured_provider
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace import SpanKind

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY, TEST_NUMBERS, canonical_digits, running_api
from tests.http.test_api import CALLER, CONFIG, memory_path
from tests.support.service_process import ServiceProcess, http

#: A script run in a fresh interpreter: the service built and asked, the SDK's read, then the OpenTelemetry
#: modules that our code brought in (what the libraries imported before it is left aside: the mcp SDK imports
#: the API itself).
PROBE = textwrap.dedent(
    """
    import asyncio, importlib, json, sys, tempfile

    if sys.argv[1] == "blocked":  # as if the otel extra were not installed: its SDK and exporter (the API
        # comes with the mcp SDK, a dependency of the service)
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
                    raise ImportError(f"No module named {name!r}")
        sys.meta_path.insert(0, Blocker())

    for library in ("aiohttp", "redis", "pydantic", "apscheduler", "prometheus_client", "mcp"):
        try:  # the mcp SDK imports the API itself: what it brings is left aside
            importlib.import_module(library)
        except ImportError:
            pass
    before = {m for m in sys.modules if m.split(".")[0] == "opentelemetry"}

    import aiohttp
    from aiohttp import web
    from caller_memory.sdk import MemoryClient
    from caller_memory.service.app import create_app
    from caller_memory.service.config import Settings
    from caller_memory.service.http.app_keys import TELEMETRY

    async def main():
        folder = tempfile.mkdtemp()
        settings = Settings(pseudonym_key=b"k" * 40, store_url=f"sqlite:///{folder}/m.db", operator_token="o" * 20)
        app = create_app(settings)
        print("tracing on:", app[TELEMETRY].on, file=sys.stderr)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        auth = {"Authorization": "Bearer " + "o" * 20}
        async with aiohttp.ClientSession() as session:
            doc = {"memory": {"repeat_caller": {"state_keys": ["day"]}}}
            async with session.put(url + "/v1/projects/shop", json=doc, headers=auth) as reply:
                assert reply.status == 201, reply.status
            async with session.post(url + "/v1/projects/shop/tokens", json={"role": "agent"}, headers=auth) as r:
                token = (await r.json())["token"]
        async with MemoryClient(url, token=token, project="shop", outbox_path=folder + "/o.db") as client:
            memory = await client.read_memory("+14155550100")
            assert memory.available, memory.reason
        await runner.cleanup()

    asyncio.run(main())
    after = {m for m in sys.modules if m.split(".")[0] == "opentelemetry"}
    print(json.dumps(sorted(after - before)))
    """
)


def probe(mode: str, **env: str) -> tuple[list[str], str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    # The last line of the probe's own (the console exporter prints spans on stdout too).
    last = next(line for line in reversed(done.stdout.splitlines()) if line.startswith("["))
    return json.loads(last), done.stderr


def test_off_our_code_imports_no_opentelemetry_module() -> None:
    imported, stderr = probe("installed")
    assert imported == [] and "tracing on: False" in stderr


def test_without_the_extra_an_exporter_asked_for_leaves_tracing_off_with_a_warning() -> None:
    imported, stderr = probe("blocked", OTEL_TRACES_EXPORTER="otlp")
    assert imported == [] and "tracing on: False" in stderr
    assert "the 'otel' extra" in stderr


def test_an_exporter_the_service_does_not_ship_leaves_tracing_off_with_a_warning() -> None:
    _, stderr = probe("installed", OTEL_TRACES_EXPORTER="zipkin")  # the probe's reads answer as ever
    assert "'zipkin', which this service does not ship" in stderr and "tracing on: False" in stderr


def test_an_exporter_asked_for_turns_tracing_on() -> None:
    _, stderr = probe("installed", OTEL_TRACES_EXPORTER="console")
    assert "tracing on: True" in stderr


def test_otel_sdk_disabled_wins_over_an_exporter() -> None:
    imported, stderr = probe("installed", OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert imported == [] and "tracing on: False" in stderr
    assert '"name"' not in stderr  # the console exporter would print each span


# A collector on loopback ------------------------------------------------------------------------------------


class Collector:
    """An OTLP/HTTP collector on loopback: keeps the spans it is sent (``hang``: never answers)."""

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self.requests: list[ExportTraceServiceRequest] = []
        self.bodies: list[bytes] = []
        self.received = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies.append(body)
        self.received.set()
        if self.hang:
            await asyncio.sleep(3600)
        parsed = ExportTraceServiceRequest()
        parsed.ParseFromString(body)
        self.requests.append(parsed)
        return web.Response(body=b"", content_type="application/x-protobuf")

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) of every span received."""
        found = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                found += [(resource, s) for scope in resource_spans.scope_spans for s in scope.spans]
        return found

    async def __aenter__(self) -> Collector:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    async with Collector() as found:
        yield found


async def test_the_service_exports_to_a_collector_named_by_the_standard_variables(
    collector: Collector, tmp_path: Path
) -> None:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    with ServiceProcess(f"sqlite:///{tmp_path}/m.db", tmp_path, env=env) as service:
        http("PUT", f"{service.url}/v1/projects/shop", OPERATOR_TOKEN, {"memory": {"repeat_caller": CONFIG}})
        token = http("POST", f"{service.url}/v1/projects/shop/tokens", OPERATOR_TOKEN, {"role": "agent"})[
            "token"
        ]
        http("GET", service.url + memory_path("shop"), token)
        deadline = time.monotonic() + 10
        while not any(s.name.startswith("GET /v1/projects") for _, s in collector.spans()):
            assert time.monotonic() < deadline, "no span reached the collector"
            await asyncio.sleep(0.05)
    spans = collector.spans()
    assert {resource["service.name"] for resource, _ in spans} == {"caller-memory"}
    names = {s.name for _, s in spans}
    assert {"GET /v1/projects/{project}/callers/{identifier}/memory", "store read_fields"} <= names
    everything = b"".join(collector.bodies).decode("latin-1")
    assert not TEST_NUMBERS.search(canonical_digits(everything)) and CALLER[1:] not in everything
    assert token not in everything and PSEUDONYM_KEY.decode() not in everything


async def reads(api: Any, token: str, count: int) -> list[float]:
    took = []
    for _ in range(count):
        began = time.perf_counter()
        reply = await api.call("GET", memory_path("shop"), token=token)
        took.append(time.perf_counter() - began)
        assert reply.status == 200
    return took


@pytest.mark.parametrize("collector_state", ["hangs", "is down"])
async def test_a_collector_that_hangs_or_is_down_adds_no_latency_and_drops_are_counted(
    collector_state: str, tmp_path: Path
) -> None:
    async with Collector(hang=True) as hung:
        if collector_state == "is down":
            await hung.__aexit__()  # its port is closed now: every export is refused
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": hung.url,
            "OTEL_EXPORTER_OTLP_TIMEOUT": "5",
            "OTEL_BSP_MAX_QUEUE_SIZE": "16",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
            "OTEL_BSP_SCHEDULE_DELAY": "5",
        }
        tracing = Telemetry.with_provider(*configured_provider(env, ["otlp"]))
        assert tracing.roots is not None  # parentbased_always_on, the default: every request sampled
        clock = FakeClock()
        url = f"sqlite:///{tmp_path}/traced.db"
        async with running_api(url, clock, telemetry=tracing) as traced:
            tokens = await traced.project_with_tokens("shop", CONFIG)
            with_collector = await reads(traced, tokens["agent"], 300)
            metrics = await traced.call("GET", "/metrics")
            stopping = time.monotonic()
        stopped = time.monotonic() - stopping
        async with running_api(f"sqlite:///{tmp_path}/plain.db", clock, telemetry=Telemetry.off()) as plain:
            tokens = await plain.project_with_tokens("shop", CONFIG)
            without = await reads(plain, tokens["agent"], 300)
        if collector_state == "hangs":
            assert hung.received.is_set()  # the exporter did reach it, and waits for an answer
            await hung.__aexit__()
    dropped = next(
        float(line.split()[-1])
        for line in metrics.body.splitlines()
        if line.startswith("caller_memory_spans_dropped_total")
    )
    assert dropped > 0
    # The same reads, the same process, side by side: the median within noise, no read held by an export.
    assert statistics.median(with_collector) < statistics.median(without) * 1.5 + 0.001
    assert max(with_collector) < 0.25
    assert stopped < SHUTDOWN_WAIT_S + 1.0


async def test_a_request_that_starts_a_trace_is_sampled_at_the_ratio_before_any_span_is_made(
    tmp_path: Path,
) -> None:
    env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    provider, dropped, used, roots = configured_provider(env, [])
    assert roots is not None and used == []
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Telemetry.with_provider(provider, dropped, used, roots)
    async with running_api(f"sqlite:///{tmp_path}/m.db", FakeClock(), telemetry=tracing) as api:
        tokens = await api.project_with_tokens("shop", CONFIG)
        exporter.clear()
        await reads(api, tokens["agent"], 400)
        servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        stores = [s for s in exporter.get_finished_spans() if s.name == "store read_fields"]
        # 25% of 400: 100, with a standard deviation of 8.7.
        assert 60 <= len(servers) <= 140 and len(stores) == len(servers)
        # Each was sampled on the trace id it carries, by the SDK's own rule (so the provider's sampler,
        # which decides again when the span is made, agreed).
        bound = TraceIdRatioBased.get_bound_for_rate(0.25)
        assert all((s.context.trace_id & TraceIdRatioBased.TRACE_ID_LIMIT) < bound for s in servers)
        assert len({s.context.trace_id for s in servers}) == len(servers)
        # A caller's decision is followed, whatever the ratio: sampled, a span; not sampled, none.
        exporter.clear()
        for flags in ("01", "00"):
            reply = await api.call(
                "GET",
                memory_path("shop"),
                token=tokens["agent"],
                headers={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-{flags}"},
            )
            assert reply.status == 200
        [followed] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        assert followed.context.trace_id == int("ab" * 16, 16) and followed.context.trace_flags.sampled


def test_samplers_of_another_package_are_left_to_the_sdk() -> None:
    assert configured_provider({"OTEL_TRACES_SAMPLER": "xray"}, [])[3] is None
    assert configured_provider({"OTEL_TRACES_SAMPLER": "always_off"}, [])[3] is not None
