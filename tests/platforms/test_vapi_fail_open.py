"""Vapi's ``assistant-request`` while the store is slow or down (SPEC section 15, "At call start"): the answer
still names the connection's assistant with every variable, empty, within a second (Vapi's deadline is
7.5 s), and is counted; a connection whose secret no longer opens answers the same without reading anything.
The store is a redis-server of the test's own, paused (SIGSTOP) and then killed."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import running_api
from tests.http.test_webhooks import receiver
from tests.platforms.test_vapi_events import ASSISTANT, CALLER, VARIABLES, open_vapi, vapi_settings
from tests.support.redis_server import RedisServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def empty_answer(body: dict[str, object]) -> bool:
    overrides = body["assistantOverrides"]
    assert isinstance(overrides, dict)
    variables = overrides["variableValues"]
    return (
        body["assistantId"] == ASSISTANT
        and set(variables) == VARIABLES
        and all(variables[name] == "" for name in VARIABLES - {"returning_caller"})
        and variables["returning_caller"] == "false"
    )


async def test_an_assistant_request_fails_open_while_the_store_is_slow_then_down(
    own_redis: RedisServer, clock: FakeClock
) -> None:
    settings = vapi_settings(store_timeout=0.3)
    async with receiver() as hook, running_api(own_redis.url, clock, **settings) as api:
        vapi = await open_vapi(api, hook)
        await api.call(
            "PATCH",
            f"/v1/projects/cheese-shop/callers/{CALLER}/memory",
            token=vapi.admin,
            json={"cheese": "Stilton"},
        )
        reply = await vapi.send(vapi.assistant_request(str(uuid.uuid4())))
        assert reply.body["assistantOverrides"]["variableValues"]["memory_cheese"] == "Stilton"
        os.kill(own_redis.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            reply = await vapi.send(vapi.assistant_request(str(uuid.uuid4())))
            assert time.monotonic() - began < 1.5
            assert reply.status == 200 and empty_answer(reply.body), reply.body
        finally:
            os.kill(own_redis.pid, signal.SIGCONT)
        own_redis.kill()
        began = time.monotonic()
        reply = await vapi.send(vapi.assistant_request(str(uuid.uuid4())))
        assert time.monotonic() - began < 1.5
        assert reply.status == 200 and empty_answer(reply.body), reply.body
        # An end while the store is down is not taken (Vapi may send it again): a 503, nothing claimed.
        assert (await vapi.send(vapi.report(str(uuid.uuid4())))).status == 503
        metrics = await api.call("GET", "/metrics")
        assert 'kind="failed_open"' in str(metrics.body)


async def test_a_secret_that_no_longer_opens_answers_without_memory(store_url: str, clock: FakeClock) -> None:
    async with receiver() as hook, running_api(store_url, clock, **vapi_settings()) as api:
        vapi = await open_vapi(api, hook)
    # The service restarted with another key and without the previous one: the stored secret does not open.
    async with running_api(store_url, clock, **vapi_settings()) as api:
        vapi.api = api
        reply = await vapi.send(vapi.assistant_request(str(uuid.uuid4())))
        assert reply.status == 200 and empty_answer(reply.body), reply.body
        reply = await vapi.send(vapi.report(str(uuid.uuid4())))
        assert reply.status == 503 and reply.body["type"].endswith("platforms-not-configured")
