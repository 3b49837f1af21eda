"""Shared fixtures: a real HTTP server on a real socket, over a real SQLite file or a real redis-server."""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import re
import unicodedata
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from caller_memory.service.app import create_app
from caller_memory.service.config import Settings
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.http.access_log import RouteAccessLogger
from caller_memory.service.http.app_keys import METRICS
from caller_memory.service.http.middleware import Handler
from caller_memory.service.http.server import ConnectionGuard, ServiceRunner
from caller_memory.service.logs import MAX_RUN, SEPARATOR, unescaped
from caller_memory.service.telemetry import Telemetry
from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from tests.support.redis_cluster import RedisCluster
from tests.support.redis_server import RedisServer
from tests.support.spans import SpanInspector

OPERATOR_TOKEN = "operator-token-for-tests-0123456789"
PSEUDONYM_KEY = b"pseudonym-key-for-tests-0123456789abcdef"

BACKENDS = ["sqlite", "redis"]
#: The Redis Cluster backend: an extra parameter of the storage contract suite and the HTTP tests only.
CLUSTER = "redis-cluster"


#: The national numbers the tests use (any written form of them contains one of these digit runs).
TEST_NUMBERS = re.compile(r"415555\d{4}|7700900\d{3}|20794600\d\d|612345678|15112345678|44000000000")


def canonical_digits(text: str) -> str:
    """``text`` as a reader would see the numbers in it: escapes decoded, every Unicode digit as its ASCII
    digit, and the separators the service accepts inside a number removed, so that a number logged in any
    form it can be sent in (``%2B1%20415...``, ``+1/415/...``, full-width, Arabic-Indic) shows as a run of
    digits."""
    decoded = unescaped(text)
    digits = "".join(str(unicodedata.digit(c)) if c.isdigit() else c for c in decoded)
    return _BETWEEN_DIGITS.sub("", digits)


_BETWEEN_DIGITS = re.compile(r"(?<=\d)" + SEPARATOR + f"{{1,{MAX_RUN}}}" + r"(?=\d)")


#: A date and time as loggers write them (APScheduler's "Next wakeup is due at 2026-12-01 21:48:41.555504+00:00"):
#: the clock's, never a client's; with the separators removed its digits can spell anything (41.5555 did).
_LOGGED_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?")


