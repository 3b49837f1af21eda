"""The SDK when the service hangs, dies or loses answers: real service processes, real signals."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from caller_memory.sdk import MemoryClient, RetryPolicy

from tests.conftest import OPERATOR_TOKEN
from tests.support.proxy import LossyProxy
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, http

CALLER = "+14155550100"
BUDGET = 0.15
MARGIN = 0.1
FAST_RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, attempt_timeout=0.3)


@pytest.fixture(params=["sqlite", "redis"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServiceProcess]:
    if request.param == "sqlite":
        store = f"sqlite:///{tmp_path}/memory.db"
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        with server.client() as client:
            client.flushall()
        store = server.url
    with ServiceProcess(store, tmp_path) as process:
        config = {"memory": {"repeat_caller": {"state_keys": ["booking_day", "caller_name"]}}}
        http("PUT", f"{process.url}/v1/projects/shop", OPERATOR_TOKEN, config)
        yield process


def agent_token(service: ServiceProcess) -> str:
    token: str = http("POST", f"{service.url}/v1/projects/shop/tokens", OPERATOR_TOKEN, {"role": "agent"})[
        "token"
    ]
    return token


def stored_fields(service: ServiceProcess) -> dict[str, Any]:
    fields: dict[str, Any] = http(
        "GET", f"{service.url}/v1/projects/shop/callers/{CALLER}/memory", OPERATOR_TOKEN
    )["fields"]
    return fields


async def test_a_hung_service_gives_the_last_memory_stale_or_none_within_the_budget(
    service: ServiceProcess, tmp_path: Path
) -> None:
    http(
        "PATCH",
        f"{service.url}/v1/projects/shop/callers/{CALLER}/memory",
        OPERATOR_TOKEN,
        {"caller_name": "Ada"},
    )
    async with MemoryClient(
        service.url,
        token=agent_token(service),
        project="shop",
        read_budget=BUDGET,
        outbox_path=tmp_path / "o.db",
    ) as client:
        conv = client.conversation("conv-1", caller=CALLER)
        await conv.begin_turn()
        assert conv.memory["caller_name"] == "Ada" and not conv.memory.stale
        service.pause()
        try:
            started = time.perf_counter()
            await conv.begin_turn()
            elapsed = time.perf_counter() - started
            # A call that read nothing before has nothing to fall back on.
            fresh = client.conversation("conv-2", caller=CALLER)
            await fresh.begin_turn()
        finally:
            service.resume()
        # The last memory read, served again (its fields expire in 30 days), and said to be stale.
        assert conv.memory.available and conv.memory.stale and dict(conv.memory) == {"caller_name": "Ada"}
        assert "no answer within 150 ms" in (conv.memory.reason or "")
        assert elapsed < BUDGET + MARGIN, elapsed
        assert not fresh.memory.available and len(fresh.memory) == 0
        assert "no answer within 150 ms" in (fresh.memory.reason or "")
        await conv.begin_turn()  # the service is back
        assert conv.memory.available and conv.memory["caller_name"] == "Ada" and not conv.memory.stale


async def test_killed_during_the_end_then_restarted_the_outbox_delivers_once(
    service: ServiceProcess, tmp_path: Path
) -> None:
    token = agent_token(service)
    async with MemoryClient(
        service.url, token=token, project="shop", retry=FAST_RETRY, outbox_path=tmp_path / "o.db"
    ) as client:
        conv = client.conversation("conv-1", caller=CALLER)
        conv.state["booking_day"] = "Friday"
        service.pause()  # the request is sent to a process that will never answer it...
        result = await conv.end(qa="resolved")
        service.kill()  # ...and then dies
        assert result.queued
        assert len(await client.outbox.pending()) == 1
        service.start()
        assert stored_fields(service) == {}  # the killed process applied nothing
        report = await client.flush_outbox()
        assert (report.delivered, report.remaining, report.rejected) == (1, 0, 0)
        assert stored_fields(service) == {"booking_day": "Friday"}
        assert (await client.flush_outbox()).delivered == 0
    # Applied exactly once: the service already knows this conversation, a new client gets a replay.
    async with MemoryClient(
        service.url, token=token, project="shop", outbox_path=tmp_path / "o.db"
    ) as client:
        again = client.conversation("conv-1", caller=CALLER)
        again.state["booking_day"] = "Friday"
        assert (await again.end(qa="resolved")).replayed


async def test_the_next_client_start_delivers_what_was_queued(
    service: ServiceProcess, tmp_path: Path
) -> None:
    token = agent_token(service)
    outbox = tmp_path / "o.db"
    service.kill()
    async with MemoryClient(
        service.url, token=token, project="shop", retry=FAST_RETRY, outbox_path=outbox
    ) as client:
        conv = client.conversation("conv-1", caller=CALLER)
        conv.state["caller_name"] = "Ada"
        assert (await conv.end()).queued
    service.start()
    async with MemoryClient(service.url, token=token, project="shop", outbox_path=outbox) as client:
        await client.aclose(grace=5)  # the delivery started on entering; let it finish
        assert await client.outbox.pending() == []
    assert stored_fields(service) == {"caller_name": "Ada"}


async def test_a_lost_answer_is_retried_without_applying_twice(
    service: ServiceProcess, tmp_path: Path
) -> None:
    proxy = LossyProxy(service.port)
    await proxy.start()
    try:
        url = f"http://127.0.0.1:{proxy.port}"
        token = agent_token(service)
        async with MemoryClient(
            url, token=token, project="shop", retry=FAST_RETRY, outbox_path=tmp_path / "o.db"
        ) as client:
            # Every attempt reaches the service, every answer is lost: the end is queued...
            proxy.drop_answers = FAST_RETRY.attempts
            conv = client.conversation("conv-1", caller=CALLER)
            conv.state["booking_day"] = "Friday"
            assert (await conv.end()).queued
            assert stored_fields(service) == {"booking_day": "Friday"}  # ...although it was applied
            # A later change must survive the delivery of the queued copy.
            http(
                "PATCH",
                f"{service.url}/v1/projects/shop/callers/{CALLER}/memory",
                OPERATOR_TOKEN,
                {"booking_day": "Monday"},
            )
            assert (await client.flush_outbox()).delivered == 1
            assert stored_fields(service) == {"booking_day": "Monday"}
            # One lost answer inside end(): the retry gets the replay.
            proxy.drop_answers = 1
            second = client.conversation("conv-2", caller=CALLER)
            second.state["caller_name"] = "Ada"
            result = await second.end()
            assert not result.queued and result.replayed and result.persisted == ("caller_name",)
    finally:
        await proxy.close()
