"""The SDK against servers that misbehave, on real loopback sockets: redirects, answers of the wrong shape,
huge and compressed bodies, error pages echoing the number, cancellations. In every case no write is lost
and nothing is raised into agent code (issue 12)."""

from __future__ import annotations

import asyncio
import functools
import gzip
import logging
import re
import time
import zlib
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import CircuitBreaker, InvalidRequestError, MemoryClient, RetryPolicy

from tests.sdk.conftest import Serve, valid_end

CALLER = "+14155550100"
NATIONAL = "4155550100"
FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=0.5)
BUDGET = 0.15
#: What a read may take beyond its budget on a loaded machine.
MARGIN = 0.1


VALID_MEMORY: dict[str, Any] = {
    "identifier": CALLER,
    "fields": {"caller_name": "Ada"},
    "expires_at": "2030-01-01T00:00:00Z",
    "blacklisted": False,
}


def client(url: str, tmp_path: Path, **options: Any) -> MemoryClient:
    """A client whose reads have time (a loaded machine): what a server sends is tested here; the read
    budget only where a test says so."""
    options.setdefault("retry", FAST)
    options.setdefault("read_budget", 2.0)
    return MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db", **options)


async def assert_kept(c: MemoryClient, state: dict[str, Any]) -> None:
    """The write is in the outbox, in line for delivery (not set aside, not locked)."""
    [entry] = await c.outbox.pending()
    assert orjson.loads(entry.body)["state"] == state
    assert await c.outbox.rejected() == []
    assert [e.id for e in await c.outbox.claim(10, lease=1)] == [entry.id]  # nobody holds it
    await c.outbox.release(entry.id)


def shows_number(text: str) -> bool:
    """Whether ``text`` shows the test number in any form: percent-encoded (once or twice), with separators."""
    for _ in range(3):
        text = unquote(text)
    return NATIONAL in re.sub(r"\D", "", text)


# Redirects --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_no_redirect_is_followed(serve: Serve, tmp_path: Path, status: int) -> None:
    elsewhere: list[str] = []

    async def other_origin(request: web.Request) -> web.Response:
        elsewhere.append(request.method)  # the number would be in this URL, the state in this body
        return web.json_response(VALID_MEMORY if request.method == "GET" else valid_end(request))

    target = await serve(other_origin)

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": target + request.path_qs})

    url = await serve(redirect)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        await conv.begin_turn()
        assert (
            not conv.memory.available and len(conv.memory) == 0 and str(status) in (conv.memory.reason or "")
        )
        conv.state["booking_day"] = "Friday"
        assert (await conv.end()).queued
        await assert_kept(c, {"booking_day": "Friday"})
        assert (await c.flush_outbox()).remaining == 1
        await assert_kept(c, {"booking_day": "Friday"})
    assert elsewhere == []


# Shapes -----------------------------------------------------------------------------------------------


class Merged(dict[str, Any]):
    """A change merged into the documented answer (any other value is the whole body)."""


WRONG_ENDS: list[tuple[int, Any]] = [
    (200, {}),
    (200, {"ok": True}),
    (200, []),
    (200, None),
    (200, "ok"),
    (200, Merged(persisted="booking_day")),
    (200, Merged(persisted=[1])),
    (200, Merged(ignored=None)),
    (200, Merged(blacklisted="false")),
    (200, Merged(erased=0)),
    (200, Merged(repeat_caller=[])),
    (200, Merged(conversation_id="another-conversation")),
    (200, Merged(conversation_id=None)),
    (201, Merged()),  # the documented body with a status the end never answers
    (401, {"title": 5, "status": 401}),  # 4xx whose problem document has the wrong types
    (422, {"title": "Invalid", "status": 422, "errors": "state"}),
    (409, {"title": "Conflict", "status": 500}),  # a problem document that contradicts the status
    (403, "<html>captive portal</html>"),
]


@pytest.mark.parametrize(("status", "change"), WRONG_ENDS)
async def test_an_end_answered_with_the_wrong_shape_keeps_the_write(
    serve: Serve, tmp_path: Path, status: int, change: Any
) -> None:
    async def answer(request: web.Request) -> web.Response:
        if isinstance(change, Merged):
            return web.json_response(valid_end(request) | change, status=status)
        if isinstance(change, str) and change.startswith("<html>"):
            return web.Response(status=status, text=change, content_type="text/html")
        return web.Response(status=status, body=orjson.dumps(change), content_type="application/json")

    url = await serve(answer)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        conv.state["booking_day"] = "Friday"
        result = await conv.end()
        assert result.queued and result.persisted == ()
        await assert_kept(c, {"booking_day": "Friday"})
        report = await c.flush_outbox()  # the outbox delivery takes the same answer: no raise, no lock
        assert (report.delivered, report.remaining, report.rejected) == (0, 1, 0)
        await assert_kept(c, {"booking_day": "Friday"})