class _Everything(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.leaks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        text = _LOGGED_TIME.sub("<time>", text)
        if TEST_NUMBERS.search(text) or TEST_NUMBERS.search(canonical_digits(text)):
            self.leaks.append(f"{record.name}: {text[:200]}")


@pytest.fixture(scope="session", autouse=True)
def no_number_in_any_log() -> Iterator[None]:
    """Every log record of the whole run, at every level, is checked for the test phone numbers."""
    handler = _Everything()
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield
    root.removeHandler(handler)
    root.setLevel(previous)
    assert handler.leaks == [], f"phone numbers were logged: {handler.leaks[:5]}"


@pytest.fixture(scope="session", autouse=True)
def no_identifier_in_any_span() -> Iterator[SpanInspector]:
    """A global tracer provider for the whole run (each pytest process: each xdist worker, each framework
    file's run), so that every app the tests build in-process traces (telemetry on, as an application's
    provider turns it on), and every SDK client sends ``traceparent``. Each span of our scopes and the mcp
    SDK's is inspected as it ends (tests/support/spans.py); at the end of the process, none may have held an
    identifier, a pseudonym, a value, a token or a URL. Tests of tracing that is off run in subprocesses."""
    inspector = SpanInspector(TEST_NUMBERS, canonical_digits)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(inspector)
    trace.set_tracer_provider(provider)
    yield inspector
    assert inspector.faults == [], f"spans held what they must not: {inspector.faults[:5]}"


#: What a test's code calls when it measures wall-clock time (a bound such as "within the read budget").
_WALL_CLOCK = ("perf_counter()", "monotonic()", "loop.time()")


def measures_wall_clock(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return any(call in source for call in _WALL_CLOCK)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that measures wall-clock time runs on a settled heap (see ``settled_heap``)."""
    for item in items:
        if measures_wall_clock(item) and "settled_heap" not in item.fixturenames:  # type: ignore[attr-defined]
            item.fixturenames.insert(0, "settled_heap")  # type: ignore[attr-defined]


@pytest.fixture
def settled_heap() -> Iterator[None]:
    """No pause of the collector over the test process's own heap inside a timed test: collect and freeze
    what earlier tests left, before the test; unfreeze after it.

    A pytest worker holds 300,000-500,000 objects late in the run, and a full collection of them took up to
    0.6 s on CI: a read measured across one took 0.87 s where its budget is 0.15 s, though the SDK kept to
    its budget (it cannot run while the collector holds the process). Frozen objects are not traversed, so a
    collection during the test sees only the test's own objects."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """One local Redis Cluster (3 primaries, 3 replicas) for the whole run, started on first use."""
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def empty_store_url(request: pytest.FixtureRequest, backend: str, tmp_path: Any) -> str:
    """The URL of an empty store of ``backend`` (a new SQLite file; a flushed Redis or Redis Cluster)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/memory.db"
    if backend == CLUSTER:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        return cluster.url
    server: RedisServer = request.getfixturevalue("redis_server")
    with server.client() as client:
        client.flushall()
    return server.url


@pytest.fixture(params=BACKENDS)
async def store_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return empty_store_url(request, request.param, tmp_path)


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: Any
    content_type: str


@dataclass
class Api:
    """A client of the real server, with the operator token at hand."""

    session: aiohttp.ClientSession
    base_url: str
    settings: Settings
    clock: FakeClock
    app: web.Application
    tokens: dict[str, str] = field(default_factory=dict)
    #: (method, route template, status) of every request the server handled, as seen by the server.
    requests: list[tuple[str, str, int]] = field(default_factory=list)

    def count(self, method: str, route_suffix: str, status: int | None = None) -> int:
        return sum(
            1
            for m, route, st in self.requests
            if m == method and route.endswith(route_suffix) and (status is None or st == status)
        )

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        json: Any = None,
        data: bytes | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        sent = dict(headers or {})
        if token is not None:
            sent.setdefault("Authorization", f"Bearer {token}")
        if json is not None:
            data = orjson.dumps(json)
            sent.setdefault("Content-Type", "application/json")
        async with self.session.request(method, self.base_url + path, data=data, headers=sent) as resp:
            raw = await resp.read()
            ctype = resp.content_type
            body: Any = orjson.loads(raw) if raw and ctype.endswith("json") else raw.decode()
            return Reply(resp.status, resp.headers.copy(), body, ctype)

    async def put_project(self, project: str, repeat_caller: dict[str, Any]) -> Reply:
        return await self.call(
            "PUT",
            f"/v1/projects/{project}",
            token=OPERATOR_TOKEN,
            json={"memory": {"repeat_caller": repeat_caller}},
        )

    async def mint(self, project: str, role: str) -> str:
        reply = await self.call(
            "POST", f"/v1/projects/{project}/tokens", token=OPERATOR_TOKEN, json={"role": role}
        )
        assert reply.status == 201, reply.body
        token: str = reply.body["token"]
        return token

    async def project_with_tokens(self, project: str, repeat_caller: dict[str, Any]) -> dict[str, str]:
        reply = await self.put_project(project, repeat_caller)
        assert reply.status in (200, 201), reply.body
        return {role: await self.mint(project, role) for role in ("agent", "analytics", "admin")}


@contextlib.asynccontextmanager
async def running_api(store_url: str, clock: FakeClock, **overrides: Any) -> AsyncIterator[Api]:
    """The service on a real socket (an ephemeral port) over ``store_url``, and a client for it. No webhook
    delivery worker unless ``webhook_interval`` is given (the webhook tests give it): the other tests,
    some of which time what they check, have nothing running beside their requests. ``telemetry``: the
    app's tracing (by default, the session's provider: on)."""
    telemetry: Telemetry | None = overrides.pop("telemetry", None)
    overrides.setdefault("webhook_interval", 0)
    settings = Settings(
        pseudonym_key=PSEUDONYM_KEY, store_url=store_url, operator_token=OPERATOR_TOKEN, **overrides
    )
    app = create_app(settings, clock=clock, telemetry=telemetry)
    seen: list[tuple[str, str, int]] = []

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "<unmatched>"
        response = await handler(request)  # outside the problem middleware: errors are responses here
        seen.append((request.method, route, response.status))
        return response

    app.middlewares.insert(0, record)
    # The production runner (the connection guard and its handling of requests aiohttp cannot parse), so the
    # in-process tests go through the same server code as `caller-memory serve`.
    guard = ConnectionGuard(
        header_timeout=settings.header_timeout, max_connections=settings.max_connections, metrics=app[METRICS]
    )
    # A test's server waits at most 5 s for requests still in flight at its end (aiohttp's default, 60 s, is
    # the per-test timeout: one hung handler made a teardown time out under a loaded CI run).
    runner = ServiceRunner(app, guard, access_log_class=RouteAccessLogger, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session:
            yield Api(session, f"http://127.0.0.1:{port}", settings, clock, app, requests=seen)
    finally:
        await runner.cleanup()


@pytest.fixture
async def api(store_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    # A generous store timeout: these tests check what the service answers, not how fast (a single write
    # fsynced by Redis under the suite's load once outlasted the default 0.5 s: a right 503, but not what
    # they test). The timeout itself has its own tests, with their own settings.
    async with running_api(store_url, clock, store_timeout=5.0) as api:
        yield api


@pytest.fixture
def captured_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record at DEBUG and above, as the code emitted it (before the masking filter)."""
    caplog.set_level(logging.DEBUG)
    return caplog
