"""The outbox when things go wrong around it: cancellations around an erasure (real service), refused
writes, corrupt and locked files, processes killed while they hold entries, cancelled deliveries."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import (
    AuthenticationError,
    MemoryClient,
    OutboxUnavailableError,
    PermissionDeniedError,
    RetryPolicy,
)

from tests.conftest import OPERATOR_TOKEN, Api
from tests.sdk.conftest import Serve, valid_end
from tests.support.service_process import free_port

CALLER = "+14155550100"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=0.5)
PROJECT = "cheese-shop"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens(PROJECT, {"state_keys": ["booking_day", "caller_name"]})


async def stored_fields(api: Api, admin: str) -> dict[str, Any]:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/callers/{CALLER}/memory", token=admin)
    assert reply.status == 200, reply.body
    fields: dict[str, Any] = reply.body["fields"]
    return fields


class Gate:
    """A forwarding proxy in front of the real service that, while closed, holds requests without
    forwarding them (the service never sees them)."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.closed = False
        self.held = asyncio.Event()
        self.opened = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        if self.closed:
            self.held.set()
            await self.opened.wait()
            raise web.HTTPServiceUnavailable()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.session.request(
            request.method,
            self.target + request.raw_path,
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as resp:
            body = await resp.read()
            kept = ("Content-Type", "ETag", "Idempotent-Replayed", "Retry-After")
            return web.Response(
                status=resp.status, body=body, headers={k: resp.headers[k] for k in kept if k in resp.headers}
            )


@pytest.fixture
async def gate(api: Api, serve: Serve) -> AsyncIterator[tuple[Gate, str]]:
    async with aiohttp.ClientSession() as session:
        gate = Gate(api.base_url, session)
        yield gate, await serve(gate.handle)
        gate.opened.set()


def _ms(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp() * 1000)


@pytest.mark.parametrize("restart", [False, True], ids=["same-conversation", "after-a-restart"])
async def test_a_cancelled_end_called_again_after_an_erasure_keeps_the_first_ended_at(
    api: Api, shop: dict[str, str], gate: tuple[Gate, str], tmp_path: Path, restart: bool
) -> None:
    proxy, url = gate
    outbox = tmp_path / "o.db"
    options: dict[str, Any] = {"token": shop["agent"], "project": PROJECT, "outbox_path": outbox}
    c = MemoryClient(url, retry=FAST, **options)
    async with c:
        conv = c.conversation("conv-1", caller=CALLER)
        conv.state["caller_name"] = "Ada"
        proxy.closed = True
        first = asyncio.create_task(conv.end())
        await proxy.held.wait()
        first.cancel()  # the agent framework tore the call down while the end was in flight
        with pytest.raises(asyncio.CancelledError):
            await first
        [entry] = await c.outbox.pending()
        ended_at = _ms(orjson.loads(entry.body)["ended_at"])
        # The caller is erased after the first end() was called (the service's clock says when).
        erase_at = ended_at + 1
        # The wall clock must pass the erasure (a few ms at most; no event says when): an ended_at made
        # by the second call, as the bug did, would then be later than the erasure and win over it.
        await asyncio.sleep(max(0.0, (erase_at + 2 - time.time() * 1000) / 1000))
        api.clock.advance((erase_at - api.clock.now_ms()) / 1000)
        erased = await api.call("DELETE", f"/v1/projects/{PROJECT}/callers/{CALLER}", token=shop["admin"])
        assert erased.status == 200, erased.body
        api.clock.advance(60)  # the second end() arrives later still
        proxy.closed = False
        proxy.opened.set()
        if not restart:
            result = await conv.end()
    if restart:  # a new process ends the same conversation: the outbox still has the first call's time
        async with MemoryClient(url, retry=FAST, deliver_outbox_on_start=False, **options) as again:
            conv = again.conversation("conv-1", caller=CALLER)
            conv.state["caller_name"] = "Ada"
            result = await conv.end()
            assert await again.outbox.pending() == []
    assert result.erased and not result.queued and result.persisted == ()
    assert await stored_fields(api, shop["admin"]) == {}  # the erased memory did not come back


async def test_a_revoked_tokens_write_is_set_aside_not_deleted(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    minted = await api.call(
        "POST", f"/v1/projects/{PROJECT}/tokens", token=OPERATOR_TOKEN, json={"role": "agent"}
    )
    revoked = await api.call(
        "DELETE", f"/v1/projects/{PROJECT}/tokens/{minted.body['token_id']}", token=shop["admin"]
    )
    assert revoked.status == 204
    outbox = tmp_path / "o.db"
    for token, refusal, conversation in (
        (minted.body["token"], AuthenticationError, "conv-1"),
        (shop["analytics"], PermissionDeniedError, "conv-2"),  # a token whose role cannot end calls
    ):
        async with MemoryClient(api.base_url, token=token, project=PROJECT, outbox_path=outbox) as c:
            conv = c.conversation(conversation, caller=CALLER)
            conv.state["booking_day"] = "Friday"
            with pytest.raises(refusal):
                await conv.end()
    async with MemoryClient(
        api.base_url, token=shop["agent"], project=PROJECT, outbox_path=outbox, deliver_outbox_on_start=False
    ) as fixed:
        kept = await fixed.outbox.rejected()
        assert [e.conversation_id for e in kept] == ["conv-1", "conv-2"]
        assert "401" in (kept[0].rejected or "") and "403" in (kept[1].rejected or "")
        assert await fixed.outbox.retry_rejected() == 2  # the operator fixed the token
        assert (await fixed.flush_outbox()).delivered == 2
    assert await stored_fields(api, shop["admin"]) == {"booking_day": "Friday"}


# The file itself ----------------------------------------------------------------------------------------


async def test_a_corrupt_outbox_is_the_sdks_own_error(tmp_path: Path) -> None:
    corrupt = tmp_path / "o.db"
    corrupt.write_bytes(b"this is not a database, " * 400)
    with pytest.raises(OutboxUnavailableError, match="cannot be used"):
        async with MemoryClient("http://127.0.0.1:1", token="t", project="p", outbox_path=corrupt):
            pass
    with pytest.raises(OutboxUnavailableError):
        async with MemoryClient("http://127.0.0.1:1", token="t", project="p", outbox_path=tmp_path):
            pass  # a directory


@pytest.mark.parametrize("journal", ["wal", "delete"])
async def test_a_locked_outbox_fails_within_its_timeout_with_the_sdks_own_error(
    serve: Serve, tmp_path: Path, journal: str
) -> None:
    async def service(request: web.Request) -> web.Response:
        return web.json_response(valid_end(request))

    url = await serve(service)
    path = tmp_path / "o.db"
    if journal == "wal":  # an outbox in use: another process holds its write lock
        async with MemoryClient(url, token="t", project="p", outbox_path=path):
            pass
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")
        options: dict[str, Any] = {"token": "t", "project": "p", "outbox_path": path, "retry": FAST}
        started = time.perf_counter()
        if journal == "delete":  # locked before the SDK ever opened it
            with pytest.raises(OutboxUnavailableError, match="locked"):
                async with MemoryClient(url, outbox_timeout=0.2, **options):
                    pass
            assert time.perf_counter() - started < 1.0
            return
        async with MemoryClient(url, outbox_timeout=0.2, deliver_outbox_on_start=False, **options) as c:
            conv = c.conversation("conv-1", caller=CALLER)
            conv.state["booking_day"] = "Friday"
            assert (await conv.end()).persisted == ("booking_day",)  # not kept, but delivered
            with pytest.raises(OutboxUnavailableError, match="locked"):
                await c.flush_outbox()
            c.base_url = f"http://127.0.0.1:{free_port()}"  # now nothing answers either
            lost = c.conversation("conv-2", caller=CALLER)
            with pytest.raises(OutboxUnavailableError, match="this write is lost"):
                await lost.end()
        assert time.perf_counter() - started < 2.0  # each wait stopped at the 0.2 s timeout
    finally:
        other.close()


# Processes and deliveries -------------------------------------------------------------------------------

AGENT = """
import asyncio, sys
from caller_memory.sdk import MemoryClient

async def main():
    async with MemoryClient(sys.argv[1], token="t", project="p", outbox_path=sys.argv[2]) as client:
        conv = client.conversation("conv-1", caller="+14155550100")
        conv.state["booking_day"] = "Friday"
        await conv.end()

asyncio.run(main())
"""


async def test_the_entries_of_a_killed_process_are_delivered_at_once(serve: Serve, tmp_path: Path) -> None:
    arrived, answering = asyncio.Event(), asyncio.Event()
    delivered: list[dict[str, Any]] = []

    async def service(request: web.Request) -> web.Response:
        if not answering.is_set():
            arrived.set()
            await answering.wait()
            raise web.HTTPServiceUnavailable()
        delivered.append(orjson.loads(await request.read()))
        return web.json_response(valid_end(request))

    url = await serve(service)
    outbox = tmp_path / "o.db"
    agent = await asyncio.create_subprocess_exec(sys.executable, "-c", AGENT, url, str(outbox))
    try:
        await arrived.wait()  # the agent process wrote its entry and is sending it (default lease: 15 s)
        async with MemoryClient(
            url, token="t", project="p", outbox_path=outbox, deliver_outbox_on_start=False
        ) as c:
            report = await c.flush_outbox()
            assert (report.delivered, report.remaining) == (0, 1)  # a live holder's lease is respected
            agent.kill()
            await agent.wait()
            answering.set()
            report = await c.flush_outbox()  # no wait for the dead process's lease
            assert (report.delivered, report.remaining) == (1, 0)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        answering.set()
    assert [body["state"] for body in delivered] == [{"booking_day": "Friday"}]


async def test_a_cancelled_delivery_leaves_nothing_claimed(serve: Serve, tmp_path: Path) -> None:
    arrived, done = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        arrived.set()
        await done.wait()
        return web.Response(status=503)

    url = await serve(hang)
    c = MemoryClient(
        url, token="t", project="p", outbox_path=tmp_path / "o.db", deliver_outbox_on_start=False
    )
    async with c:
        for i in range(3):
            await c.outbox.add(f"conv-{i}", b'{"state": {}}', lease=0)
        delivery = asyncio.create_task(c.flush_outbox())
        await arrived.wait()
        delivery.cancel()
        with pytest.raises(asyncio.CancelledError):
            await delivery
    done.set()
    assert len(await c.outbox.claim(10, lease=1)) == 3  # the whole batch is in line again
    await c.outbox.close()
