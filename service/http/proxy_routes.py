"""The memory proxy's routes (SPEC section 16): the project's upstream (``PUT/GET/DELETE .../llm``, admin) and
``POST .../llm/chat/completions`` (an agent token as the custom LLM's API key), OpenAI's Chat Completions,
streaming and not.

A completion: the body is read and stripped of platform metadata (service/proxy/requests.py); the request to
the upstream starts at once, and its body, which waits for the memory message, follows as soon as the
memory is read (within the read budget; service/proxy/binding.py), so that the read runs concurrently with
connecting. The upstream's answer goes to the client as it comes: its status, its body bytes unchanged, each
chunk written on as soon as it is read (a slow client pauses the upstream's read: memory stays bounded; a
client that goes closes the upstream at once). The request's messages are then recorded in the bound
conversation, off the response's path. Nothing here fails a completion for memory: a store down or slow, or
the project at its stream bound, gives a completion without memory, marked ``X-Caller-Memory:
unavailable`` and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import Counter, Gauge

from ..config import Settings
from ..domain.conversations.messages import MAX_BATCH
from ..domain.conversations.requests import read_append
from ..domain.errors import CallerMemoryError, Forbidden
from ..domain.projects import Project
from ..domain.sealing import Sealer
from ..domain.tokens import Role
from ..domain.webhooks.policy import WebhookPolicy
from ..proxy.answers import AnswerReader, keep_answer
from ..proxy.binding import (
    BINDING_HEADER,
    MEMORY_HEADER,
    READ_BUDGET_S,
    Binder,
    Binding,
    Outcome,
    conversation_of,
)
from ..proxy.requests import Completion, Recorded, read_completion
from ..proxy.upstream import LlmConfig, UpstreamService, upstream_view
from ..telemetry import Telemetry
from .app_keys import Services
from .metrics import Metrics
from .middleware import IN_FLIGHT, InFlight
from .openapi_parts import (
    JSON,
    NO_STORE_HEADERS,
    THIS_PROJECT,
    body_errors,
    link,
    problem,
    ref,
    request_body,
    response,
)
from .operations import documented
from .proxy_client import ProxyClient, UpstreamFailed
from .responses import json_response
from .routes import actor, project_for, read_body, read_model

log = logging.getLogger("caller_memory.proxy")
T = TypeVar("T")
routes = web.RouteTableDef()

LLM_PATH = "/v1/projects/{project}/llm"
COMPLETIONS_PATH = LLM_PATH + "/chat/completions"
NO_STORE = {"Cache-Control": "no-store"}
#: Headers of the upstream's answer that reach the client (hop-by-hop ones and the length never do: the body
#: is streamed on in chunks).
PASSED_HEADERS = ("Content-Type", "Content-Encoding", "Retry-After", "x-request-id")
#: How often a stream looks whether its client is still there (a gone client closes the upstream within it).
DISCONNECT_POLL_S = 0.02
CHUNK_BYTES = 64 * 1024


@dataclass(slots=True)
class Proxy:
    """The memory proxy of one process."""

    upstreams: UpstreamService
    binder: Binder
    client: ProxyClient
    services: Services
    max_streams: int
    #: Bytes a completion's body may hold (``CALLER_MEMORY_PLATFORM_MAX_BODY``).
    max_body: int
    outcomes: Counter
    failures: Counter
    open_streams: Gauge
    telemetry: Telemetry  # a span around each upstream call, from connecting to the stream's end
    streams: dict[str, int] = field(default_factory=dict)
    #: Transcript writes under way (kept so that they are not collected, and awaited at shutdown).
    writes: set[asyncio.Task[None]] = field(default_factory=set)
    #: Each conversation's latest transcript write: the next waits for it, so that a call's writes (and its
    #: last answer) land in the order of its requests.
    latest: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        yield
        await self.close()

    async def close(self) -> None:
        if self.writes:
            await asyncio.wait(set(self.writes), timeout=5.0)
        await self.client.close()


PROXY = web.AppKey("proxy", Proxy)


def build_proxy(
    settings: Settings, services: Services, metrics: Metrics, policy: WebhookPolicy, telemetry: Telemetry
) -> Proxy:
    """The proxy of one process; ``policy``: the webhooks' destination rules, which upstreams follow too."""
    upstreams = UpstreamService(
        services.store,
        Sealer(settings.secret_key, settings.previous_secret_keys),
        policy,
        services.clock,
        audit=services.audit,
        cache_seconds=settings.config_cache_seconds,
    )
    return Proxy(
        upstreams=upstreams,
        binder=Binder(services.store, services.clock),
        client=ProxyClient(policy),
        services=services,
        max_streams=settings.max_streams_per_project,
        max_body=settings.platform_max_body,
        outcomes=Counter(
            "caller_memory_proxy_completions",
            "Completions through the memory proxy, by what they carried (bound: with the caller's memory; "
            "unbound: no started conversation named; unavailable: memory not read in time or a bound met).",
            ["memory"],
            registry=metrics.registry,
        ),
        failures=Counter(
            "caller_memory_proxy_upstream_failures",
            "Completions answered 502 because the upstream could not be reached, was refused, or timed out.",
            ["code"],
            registry=metrics.registry,
        ),
        open_streams=Gauge(
            "caller_memory_proxy_streams",
            "Completions streaming through the memory proxy now (this process).",
            registry=metrics.registry,
            multiprocess_mode="livesum",
        ),
        telemetry=telemetry,
    )


