"""SDK edge cases found in review: cancellation, concurrent deliveries, odd answers, local failures."""

from __future__ import annotations

import asyncio
import copy
import logging
import pickle
import time
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import (
    CircuitBreaker,
    EndResult,
    Memory,
    MemoryClient,
    OutboxUnavailableError,
    RetryPolicy,
)

from tests.conftest import Api
from tests.sdk.conftest import Serve

CALLER = "+14155550100"
END_ROUTE = "/conversations/{conversation_id}/end"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, attempt_timeout=0.3)


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("cheese-shop", {"state_keys": ["booking_day", "n"]})


def end_body(n: int) -> bytes:
    return orjson.dumps({"caller": CALLER, "state": {"n": n}, "outcome": {}, "channel": "voice"})


async def test_a_cancelled_end_is_still_delivered(serve: Serve, tmp_path: Path) -> None:
    stalled = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        stalled.set()
        await asyncio.sleep(30)
        return web.Response()

    url = await serve(hang)
    async with MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db", retry=FAST) as client:
        conv = client.conversation("conv-1", caller=CALLER)
        conv.state["booking_day"] = "Friday"
        task = asyncio.create_task(conv.end())
        await stalled.wait()
        task.cancel()  # the agent framework hangs up mid-request
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose(grace=1)
        [entry] = await client.outbox.pending()
        assert orjson.loads(entry.body)["state"] == {"booking_day": "Friday"}
        assert "Friday" not in repr(entry) and CALLER not in repr(entry)
        assert await client.outbox.claim(10, lease=1)  # released at once: the next delivery takes it