WRONG_MEMORIES: list[Any] = [
    {},
    [],
    None,
    "fields",
    12,
    Merged(fields=[]),
    Merged(fields="caller_name"),
    Merged(fields=None),
    Merged(blacklisted="no"),
    Merged(expires_at=5),
    Merged(identifier=14155550100),
    Merged(identifier=None),
]


@pytest.mark.parametrize("change", WRONG_MEMORIES)
async def test_a_read_answered_with_the_wrong_shape_is_empty_memory(
    serve: Serve, tmp_path: Path, change: Any
) -> None:
    async def answer(request: web.Request) -> web.Response:
        body = VALID_MEMORY | change if isinstance(change, Merged) else change
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    url = await serve(answer)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        memory = await conv.begin_turn()  # never raises for what a server sent
        assert not memory.available and len(memory) == 0 and "not the service's" in (memory.reason or "")


async def test_a_304_to_a_first_read_is_not_memory(serve: Serve, tmp_path: Path) -> None:
    async def not_modified(request: web.Request) -> web.Response:
        return web.Response(status=304, headers={"ETag": '"x"'})

    url = await serve(not_modified)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        assert not (await conv.begin_turn()).available


@pytest.mark.parametrize("encoding", ["identity", "gzip", "deflate", "gzip-twice"])
async def test_the_documented_answers_are_accepted_plain_or_compressed(
    serve: Serve, tmp_path: Path, encoding: str
) -> None:
    """The control of the tests above: the same server with the documented shapes is a success (extra
    members, as a newer service may add, are ignored)."""

    def encoded(body: dict[str, Any]) -> web.Response:
        raw = orjson.dumps(body | {"added_later": True})
        headers = {"Content-Type": "application/json"}
        if encoding == "gzip":
            raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
        elif encoding == "deflate":
            raw, headers["Content-Encoding"] = zlib.compress(raw), "deflate"
        elif encoding == "gzip-twice":
            raw, headers["Content-Encoding"] = gzip.compress(gzip.compress(raw)), "gzip, gzip"
        return web.Response(body=raw, headers=headers)

    async def answer(request: web.Request) -> web.Response:
        return encoded(VALID_MEMORY if request.method == "GET" else valid_end(request))

    url = await serve(answer)
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        memory = await conv.begin_turn()
        assert memory.available and memory.fields() == {"caller_name": "Ada"}
        conv.state["booking_day"] = "Friday"
        result = await conv.end()
        assert not result.queued and result.persisted == ("booking_day",)
        assert await c.outbox.pending() == [] and await c.outbox.rejected() == []


# Sizes ------------------------------------------------------------------------------------------------


@functools.cache
def gzip_bomb() -> bytes:
    """64 gzip members of 1 MiB of spaces each: 64 MiB decoded from about 70 KB."""
    member = gzip.compress(b" " * (1 << 20), compresslevel=9)
    return gzip.compress(b'{"fields": {"a": "') + member * 64


@functools.cache
def deflate_bomb() -> bytes:
    """64 MiB of spaces in one zlib stream (deflate has no members to repeat)."""
    deflater = zlib.compressobj(1)
    chunk = b" " * (1 << 20)
    return b"".join(
        [deflater.compress(b"["), *(deflater.compress(chunk) for _ in range(64)), deflater.flush()]
    )


BIG = b'{"fields": {"a": "' + b"x" * (20 << 20) + b'"}}'