UPSTREAM_EXAMPLE = {
    "base_url": "https://models.example.com/v1",
    "api_key": "sk-your-model-key",
    "model": "gpt-4o-mini",
    "timeout": 30,
}
UPSTREAM_LINKS = {
    "GetUpstream": link("get_llm", THIS_PROJECT),
    "DeleteUpstream": link("delete_llm", THIS_PROJECT),
}


@routes.put(LLM_PATH)
@documented(
    "admin",
    "Set the project's upstream model for the memory proxy",
    {
        "200": response("The upstream (without its key), replaced.", "LlmUpstream", *NO_STORE_HEADERS),
        "201": response("The upstream (without its key), new.", "LlmUpstream", *NO_STORE_HEADERS),
        "422": problem(
            "A `base_url` that is not https:// (plain http:// only to a host the operator allows), that has "
            "credentials, a query or a fragment, or whose host is a loopback, private, link-local or other "
            "special-purpose address; an empty `api_key`; a `timeout` outside 0-600 s; an unknown member."
        ),
        "503": problem(
            "The operator has not set `CALLER_MEMORY_SECRET_KEY` (it encrypts the key), or the store did "
            "not answer."
        ),
        **body_errors(),
    },
    body=request_body("LlmConfig", "The OpenAI-compatible API the proxy calls, and its key.")
    | {"content": {JSON: {"schema": ref("LlmConfig"), "example": UPSTREAM_EXAMPLE}}},
    links={"200": UPSTREAM_LINKS, "201": UPSTREAM_LINKS},
    description="The key is sealed at rest and never answered. Changes are audited (without the key).",
)
async def put_llm(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    body = await read_model(request, LlmConfig, "upstream")
    upstream, created = await request.app[PROXY].upstreams.put(project, body, actor=actor(request))
    return json_response(upstream_view(upstream), status=201 if created else 200, headers=NO_STORE)


@routes.get(LLM_PATH)
@documented(
    "admin",
    "The project's upstream model (without its key)",
    {
        "200": response("The upstream; `api_key_set` says a key is kept.", "LlmUpstream", *NO_STORE_HEADERS),
        "404": problem("No such project, or it has no upstream."),
    },
)
async def get_llm(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    upstream = await request.app[PROXY].upstreams.get(project)
    return json_response(upstream_view(upstream), headers=NO_STORE)


@routes.delete(LLM_PATH)
@documented(
    "admin",
    "Remove the project's upstream model",
    {"204": {"description": "Removed."}, "404": problem("No such project, or it has no upstream.")},
)
async def delete_llm(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    await request.app[PROXY].upstreams.delete(project, actor=actor(request))
    return web.Response(status=204)


MEMORY_HEADER_TEXT = (
    "`bound`: the caller's memory went upstream (or the caller has none); `unbound`: no started conversation "
    "was named; `unavailable`: the memory was not read in time (the store down or slow, the project at "
    "its stream bound, or no in-flight slot free for the read)."
)
MEMORY_HEADER_SCHEMA = {"type": "string", "enum": [o.value for o in Outcome]}
OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"const": "upstream_error"},
                "code": {"enum": ["upstream_unreachable", "upstream_refused", "upstream_timeout"]},
            },
        }
    },
}

