"""A platform's webhooks when their project holds its share of the requests in flight (SPEC 15: a call never
fails because memory did): a call start is still answered in time, without memory (never a 429), and counted
as failed open; an end event is refused with 429 as any request past the share (the platforms retry it), and
is taken once the share frees. Through a real server, on SQLite and Redis, with Retell's signed webhooks."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, Api, running_api

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
SECRET = "retell-api-key-" + "k" * 20
CALLER = "+14155550100"
CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name"], "retention": "P30D", "default_region": "US"},
        "conversation": {"enabled": True},
    }
}


async def stalled(release: asyncio.Event) -> AsyncIterator[bytes]:
    yield b"{"
    await release.wait()
    yield b"}"


async def hold_the_share(api: Api) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """A request of the project in flight (a PUT whose body stalls) until the event is set; the share is one."""
    headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}", "Content-Type": "application/json"}
    for _ in range(100):
        release = asyncio.Event()
        holder = asyncio.ensure_future(
            api.session.patch(
                f"{api.base_url}{BASE}/callers/{CALLER}/memory", data=stalled(release), headers=headers
            )
        )
        await asyncio.sleep(0.02)
        probe = await api.call("GET", BASE, token=OPERATOR_TOKEN)
        if probe.status == 429 and not holder.done():
            return release, holder
        release.set()
        (await holder).release()
    raise AssertionError("the stalled request never took the project's share")


async def retell(api: Api, path: str, document: dict[str, Any]) -> Any:
    body = orjson.dumps(document)
    at = str(api.clock.now_ms())
    digest = hmac.new(SECRET.encode(), body + at.encode(), hashlib.sha256).hexdigest()
    headers = {"Content-Type": "application/json", "x-retell-signature": f"v={at},d={digest}"}
    return await api.call("POST", f"{BASE}/platforms/retell/{path}", data=body, headers=headers)


def inbound() -> dict[str, Any]:
    return {"event": "call_inbound", "call_inbound": {"from_number": CALLER, "to_number": "+14155550000"}}


def analyzed(call_id: str) -> dict[str, Any]:
    now = time.time() * 1000
    call = {
        "call_id": call_id,
        "direction": "inbound",
        "from_number": CALLER,
        "to_number": "+14155550000",
        "start_timestamp": now - 60_000,
        "end_timestamp": now,
        "disconnection_reason": "user_hangup",
        "transcript_object": [{"role": "user", "content": "Brie please"}],
        "call_analysis": {"call_summary": "Asked for Brie.", "custom_analysis_data": {"name": "Ada"}},
    }
    return {"event": "call_analyzed", "call": call}


async def test_past_the_share_a_start_is_answered_without_memory_and_an_end_is_retried(
    store_url: str, clock: FakeClock
) -> None:
    settings = {
        "store_timeout": 5.0,
        "secret_key": secrets.token_bytes(32),
        "max_in_flight": 8,
        "max_in_flight_per_project": 1,
    }
    async with running_api(store_url, clock, **settings) as api:
        assert (await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)).status == 201
        reply = await api.call(
            "PUT", f"{BASE}/platforms/retell", token=OPERATOR_TOKEN, json={"secret": SECRET}
        )
        assert reply.status == 201, reply.body
        reply = await api.call(
            "PATCH", f"{BASE}/callers/{CALLER}/memory", token=OPERATOR_TOKEN, json={"caller_name": "Ada"}
        )
        assert reply.status == 200, reply.body
        # Within the share: the caller's memory.
        reply = await retell(api, "inbound", inbound())
        assert (
            reply.status == 200 and "Ada" in reply.body["call_inbound"]["dynamic_variables"]["caller_memory"]
        )
        release, holder = await hold_the_share(api)
        try:
            started = time.monotonic()
            reply = await retell(api, "inbound", inbound())
            assert reply.status == 200, reply.body
            variables = reply.body["call_inbound"]["dynamic_variables"]
            assert variables["caller_memory"] == "" and variables["memory_caller_name"] == ""
            assert time.monotonic() - started < 1.0
            refused = await retell(api, "events", analyzed("c-1"))
            assert refused.status == 429 and refused.headers["Retry-After"] == "1", refused.body
        finally:
            release.set()
            (await holder).release()
        # The share free again: the platform's retry of the end is taken.
        reply = await retell(api, "events", analyzed("c-1"))
        assert reply.status == 200 and reply.body["outcome"] in ("ended", "started_and_ended"), reply.body
        metrics = await api.session.get(f"{api.base_url}/metrics")
        text = await metrics.text()
        assert 'caller_memory_platform_events_total{kind="failed_open"} 1.0' in text