async def test_concurrent_deliveries_send_each_entry_once(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    outbox = tmp_path / "o.db"
    async with MemoryClient(
        api.base_url, token=shop["agent"], project="cheese-shop", outbox_path=outbox
    ) as a:
        await a.aclose(grace=1)
    options = {"token": shop["agent"], "project": "cheese-shop", "outbox_path": outbox}
    a = MemoryClient(api.base_url, deliver_outbox_on_start=False, **options)  # type: ignore[arg-type]
    b = MemoryClient(api.base_url, deliver_outbox_on_start=False, **options)  # type: ignore[arg-type]
    async with a, b:
        for i in range(120):  # more than one batch
            await a.outbox.add(f"conv-{i}", end_body(i), lease=0)
        before = api.count("POST", END_ROUTE)
        reports = await asyncio.gather(a.flush_outbox(), a.flush_outbox(), b.flush_outbox())
        assert sum(r.delivered for r in reports) == 120 and await a.outbox.pending() == []
        assert api.count("POST", END_ROUTE) - before == 120


async def test_concurrent_end_calls_send_one_request(api: Api, shop: dict[str, str], tmp_path: Path) -> None:
    async with MemoryClient(
        api.base_url, token=shop["agent"], project="cheese-shop", outbox_path=tmp_path / "o.db"
    ) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        conv.state["n"] = 1
        results = await asyncio.gather(conv.end(), conv.end(), conv.end())
        assert results[0] is results[1] is results[2] and conv.ended
        assert api.count("POST", END_ROUTE) == 1


async def test_answers_that_are_not_the_services_are_transient_and_never_logged(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def proxy_page(request: web.Request) -> web.Response:
        if request.method == "POST":
            return web.Response(text="<html>welcome to the hotel wifi</html>", content_type="text/html")
        return web.Response(
            status=502, text=f"<html>Bad gateway for {request.path}</html>", content_type="text/html"
        )

    url = await serve(proxy_page)
    caplog.set_level(logging.DEBUG)
    async with MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db", retry=FAST) as client:
        conv = client.conversation("conv-1", caller=CALLER)
        await conv.begin_turn()
        assert not conv.memory.available and "502" in (conv.memory.reason or "")
        result = await conv.end()
        assert result.queued  # a 200 that is not the service's answer is not a success
        assert len(await client.outbox.pending()) == 1 and await client.outbox.rejected() == []
    sdk_records = [r for r in caplog.records if r.name.startswith("caller_memory.sdk")]
    assert sdk_records  # the failures were logged...
    logged = "\n".join(r.getMessage() for r in sdk_records) + (conv.memory.reason or "")
    assert "4155550100" not in logged and "hotel" not in logged


async def test_local_problems_fail_early_and_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="line breaks"):
        MemoryClient("http://x", token="cm_abc\r\ndef", project="p")
    assert MemoryClient(
        "http://x", token=" cm_abc_def\r\n", project="p"
    )  # a line end from a .env file is fine
    with pytest.raises(ValueError, match="conversation_id"):
        MemoryClient("http://x", token="t", project="p").conversation("", caller=CALLER)
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        async with MemoryClient("http://x", token="t", project="p", outbox_path=blocker / "o.db"):
            pass


async def test_an_outbox_that_breaks_mid_run_is_reported(serve: Serve, tmp_path: Path) -> None:
    async def down(request: web.Request) -> web.Response:
        return web.Response(status=503)

    url = await serve(down)
    async with MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db", retry=FAST) as client:
        await client.outbox.close()
        (tmp_path / "o.db").chmod(0o400)
        client.outbox.path = tmp_path / "gone" / "x" / "o.db"
        (tmp_path / "gone").write_text("a file where a directory should be")
        with pytest.raises(OutboxUnavailableError, match="this write is lost"):
            await client.conversation("conv-1", caller=CALLER).end()


async def test_retry_after_is_honoured(serve: Serve, tmp_path: Path) -> None:
    times: list[float] = []

    async def busy(request: web.Request) -> web.Response:
        times.append(time.monotonic())
        return web.Response(status=429, headers={"Retry-After": "0.3"})

    url = await serve(busy)
    policy = RetryPolicy(attempts=2, base_delay=0.0, max_delay=1.0, attempt_timeout=1.0)
    async with MemoryClient(
        url, token="t", project="p", outbox_path=tmp_path / "o.db", retry=policy
    ) as client:
        assert (await client.conversation("conv-1", caller=CALLER).end()).queued
    assert len(times) == 2 and times[1] - times[0] >= 0.29


async def test_the_circuit_lets_one_probe_through(serve: Serve, tmp_path: Path) -> None:
    calls = 0

    async def failing(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(status=503)

    url = await serve(failing)
    circuit = CircuitBreaker(failures=2, reset_after=0.0)
    async with MemoryClient(
        url, token="t", project="p", outbox_path=tmp_path / "o.db", circuit=circuit
    ) as client:
        convs = [client.conversation(f"conv-{i}", caller=CALLER) for i in range(10)]
        await convs[0].begin_turn()
        await convs[0].begin_turn()
        assert circuit.is_open and calls == 2
        await asyncio.gather(*(c.begin_turn() for c in convs))
        assert calls == 3  # one probe, the nine others answered "unavailable" at once


async def test_rejected_entries_can_be_retried_or_purged(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    outbox = tmp_path / "o.db"
    async with MemoryClient(
        api.base_url,
        token="cm_000000000000_revoked",
        project="cheese-shop",
        outbox_path=outbox,
        deliver_outbox_on_start=False,
    ) as bad:
        await bad.outbox.add("conv-1", end_body(1), lease=0)
        await bad.outbox.add("conv-2", end_body(2), lease=0)
        report = await bad.flush_outbox()
        assert (report.delivered, report.rejected, report.remaining) == (0, 2, 0)
        assert "401" in ((await bad.outbox.rejected())[0].rejected or "")
    async with MemoryClient(
        api.base_url,
        token=shop["agent"],
        project="cheese-shop",
        outbox_path=outbox,
        deliver_outbox_on_start=False,
    ) as good:
        assert await good.outbox.retry_rejected() == 2
        assert (await good.flush_outbox()).delivered == 2
        await good.outbox.add("conv-3", end_body(3), lease=0)
        await good.outbox.reject((await good.outbox.claim(1, lease=1))[0].id, "test")
        assert await good.outbox.purge_rejected() == 1


def test_memory_and_results_behave_like_values() -> None:
    memory = Memory({"caller_name": "Ada", "profile": {"likes": ["brie"]}}, etag='"x"')
    assert copy.copy(memory) is memory
    deep = copy.deepcopy(memory)
    assert deep == memory and deep.etag == '"x"' and deep["profile"] is not memory["profile"]
    assert pickle.loads(pickle.dumps(memory)) == memory
    result = EndResult("conv-1", persisted=("a",), repeat_caller={"REPEAT_CALLER_CONV_ID": "c0"})
    assert hash(result) == hash(EndResult("conv-1", persisted=("a",)))