#: One server-sent event of a streamed answer (its `data`: a `chat.completion.chunk`, or `[DONE]` at the end).
SSE_EVENT = {"description": "Server-sent events: `data: {chat.completion.chunk}`, then `data: [DONE]`."}
COMPLETION_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "required": ["role"], "properties": {"role": {"type": "string"}}},
        },
        "stream": {"type": "boolean"},
    },
}

COMPLETION_DOC = documented(
    "agent",
    "OpenAI Chat Completions through the memory proxy",
    {
        "200": {
            "description": "The upstream's answer, its bytes unchanged (a stream of server-sent events with "
            '`"stream": true`); `X-Caller-Memory` says whether the caller\'s memory went with it. An error '
            "of the upstream passes with its status, body and `Retry-After`.",
            "headers": {MEMORY_HEADER: {"description": MEMORY_HEADER_TEXT, "schema": MEMORY_HEADER_SCHEMA}},
            "content": {
                JSON: {"schema": {"type": "object"}},
                "text/event-stream": {"schema": SSE_EVENT},
            },
        },
        "404": problem("No such project, or it has no upstream model (`PUT .../llm`)."),
        "422": problem(
            "A body that is not a Chat Completions request (no `messages` array of objects with a "
            "`role`), or a malformed `X-Caller-Memory-Conversation`."
        ),
        "502": {
            "description": "The upstream could not be reached, was refused by the destination rules, or "
            "did not answer within its `timeout`: an OpenAI-shaped error "
            "(`{error: {message, type, code}}`), not a problem document, so that OpenAI clients read it.",
            "content": {JSON: {"schema": OPENAI_ERROR}},
        },
        **body_errors(),
        "413": problem(
            "The body is larger than `CALLER_MEMORY_PLATFORM_MAX_BODY` allows (4 MiB unless the operator set "
            "another size)."
        ),
    },
    body={
        "required": True,
        "description": "An OpenAI Chat Completions request, as the platform sends it.",
        "content": {JSON: {"schema": COMPLETION_REQUEST}},
    },
    description="A `platform` token may call it too (the custom LLM's API key on a hosted platform). "
    "Bind the request to a started conversation with the `X-Caller-Memory-Conversation` "
    "header (or, without it, through Vapi's `call.id` or ElevenLabs' `elevenlabs_extra_body."
    "caller_memory_conversation`): one system message with the caller's memory (as data) then goes upstream after the leading "
    "system messages, and the request's messages are recorded in the conversation (derived ids: a turn "
    "sent twice is stored once). Platform metadata (Vapi `call`, `customer`, `phoneNumber`, `metadata`; "
    "Agora `context` and its per-message extensions; ElevenLabs `elevenlabs_extra_body`) and `user` never "
    "go upstream. See docs/proxy.md.",
)


@routes.post(COMPLETIONS_PATH)
@COMPLETION_DOC
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request)


@routes.post(COMPLETIONS_PATH + "/chat/completions")
@COMPLETION_DOC
async def chat_completions_doubled(request: web.Request) -> web.StreamResponse:
    """The same, under the doubled path a platform makes of a base URL given as the full URL (Vapi)."""
    return await _complete(request)


@dataclass(slots=True)
class _Memory:
    outcome: Outcome = Outcome.UNBOUND
    binding: Binding | None = None
    text: str | None = None


async def _complete(request: web.Request) -> web.StreamResponse:
    project = await _caller_project(request)
    proxy = request.app[PROXY]
    completion = read_completion(await read_body(request.clone(client_max_size=proxy.max_body)))
    # The header names the conversation; without it, the platform's own fields (Vapi, ElevenLabs) may.
    conversation_id = conversation_of(request.headers.get(BINDING_HEADER)) or completion.conversation
    upstream = await proxy.upstreams.get(project)
    project_id = project.project_id
    held = proxy.streams.get(project_id, 0)
    counted = held < proxy.max_streams
    if counted:
        proxy.streams[project_id] = held + 1
    proxy.open_streams.inc()
    try:
        read = _read_memory(
            proxy, project, conversation_id, bounded=not counted, slots=request.get(IN_FLIGHT)
        )
        memory = asyncio.create_task(read)

        async def body() -> bytes:
            found = await memory
            return completion.upstream_body(found.text, upstream.model)

        with proxy.telemetry.client_span("chat", {"gen_ai.operation.name": "chat"}):
            return await _relay(request, proxy, project, completion=completion, memory=memory, body=body)
    finally:
        proxy.open_streams.dec()
        if counted:
            left = proxy.streams[project_id] - 1
            if left:
                proxy.streams[project_id] = left
            else:
                del proxy.streams[project_id]


