"""Webhook deliveries survive a kill -9 of the service: with deliveries queued (their receiver failing), the
service process is SIGKILLed and started again; once the receiver recovers, every delivery arrives, with the
``webhook-id`` it had before the kill. On SQLite, Redis and Redis Cluster."""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook

from tests.conftest import CLUSTER, OPERATOR_TOKEN, empty_store_url
from tests.support.service_process import ServiceProcess, http

PROJECT = "shop"
CALLS = 12


@pytest.mark.parametrize("backend", ["sqlite", "redis", CLUSTER])
async def test_queued_deliveries_survive_a_kill_and_arrive_with_their_ids(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    got: list[tuple[dict[str, str], bytes]] = []
    healthy = False

    async def hook(req: web.Request) -> web.Response:
        got.append((dict(req.headers), await req.read()))
        return web.Response(status=200 if healthy else 503)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    env = {
        "CALLER_MEMORY_SECRET_KEY": base64.b64encode(secrets.token_bytes(32)).decode(),
        "CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
        "CALLER_MEMORY_WEBHOOK_INTERVAL": "0.05",
        "CALLER_MEMORY_WEBHOOK_TIMEOUT": "2",
    }
    store_url = empty_store_url(request, backend, tmp_path)
    try:
        with ServiceProcess(store_url, tmp_path, env=env, access_log=False) as service:
            base = f"{service.url}/v1/projects/{PROJECT}"
            config = {"memory": {"repeat_caller": {"state_keys": ["a"]}}}
            await asyncio.to_thread(
                http, "PUT", f"{service.url}/v1/projects/{PROJECT}", OPERATOR_TOKEN, config
            )
            created = await asyncio.to_thread(
                http,
                "POST",
                f"{base}/webhooks",
                OPERATOR_TOKEN,
                {"url": url, "events": ["conversation.ended"]},
            )
            for n in range(CALLS):
                body = {"caller": f"+1415555{n:04d}", "state": {"a": n}}
                await asyncio.to_thread(http, "POST", f"{base}/conversations/c-{n}/end", OPERATOR_TOKEN, body)
            await until(lambda: len({h["webhook-id"] for h, _ in got}) == CALLS)  # each tried, and failed
            before = {orjson.loads(b)["data"]["conversation_id"]: h["webhook-id"] for h, b in got}
            service.kill()
            healthy = True
            service.start()
            # The retry comes after about 5 s (the schedule's first delay), from the new process.
            await until(lambda: len(delivered(got)) == CALLS, seconds=30)
            after = delivered(got)
            assert after == before  # every conversation, under the id it had before the kill
            for headers, raw in got:
                Webhook(created["secret"]).verify(raw, headers)
    finally:
        await runner.cleanup()


def delivered(got: list[tuple[dict[str, str], bytes]]) -> dict[str, str]:
    """Conversation id -> webhook-id of the attempts made once the receiver was healthy (the 200s are the
    last attempts of each delivery)."""
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    for headers, raw in got:
        seen[headers["webhook-id"]] = seen.get(headers["webhook-id"], 0) + 1
        if seen[headers["webhook-id"]] >= 2:
            out[orjson.loads(raw)["data"]["conversation_id"]] = headers["webhook-id"]
    return out


async def until(check: object, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)