@pytest.mark.parametrize("kind", ["20 MB", "20 MB chunked", "gzip bomb", "deflate bomb", "br"])
async def test_huge_and_compressed_bodies_are_refused_within_the_budget(
    serve: Serve, tmp_path: Path, kind: str
) -> None:
    bombs = {"gzip bomb": gzip_bomb(), "deflate bomb": deflate_bomb()}  # made before the clock starts

    async def answer(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"}
        if kind == "gzip bomb":
            return web.Response(body=bombs[kind], headers=headers | {"Content-Encoding": "gzip"})
        if kind == "deflate bomb":
            return web.Response(body=bombs[kind], headers=headers | {"Content-Encoding": "deflate"})
        if kind == "br":  # a coding the SDK did not ask for
            return web.Response(body=b"\x0b\x02\x80{}\x03", headers=headers | {"Content-Encoding": "br"})
        if kind == "20 MB":
            return web.Response(body=BIG, headers=headers)
        response = web.StreamResponse(headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(BIG), 1 << 20):
            await response.write(BIG[start : start + (1 << 20)])
        await response.write_eof()
        return response

    url = await serve(answer)
    # An injected session with aiohttp's defaults (auto_decompress=True) changes nothing: the SDK decodes.
    async with (
        aiohttp.ClientSession() as session,
        client(url, tmp_path, session=session, read_budget=BUDGET) as c,
    ):
        conv = c.conversation("conv-1", caller=CALLER)
        started = time.perf_counter()
        memory = await conv.begin_turn()
        elapsed = time.perf_counter() - started
        assert not memory.available and len(memory) == 0
        assert elapsed < BUDGET + MARGIN, elapsed
        conv.state["booking_day"] = "Friday"
        assert (await conv.end()).queued
        await assert_kept(c, {"booking_day": "Friday"})


# Circuit ----------------------------------------------------------------------------------------------


async def test_a_cancelled_probe_does_not_leave_the_circuit_open(serve: Serve, tmp_path: Path) -> None:
    mode = "fail"
    probed, done = asyncio.Event(), asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        if mode == "fail":
            return web.Response(status=503)
        if mode == "hang":
            probed.set()
            await done.wait()
        return web.json_response(VALID_MEMORY)

    url = await serve(answer)
    circuit = CircuitBreaker(failures=1, reset_after=0.0)
    async with client(url, tmp_path, circuit=circuit, read_budget=5.0) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        await conv.begin_turn()
        assert circuit.is_open
        mode = "hang"
        probe = asyncio.create_task(conv.begin_turn())
        await probed.wait()
        probe.cancel()  # the agent's turn was cancelled while its read was the probe
        with pytest.raises(asyncio.CancelledError):
            await probe
        mode = "ok"
        memory = await conv.begin_turn()  # the next read probes again, and closes the circuit
        assert memory.available and memory["caller_name"] == "Ada" and not circuit.is_open
        done.set()


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [
        (400, b"Bad Request", "text/plain"),  # aiohttp's parser on a request line too long
        (414, b"URI Too Long", "text/plain"),
        (
            422,
            b'{"type":"x","title":"Invalid","status":422,"detail":"not a phone number"}',
            "application/problem+json",
        ),
    ],
)
async def test_client_errors_do_not_open_the_circuit(
    serve: Serve, tmp_path: Path, status: int, body: bytes, content_type: str
) -> None:
    async def answer(request: web.Request) -> web.Response:
        if "bad" in request.path:
            return web.Response(status=status, body=body, content_type=content_type)
        if "503" in request.path:
            return web.Response(status=503)
        return web.json_response(VALID_MEMORY)

    url = await serve(answer)
    circuit = CircuitBreaker(failures=2, reset_after=60)
    async with client(url, tmp_path, circuit=circuit) as c:
        for i in range(5):
            bad = c.conversation(f"conv-{i}", caller="bad" + "9" * 100)
            assert not (await bad.begin_turn()).available
        assert not circuit.is_open
        assert (await c.conversation("conv-good", caller=CALLER).begin_turn()).available
        for i in range(2):  # the control: outages do open it
            await c.conversation(f"down-{i}", caller="+1 503").begin_turn()
        assert circuit.is_open


# Masking ----------------------------------------------------------------------------------------------

FORMS = ["+14155550100", "+1 415 555 0100", "(415) 555-0100", "+1/415/555/0100", "+1_415_555_0100"]


@pytest.mark.parametrize("caller", FORMS)
async def test_error_documents_echoing_the_path_are_masked(
    serve: Serve, tmp_path: Path, caller: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        detail = f"nothing at {request.raw_path} (that is {unquote(request.raw_path)!r}; {body[:40]!r})"
        status = 404 if request.method == "GET" else 422
        problem = {"type": "x", "title": f"Not here: {request.raw_path}", "status": status, "detail": detail}
        if status == 422:
            problem["errors"] = [
                {"field": "caller", "message": f"{unquote(request.raw_path)} is not allowed"}
            ]
        return web.Response(
            status=status, body=orjson.dumps(problem), content_type="application/problem+json"
        )

    url = await serve(echo)
    caplog.set_level(logging.DEBUG, logger="caller_memory.sdk")
    async with client(url, tmp_path) as c:
        conv = c.conversation("conv-1", caller=caller)
        memory = await conv.begin_turn()
        assert not memory.available and "404" in (memory.reason or "")
        conv.state["booking_day"] = "Friday"
        with pytest.raises(InvalidRequestError) as refused:
            await conv.end()
        [kept] = await c.outbox.rejected()  # set aside, not deleted
        shown = [memory.reason or "", str(refused.value), refused.value.detail, kept.rejected or ""]
        shown += [str(refused.value.problem), str(refused.value.errors)]
        assert refused.value.errors[0]["field"] == "caller"
    records = [r.getMessage() for r in caplog.records if r.name.startswith("caller_memory.sdk")]
    assert len(records) >= 2  # the read and the refusal were logged...
    assert [text for text in records + shown if shows_number(text)] == []  # ...without the number
    assert "[number]" in refused.value.detail