async def _caller_project(request: web.Request) -> Project:
    """The path's project, for an agent token or a platform token (the custom LLM's key on a hosted
    platform); any other role is refused as an agent's operation."""
    try:
        _, project = await project_for(request, Role.AGENT)
    except Forbidden as refused:
        try:
            _, project = await project_for(request, Role.PLATFORM)
        except Forbidden:
            raise refused from None
    return project


async def _relay(
    request: web.Request,
    proxy: Proxy,
    project: Project,
    *,
    completion: Completion,
    memory: asyncio.Task[_Memory],
    body: Callable[[], Awaitable[bytes]],
) -> web.StreamResponse:
    upstream = await proxy.upstreams.get(project)
    accept = "text/event-stream" if completion.stream else "application/json"
    try:
        # A client that goes while the upstream has not answered yet closes the upstream's request too.
        answer = await _while_connected(request, proxy.client.open(upstream, body, accept))
    except _ClientGone:
        memory.cancel()
        log.info("proxy: the client closed the connection before the upstream answered; closing the upstream")
        raise ConnectionResetError("the client closed the connection") from None
    except UpstreamFailed as exc:
        found = await _settled(memory)
        proxy.failures.labels(exc.code).inc()
        log.warning("proxy: upstream failed (%s)", exc.code)
        error = {"error": {"message": exc.message, "type": "upstream_error", "code": exc.code}}
        headers = NO_STORE | {MEMORY_HEADER: found.outcome.value}
        return json_response(error, status=502, headers=headers)
    found = await _settled(memory)
    proxy.outcomes.labels(found.outcome.value).inc()
    try:
        response = web.StreamResponse(status=answer.status)
        for name in PASSED_HEADERS:
            if name in answer.headers:
                response.headers[name] = answer.headers[name]
        response.headers.update(NO_STORE)
        response.headers[MEMORY_HEADER] = found.outcome.value
        response.headers["X-Content-Type-Options"] = "nosniff"
        await response.prepare(request)
        # The answer is read as it passes, to be kept as the call's last (recorded at the call's end).
        reader = AnswerReader(stream=completion.stream) if found.binding and answer.status == 200 else None
        whole = await _pump(request, answer, response, reader)
        if whole:
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
    finally:
        answer.close()
    if found.binding is not None:
        text = reader.text() if whole and reader is not None else None
        _record_later(proxy, project, found.binding, completion, text)
    return response


async def _pump(
    request: web.Request,
    answer: aiohttp.ClientResponse,
    response: web.StreamResponse,
    reader: AnswerReader | None,
) -> bool:
    """Copy the upstream's body to the client chunk by chunk (and to ``reader``), until it ends (True), or
    the client goes, the upstream fails or stays silent past its timeout (False: the answer is cut, the
    upstream closed)."""

    async def copy() -> None:
        while True:
            chunk = await answer.content.readany()
            if not chunk:
                return
            await response.write(chunk)  # waits while the client's buffer is full: the upstream pauses
            if reader is not None:
                reader.feed(chunk)

    try:
        await _while_connected(request, copy())
        return True
    except _ClientGone:
        log.info("proxy: the client closed the connection; closing the upstream")
        return False
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        log.warning("proxy: the stream ended early (%s)", type(exc).__name__)
        if request.transport is not None:
            request.transport.close()  # the client sees a cut answer, not a complete one
        return False
    finally:
        answer.close()


class _ClientGone(Exception):
    """The client closed its connection."""


