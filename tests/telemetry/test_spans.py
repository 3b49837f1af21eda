"""The spans of the service and the SDK (SPEC section 18), through a real server on every backend: one trace
from an agent's span down to the store, the attributes each span carries and the ones none may, errors
marked by type only, the proxy's upstream call, webhook deliveries linked to the end that made them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from caller_memory.sdk import MemoryClient
from caller_memory.service.http.app_keys import WEBHOOKS
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from tests.conftest import Api, running_api
from tests.http.test_api import CALLER, CONFIG, memory_path
from tests.http.test_webhooks import Shop as HookShop
from tests.http.test_webhooks import eventually, receiver, webhook_settings
from tests.telemetry.conftest import named, one, scope

READ = "GET /v1/projects/{project}/callers/{identifier}/memory"
END = "POST /v1/projects/{project}/conversations/{conversation_id}/end"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("cheese-shop", CONFIG)


def client(api: Api, token: str, tmp_path: Path) -> MemoryClient:
    return MemoryClient(api.base_url, token=token, project="cheese-shop", outbox_path=tmp_path / "outbox.db")


async def test_one_trace_nests_the_agents_span_the_sdks_read_the_request_and_the_store(
    api: Api, shop: dict[str, str], spans: list[ReadableSpan], tmp_path: Path
) -> None:
    reply = await api.call(
        "PATCH", memory_path("cheese-shop"), token=shop["admin"], json={"cheese_type": "gouda"}
    )
    assert reply.status == 200
    spans.clear()
    async with client(api, shop["agent"], tmp_path) as sdk:
        with trace.get_tracer("an agent").start_as_current_span("turn") as turn:
            memory = await sdk.read_memory(CALLER)
    assert memory["cheese_type"] == "gouda"
    sdk_span = one([s for s in spans if scope(s) == "caller_memory.sdk"], READ)
    server = one([s for s in spans if scope(s) == "caller_memory.service"], READ)
    store = one(spans, "store read_fields")
    turn_id = turn.get_span_context()
    # turn > SDK read > the service's request > the store: one trace, each the parent of the next.
    assert {s.context.trace_id for s in (sdk_span, server, store)} == {turn_id.trace_id}
    assert sdk_span.parent is not None and sdk_span.parent.span_id == turn_id.span_id
    assert server.parent is not None and server.parent.span_id == sdk_span.context.span_id
    assert server.parent.is_remote  # joined through traceparent, over a real socket
    assert store.parent is not None and store.parent.span_id == server.context.span_id
    assert (
        sdk_span.kind is SpanKind.CLIENT and server.kind is SpanKind.SERVER and store.kind is SpanKind.CLIENT
    )
    assert dict(server.attributes or {}) == {
        "http.request.method": "GET",
        "http.route": "/v1/projects/{project}/callers/{identifier}/memory",
        "http.response.status_code": 200,
        "gen_ai.operation.name": "search_memory",
        "gen_ai.memory.store.id": "cheese-shop",
    }
    assert dict(sdk_span.attributes or {}) == {
        "http.request.method": "GET",
        "http.response.status_code": 200,
        "gen_ai.operation.name": "search_memory",
        "gen_ai.memory.store.id": "cheese-shop",
    }
    system = "sqlite" if api.settings.store_url.startswith("sqlite") else "redis"
    assert dict(store.attributes or {}) == {
        "db.system.name": system,
        "db.system": system,
        "db.operation.name": "read_fields",
    }


async def test_the_end_is_an_update_of_memory_and_every_store_call_is_one_span(
    api: Api, shop: dict[str, str], spans: list[ReadableSpan], tmp_path: Path
) -> None:
    async with client(api, shop["agent"], tmp_path) as sdk:
        conv = sdk.conversation("conv-1", caller=CALLER)
        await conv.begin_turn()
        conv.state["booking_day"] = "Friday"
        spans.clear()
        result = await conv.end()
    assert result.persisted == ("booking_day",)
    ends = named(spans, END)
    assert {scope(s) for s in ends} == {"caller_memory.sdk", "caller_memory.service"}
    assert all((s.attributes or {})["gen_ai.operation.name"] == "update_memory" for s in ends)
    server = next(s for s in ends if s.kind is SpanKind.SERVER)
    stores = [s for s in spans if s.name.startswith("store ")]
    assert "store end_conversation" in {s.name for s in stores}
    # Each is a port call of this request, none a backend's inner call (those make no span of their own).
    assert all(s.parent is not None and s.parent.span_id == server.context.span_id for s in stores)


async def test_traceparent_is_read_and_baggage_is_neither_read_nor_sent(
    api: Api, shop: dict[str, str], spans: list[ReadableSpan], tmp_path: Path
) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    reply = await api.call(
        "GET",
        memory_path("cheese-shop"),
        token=shop["agent"],
        headers={"traceparent": f"00-{trace_id}-{parent}-01", "baggage": "caller=%2B14155550100"},
    )
    assert reply.status == 200
    server = one(spans, READ)
    assert f"{server.context.trace_id:032x}" == trace_id
    assert server.parent is not None and f"{server.parent.span_id:016x}" == parent
    assert not any("caller" in key or "baggage" in key for key in (server.attributes or {}))

    # The SDK sends traceparent and never the application's baggage.
    got: list[dict[str, str]] = []

    async def capture(request: web.Request) -> web.Response:
        got.append(dict(request.headers))
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/v1/projects/{project}/callers/{identifier}/memory", capture)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with MemoryClient(
            url, token="t0ken", project="cheese-shop", outbox_path=tmp_path / "o.db"
        ) as sdk:
            token = context.attach(baggage.set_baggage("caller", "+14155550100"))
            try:
                memory = await sdk.read_memory(CALLER)
            finally:
                context.detach(token)
    finally:
        await runner.cleanup()
    assert not memory.available
    assert len(got) == 1
    assert got[0]["traceparent"].startswith("00-") and "baggage" not in {k.lower() for k in got[0]}
    failed = one([s for s in spans if scope(s) == "caller_memory.sdk"], READ)
    assert failed.status.status_code is StatusCode.ERROR
    assert (failed.attributes or {})["error.type"] == "503"
    assert not failed.events and not failed.status.description


async def test_a_refused_request_names_no_project_and_an_unmatched_one_names_no_path(
    api: Api, shop: dict[str, str], spans: list[ReadableSpan]
) -> None:
    reply = await api.call("GET", memory_path("14155550100"), token=shop["agent"])
    assert reply.status == 404
    refused = one(spans, READ)
    assert (refused.attributes or {})["http.response.status_code"] == 404
    assert "gen_ai.memory.store.id" not in (refused.attributes or {})
    assert refused.status.status_code is StatusCode.UNSET  # a 4xx is the client's, not the server's fault
    reply = await api.call("GET", f"/v2/{CALLER}/whatever", token=shop["agent"])
    assert reply.status == 404
    unmatched = [s for s in spans if s.kind is SpanKind.SERVER and "http.route" not in (s.attributes or {})]
    assert [s.name for s in unmatched] == ["GET"]


# A store that stops answering: a Redis server behind a proxy that delays its answers.
@pytest.mark.parametrize("store_url", ["redis"], indirect=True)
async def test_a_store_failure_marks_both_spans_by_type_only(
    store_url: str, clock, spans: list[ReadableSpan], tmp_path: Path
) -> None:
    from tests.support.proxy import LossyProxy

    port = int(store_url.rsplit(":", 1)[1].split("/")[0])
    proxy = LossyProxy(port)
    await proxy.start()
    try:
        async with running_api(f"redis://127.0.0.1:{proxy.port}/0", clock, store_timeout=0.3) as api:
            tokens = await api.project_with_tokens("cheese-shop", CONFIG)
            proxy.delay = 2.0
            spans.clear()
            reply = await api.call("GET", memory_path("cheese-shop"), token=tokens["agent"])
            assert reply.status == 503
            proxy.delay = 0.0
    finally:
        await proxy.close()
    server, store = one(spans, READ), one(spans, "store read_fields")
    assert server.status.status_code is StatusCode.ERROR and (server.attributes or {})["error.type"] == "503"
    assert store.status.status_code is StatusCode.ERROR
    assert (store.attributes or {})["error.type"] == "StoreUnavailable"
    assert not store.events and not store.status.description  # the message names the operation's keys


async def test_a_webhook_delivery_is_linked_to_the_end_that_made_it(
    store_url: str, clock, spans: list[ReadableSpan]
) -> None:
    async with receiver() as hook, running_api(store_url, clock, **webhook_settings()) as api:
        document = {
            "memory": {"repeat_caller": {"state_keys": ["caller_name"]}, "conversation": {"enabled": True}}
        }
        reply = await api.call(
            "PUT", "/v1/projects/cheese-shop", token="operator-token-for-tests-0123456789", json=document
        )
        assert reply.status in (200, 201)
        shop = HookShop(api, await api.mint("cheese-shop", "admin"), await api.mint("cheese-shop", "agent"))
        await shop.register(hook.url)
        spans.clear()
        await shop.end("conv-1")
        await eventually(lambda: len(hook.got) == 1)
        await api.app[WEBHOOKS].deliverer.drain()
    end = next(s for s in named(spans, END) if s.kind is SpanKind.SERVER)
    delivery = one(spans, "deliver conversation.ended")
    assert delivery.parent is None  # a trace of its own: the end's request was answered long before
    assert [link.context.span_id for link in delivery.links] == [end.context.span_id]
    assert dict(delivery.attributes or {}) == {
        "caller_memory.webhook.event": "conversation.ended",
        "gen_ai.memory.store.id": "cheese-shop",
        "caller_memory.webhook.outcome": "delivered",
    }
    assert "traceparent" not in {k.lower() for k in hook.got[0][0]}  # nothing of ours goes to a receiver


async def test_the_proxys_upstream_call_is_a_span_under_the_request(
    spans: list[ReadableSpan], store_url: str, clock
) -> None:
    from caller_memory.sdk.testing import ScriptedModel

    from tests.proxy.conftest import open_shop, proxy_settings

    async with ScriptedModel(["Stilton."]) as model, running_api(store_url, clock, **proxy_settings()) as api:
        shop = await open_shop(api, type("U", (), {"url": model.base_url})())
        try:
            spans.clear()
            answer = await shop.client().chat.completions.create(
                model="m", messages=[{"role": "user", "content": "my number is +14155550100"}]
            )
            assert answer.choices
        finally:
            await shop.close()
    await asyncio.sleep(0)
    server = one(spans, "POST /v1/projects/{project}/llm/chat/completions")
    chat = one(spans, "chat")
    assert chat.parent is not None and chat.parent.span_id == server.context.span_id
    assert chat.kind is SpanKind.CLIENT and dict(chat.attributes or {}) == {"gen_ai.operation.name": "chat"}
    # The memory read runs beside the upstream call (started before it), in the request's trace.
    reads = [s for s in spans if s.name == "store read_fields"]
    assert reads and all(s.parent and s.parent.span_id == server.context.span_id for s in reads)


async def test_an_mcp_tool_call_joins_the_agents_trace_with_the_store_under_it(
    store_url: str, clock, spans: list[ReadableSpan]
) -> None:
    """The mcp SDK makes the tool call's span (``tools/call <tool>``) and joins it to the caller's trace
    through the request's ``_meta`` (its client injects it there, as an agent's MCP client does); the
    service's store calls nest under it, and the HTTP request of the MCP endpoint has its server span."""
    from tests.mcp.conftest import open_shop

    async with running_api(store_url, clock, store_timeout=5.0) as api:
        shop = await open_shop(api)
        await shop.remember(caller_name="Ada")
        async with shop.client() as client:
            spans.clear()
            with trace.get_tracer("an agent").start_as_current_span("turn") as turn:
                found = await client.call_tool("get_caller_memory", {})
                refused = await client.call_tool("remember", {"key": "password", "value": "x"})
    assert not found.is_error and refused.is_error
    sent = one(spans, "MCP send tools/call get_caller_memory")
    tool = one(spans, "tools/call get_caller_memory")
    assert scope(tool) == scope(sent) == "mcp-python-sdk"
    assert (tool.attributes or {})["gen_ai.tool.name"] == "get_caller_memory"
    assert sent.context.trace_id == tool.context.trace_id == turn.get_span_context().trace_id
    assert tool.parent is not None and tool.parent.span_id == sent.context.span_id
    # The service's own span of the tool's work, under the SDK's: the tool's name and the project only.
    ours = one(spans, "execute_tool get_caller_memory")
    assert scope(ours) == "caller_memory.service"
    assert ours.parent is not None and ours.parent.span_id == tool.context.span_id
    assert dict(ours.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "get_caller_memory",
        "gen_ai.memory.store.id": "cheese-shop",
    }
    reads = [
        s
        for s in spans
        if s.name.startswith("store ") and s.parent and s.parent.span_id == ours.context.span_id
    ]
    assert reads and all(s.context.trace_id == tool.context.trace_id for s in reads)
    # A tool error marks the span by type only: never its message (which may quote what the model sent).
    failed = one(spans, "execute_tool remember")
    assert failed.status.status_code is StatusCode.ERROR and not failed.status.description
    assert (failed.attributes or {})["error.type"] == "ToolError" and not failed.events
    assert any(
        s.name == "POST /v1/projects/{project}/mcp" and scope(s) == "caller_memory.service" for s in spans
    )