async def _while_connected(request: web.Request, work: Awaitable[T]) -> T:
    """``work``'s result, or :class:`_ClientGone` (``work`` cancelled) as soon as the client's connection
    closes: aiohttp does not cancel a handler whose client goes (``handler_cancellation`` is off), so the
    connection is looked at every :data:`DISCONNECT_POLL_S` seconds."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise _ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _settled(memory: asyncio.Task[_Memory]) -> _Memory:
    try:
        return await memory
    except Exception:  # a bug in the read must not fail the completion
        log.exception("proxy: the memory read failed")
        return _Memory(Outcome.UNAVAILABLE)


async def _read_memory(
    proxy: Proxy,
    project: Project,
    conversation_id: str | None,
    *,
    bounded: bool,
    slots: InFlight | None,
) -> _Memory:
    if conversation_id is None:
        return _Memory(Outcome.UNBOUND)
    if bounded:
        return _Memory(Outcome.UNAVAILABLE)  # the project is at its stream bound: no store work
    if slots is None:
        return await _read_within_budget(proxy, project, conversation_id)
    # The read takes one of the project's in-flight slots while it runs (not the stream): none free, the
    # completion goes without memory, never refused.
    async with slots.slot(project.project_id) as taken:
        if not taken:
            log.info("proxy: no in-flight slot free for the memory read; going without memory")
            return _Memory(Outcome.UNAVAILABLE)
        return await _read_within_budget(proxy, project, conversation_id)


async def _read_within_budget(proxy: Proxy, project: Project, conversation_id: str) -> _Memory:
    found = _Memory(Outcome.UNAVAILABLE)
    try:
        async with asyncio.timeout(READ_BUDGET_S):
            found.binding = await proxy.binder.bind(project.project_id, conversation_id)
            if found.binding is None:
                return _Memory(Outcome.UNBOUND)
            found.text = await proxy.binder.memory(project, found.binding)
            found.outcome = Outcome.BOUND
    except TimeoutError:
        log.warning("proxy: the memory read took more than its budget (%g s)", READ_BUDGET_S)
    except CallerMemoryError as exc:
        log.warning("proxy: the memory read failed: %s", exc.detail)
    return found


def _record_later(
    proxy: Proxy, project: Project, binding: Binding, completion: Completion, answer: str | None
) -> None:
    """Append the request's messages not yet recorded, then keep ``answer`` (the upstream's, read whole) as
    the call's last, off the response's path."""
    recorded = completion.recorded()
    fresh = set(proxy.binder.unrecorded(binding, [m.message_id for m in recorded]))
    messages = [m for m in recorded if m.message_id in fresh]
    if not messages and answer is None:
        return
    key = (binding.project, binding.conversation_id)
    after = proxy.latest.get(key)
    task = asyncio.create_task(
        _record(proxy, project, binding, messages, completion=completion, answer=answer, after=after)
    )
    proxy.writes.add(task)
    proxy.latest[key] = task

    def done(finished: asyncio.Task[None]) -> None:
        proxy.writes.discard(finished)
        if proxy.latest.get(key) is finished:
            del proxy.latest[key]

    task.add_done_callback(done)


async def _record(
    proxy: Proxy,
    project: Project,
    binding: Binding,
    messages: list[Recorded],
    *,
    completion: Completion,
    answer: str | None,
    after: asyncio.Task[None] | None,
) -> None:
    services = proxy.services
    if after is not None:
        await asyncio.wait({after})
    try:
        for start in range(0, len(messages), MAX_BATCH):
            batch = messages[start : start + MAX_BATCH]
            document = read_append(orjson.dumps({"messages": [m.as_dict() for m in batch]}))
            await services.transcripts.append(project, binding.conversation_id, document)
            proxy.binder.mark_recorded(binding, [m.message_id for m in batch])
        # The call's last answer, unless a later request of the call is being recorded already (its answer
        # replaces this one: of a burst of requests, only the last one's is written).
        latest = proxy.latest.get((binding.project, binding.conversation_id))
        if answer is not None and latest in (None, asyncio.current_task()):
            appends = services.transcripts.appends
            await keep_answer(
                appends,
                services.pending,
                services.clock,
                project=project,
                binding=binding,
                completion=completion,
                text=answer,
            )
    except CallerMemoryError as exc:
        log.warning("proxy: the transcript was not recorded: %s", exc.detail)
    except Exception:
        log.exception("proxy: the transcript was not recorded")
