"""After a realistic run, no phone number, email address or account id in any form is in the store (every
byte), the logs, the metrics, the webhook payloads a receiver got, or the archive."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.support.redis_server import RedisServer

#: What the run's webhook receiver got (bodies and headers).
RECEIVED: list[bytes] = []


@pytest.fixture
async def receiver() -> AsyncIterator[str]:
    async def hook(request: web.Request) -> web.Response:
        RECEIVED.append(b"\n".join([await request.read(), *(v.encode() for v in request.headers.values())]))
        return web.Response(status=204)

    RECEIVED.clear()
    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    finally:
        await runner.cleanup()


@pytest.fixture
async def api(store_url: str, clock: FakeClock, tmp_path: Path) -> AsyncIterator[Api]:
    """The service with webhooks (history included) and the archive on."""
    async with running_api(
        store_url,
        clock,
        store_timeout=5.0,
        secret_key=b"s" * 32,
        webhook_allow_hosts=("127.0.0.1",),
        webhook_history=True,
        webhook_interval=0.05,
        archive_url=f"file://{tmp_path}/archive",
    ) as api:
        yield api


# (E.164, forms a number may be written in) for every number the run uses.
NUMBERS = {
    "+14155550100": ["(415) 555-0100", "+1 415 555 0100"],
    "+447700900123": ["07700 900123", "+44 7700 900123"],
    "+33612345678": ["+33 6 12 34 56 78"],
    "+442079460000": ["020 7946 0000"],  # blacklisted
    "+4915112345678": ["+49 151 12345678"],  # only ever sent in malformed requests
}


def forms(e164: str, written: list[str]) -> set[str]:
    digits = e164[1:]
    national = digits[2:] if e164.startswith(("+44", "+33", "+49")) else digits[1:]
    out = {e164, digits, national, "0" + national, *written}
    out |= {w.replace(" ", "") for w in written}
    out |= {w.replace(" ", "%20").replace("+", "%2B") for w in written}
    return out


#: Email addresses and account ids the run links, reads, ends, says and erases through, and their forms.
EMAILS = ["ada.lovelace@example.com", "grace@navy.example.org", "tester@example.com"]  # the last: blacklisted
ACCOUNTS = ["acct-zeta-qx", "KX-778"]


def identifier_forms() -> set[str]:
    out: set[str] = set()
    for email in EMAILS:
        local, _, domain = email.partition("@")
        out |= {email, email.upper(), f"{local}%40{domain}", f"{local.title()}@{domain.title()}"}
    return out | set(ACCOUNTS)


ALL_FORMS = sorted(
    {f for e164, written in NUMBERS.items() for f in forms(e164, written)} | identifier_forms(),
    key=len,
    reverse=True,
)


def find_numbers(blob: bytes) -> list[str]:
    """Every phone number, email address or account id of the run found in ``blob``."""
    return [f for f in ALL_FORMS if f.encode() in blob]


REPEAT_CALLER = {
    "analytics_enabled": True,
    "state_keys": ["caller_name", "booking_day", "phone_on_file", "verified"],
    "field_ttls": {"verified": "PT1H"},
    "identifier_blacklist": ["020 7946 0000", "email:tester@example.com"],
    "default_region": "GB",
    "identity_linking": True,
}


async def calls_through_other_identifiers(api: Api, agent: str, admin: str) -> None:
    """Link emails and account ids, read and end through them in every form, say them in a transcript, send
    malformed ones, erase through one."""
    base = "/v1/projects/cheese-shop/callers"
    conversations = "/v1/projects/cheese-shop/conversations"
    ada, grace = EMAILS[0], EMAILS[1]
    links = [(f"email:{ada.upper()}", "+14155550100"), (f"account:{ACCOUNTS[0]}", "+14155550100"),
             (f"Email:{grace}", "+33612345678"), (f"account:{ACCOUNTS[1]}", "+33612345678")]  # fmt: skip
    for identifier, phone in links:
        reply = await api.call("POST", f"{base}/{phone}/links", token=admin, json={"identifier": identifier})
        assert reply.status == 201, reply.body
    await api.call("GET", f"{base}/{links[0][1]}/links", token=admin)
    local, _, domain = ada.partition("@")
    for form in (
        f"email:{ada}",
        f"EMAIL:{local}%40{domain}",
        f"email:%20{ada.title()}",
        f"account:{ACCOUNTS[0]}",
    ):
        await api.call("GET", f"{base}/{form}/memory?attestation=TN-Validation-Passed-A", token=agent)
        await api.call("PATCH", f"{base}/{form}/memory", token=admin, json={"caller_name": "Ada"})
    for i, identifier in enumerate([f"email:{grace}", f"account:{ACCOUNTS[1]}", f"email:{EMAILS[2]}"]):
        body: dict[str, object] = {
            "caller": identifier,
            "state": {"booking_day": "Monday"},
            "outcome": {"qa": "resolved"},
        }
        await api.call("POST", f"{conversations}/x{i}/end", token=agent, json=body)
    # A call through an email in which the caller spells out their email and account id.
    start = {"caller": f"email:{ada}", "channel": "chat"}
    await api.call("POST", f"{conversations}/mail-1/start", token=agent, json=start)
    said = [f"write to {ada} or {ada.upper()}", f"my account is {ACCOUNTS[0]}", f"or mail {grace}"]
    messages = [{"role": "user", "content": text, "turn_id": n} for n, text in enumerate(said)]
    body = {"caller": f"email:{ada}", "channel": "chat", "messages": messages}
    await api.call("POST", f"{conversations}/mail-1/messages", token=agent, json=body)
    await api.call("POST", f"{conversations}/mail-1/end", token=agent, json={"caller": f"email:{ada}"})
    # Malformed ones, in paths and bodies, and links that are refused.
    await api.call("GET", f"{base}/email:{local}@@{domain}/memory", token=agent)
    await api.call("GET", f"{base}/account:{ACCOUNTS[0]}!/memory", token=agent)
    await api.call("POST", f"{base}/+14155550100/links", token=admin, json={"identifier": f"email:{local}"})
    await api.call("POST", f"{base}/+14155550100/links", token=agent, json={"identifier": f"email:{grace}"})
    await api.call("POST", f"{base}/+14155550100/links", token=admin, json={"identifier": f"email:{grace}"})
    await api.call("DELETE", f"{base}/+14155550100/links/account:{ACCOUNTS[0]}", token=admin)
    await api.call("DELETE", f"{base}/email:{grace}", token=admin)  # erases +33612345678's profile too


async def calls_with_spoken_numbers(api: Api, agent: str, admin: str) -> None:
    """Transcripts in which callers and agents say phone numbers (their own and others'), in every form."""
    conversations = "/v1/projects/cheese-shop/conversations"
    for i, (e164, written) in enumerate(NUMBERS.items()):
        if e164 == "+4915112345678":
            continue
        caller = written[0]
        said = [f"you can reach me on {form}, thanks" for form in [e164, *written]]
        messages = [
            {"role": "user", "content": text, "turn_id": turn, "metadata": {"source": "asr"}}
            for turn, text in enumerate(said)
        ]
        messages.append(
            {
                "role": "assistant",
                "content": "So that is ",
                "turn_id": len(said),
                "metadata": {"source": "llm", "interrupted": True, "original": f"So that is {written[-1]}?"},
            }
        )
        await api.call(
            "POST", f"{conversations}/t{i}/start", token=agent, json={"caller": caller, "channel": "phone"}
        )
        await api.call("POST", f"{conversations}/t{i}/messages", token=agent, json={
            "messages": messages, "state": {"phone_on_file": "yes", "caller_name": f"Caller {i}"}})  # fmt: skip
        await api.call("PUT", f"{conversations}/t{i}/summary", token=agent, json={
            "text": f"Caller gave {written[0]} as their number", "through_turn": 1})  # fmt: skip
        for path in ("/history", "/history?format=openai", "/context?max_tokens=500", ""):
            await api.call("GET", f"{conversations}/t{i}{path}", token=agent)
        await api.call("GET", f"/v1/projects/cheese-shop/callers/{caller}/conversations", token=admin)
    await api.call(
        "POST", f"{conversations}/t0/end", token=agent, json={"caller": NUMBERS["+14155550100"][0]}
    )
    api.clock.advance(31 * 60)  # the others end by inactivity (run by the sweep below)


async def realistic_run(api: Api, receiver: str) -> None:
    conversation = {"enabled": True, "archive": True}
    config = {"memory": {"repeat_caller": REPEAT_CALLER, "conversation": conversation}}
    await api.call("PUT", "/v1/projects/cheese-shop", token=OPERATOR_TOKEN, json=config)
    hook = {"url": receiver, "events": ["conversation.ended", "caller.erased"], "include_history": True}
    assert (
        await api.call("POST", "/v1/projects/cheese-shop/webhooks", token=OPERATOR_TOKEN, json=hook)
    ).status == 201
    admin = await api.mint("cheese-shop", "admin")
    agent = await api.mint("cheese-shop", "agent")
    base = "/v1/projects/cheese-shop/callers"
    await calls_with_spoken_numbers(api, agent, admin)
    await calls_through_other_identifiers(api, agent, admin)
    for e164, written in NUMBERS.items():
        if e164 == "+4915112345678":
            continue
        for i, form in enumerate([e164, *written]):
            await api.call(
                "PATCH",
                f"{base}/{form}/memory",
                token=admin,
                json={"caller_name": f"Caller {i}", "verified": True},
            )
            await api.call("GET", f"{base}/{form}/memory", token=agent)
    for i, written in enumerate(NUMBERS.values()):
        for j, form in enumerate(written):
            body = {"caller": form, "state": {"booking_day": "Friday"}, "outcome": {"qa": "resolved"}}
            await api.call(
                "POST", f"/v1/projects/cheese-shop/conversations/c{i}-{j}/end", token=agent, json=body
            )
    await api.call("GET", "/v1/projects/cheese-shop/analytics/conversations", token=admin)
    await api.call(
        "GET", "/v1/projects/cheese-shop/analytics/conversations", token=admin, headers={"Accept": "text/csv"}
    )
    await api.call("GET", "/v1/projects/cheese-shop/analytics/repeat-callers", token=admin)
    await api.call("DELETE", f"{base}/+447700900123", token=admin)  # leaves a tombstone and an audit record
    api.clock.advance(3601)
    await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    await api.call("GET", "/v1/projects/cheese-shop/audit", token=admin)
    await api.call("DELETE", f"{base}/+33612345678/memory/verified", token=admin)
    await api.call("DELETE", f"{base}/+33 6 12 34 56 78", token=admin)
    # Bad requests that carry numbers: too long, with an extension, unknown routes, wrong role, wrong key.
    await api.call("GET", f"{base}/+4915112345678999999/memory", token=agent)
    await api.call("GET", f"{base}/+49 151 12345678 ext. 12/memory", token=agent)
    await api.call("GET", f"{base}/+49 151 12345678/nothing", token=agent)
    await api.call("PATCH", f"{base}/+49 151 12345678/memory", token=agent, json={"caller_name": "x"})
    await api.call(
        "PATCH", f"{base}/+4915112345678/memory", token=admin, json={"not_allowed": "+4915112345678"}
    )
    await api.call("GET", f"{base}/+4915112345678/memory", token="cm_000000000000_+4915112345678")
    await api.call(
        "PUT",
        "/v1/projects/cheese-shop",
        token=OPERATOR_TOKEN,
        json={
            "memory": {
                "repeat_caller": {"identifier_blacklist": ["+49 151 12345678", "+4915112345678000000"]}
            }
        },
    )


def sqlite_blobs(path: Path) -> tuple[dict[str, bytes], bool]:
    """A SQL dump of the database and the raw bytes of its files (main, WAL, shared memory)."""
    conn = sqlite3.connect(path)
    blobs = {"sql dump": "\n".join(conn.iterdump()).encode()}
    stored = conn.execute("SELECT count(*) FROM fields").fetchone()[0] > 0
    conn.close()
    for suffix in ("", "-wal", "-shm"):
        file = Path(str(path) + suffix)
        if file.exists():
            blobs[file.name] = file.read_bytes()
    return blobs, stored


def redis_blobs(server: RedisServer) -> tuple[dict[str, bytes], bool]:
    """Every key, its DUMP serialisation and its values as read back."""
    blobs: dict[str, bytes] = {}
    stored = False
    with server.client() as client:
        for key in client.scan_iter(count=1000):
            kind = client.type(key).decode()
            parts = [key, client.dump(key) or b""]
            if kind == "hash":
                parts += [b for kv in client.hgetall(key).items() for b in kv]
                stored = stored or b":m:" in key
            elif kind == "string":
                parts.append(client.get(key) or b"")
            elif kind == "zset":
                parts += [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
            elif kind == "list":
                parts += client.lrange(key, 0, -1)
            elif kind == "set":
                parts += sorted(client.smembers(key))
            elif kind == "stream":
                parts += [b for _, entry in client.xrange(key) for kv in entry.items() for b in kv]
            blobs[key.decode()] = b"\n".join(parts)
    return blobs, stored


async def test_no_phone_number_in_store_or_logs(
    api: Api,
    captured_logs: pytest.LogCaptureFixture,
    store_url: str,
    request: pytest.FixtureRequest,
    receiver: str,
    tmp_path: Path,
) -> None:
    await realistic_run(api, receiver)
    # The run really stored things, so the check below has something to look at.
    stored_somewhere = False
    if store_url.startswith("sqlite"):
        blobs, stored_somewhere = sqlite_blobs(Path(store_url.removeprefix("sqlite:///")))
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        blobs, stored_somewhere = redis_blobs(server)
    assert stored_somewhere
    # Transcripts were stored (redacted): the check below looks at them too.
    assert any(b"you can reach me on [phone]" in blob for blob in blobs.values())
    blobs["/metrics"] = (await api.call("GET", "/metrics")).body.encode()
    # Webhook payloads (with history) and the archive, which spoken numbers reach too.
    deadline = time.monotonic() + 10
    while not any(b"caller.erased" in body for body in RECEIVED):
        assert time.monotonic() < deadline, "the webhooks did not arrive"
        await asyncio.sleep(0.05)
    assert any(b"you can reach me on [phone]" in body for body in RECEIVED)
    blobs |= {f"webhook delivery {n}": body for n, body in enumerate(RECEIVED)}
    archived = sorted((tmp_path / "archive").glob("project=*/date=*/*.jsonl"))
    assert any(b"you can reach me on [phone]" in path.read_bytes() for path in archived)
    blobs |= {f"archive {path.name}": path.read_bytes() for path in archived}
    for name, blob in blobs.items():
        assert find_numbers(blob) == [], f"phone number found in {name}"
    log_text = "\n".join(
        r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "") for r in captured_logs.records
    ).encode()
    assert b"/v1/projects/{project}/callers/{identifier}/memory" in log_text  # the access log was captured
    assert find_numbers(log_text) == []


def test_the_forms_catch_a_leak() -> None:
    assert find_numbers(b"caller 4155550100 said") == ["4155550100"]
    assert "+44 7700 900123" in find_numbers(b"+44 7700 900123")
    assert find_numbers(b"to ADA.LOVELACE@EXAMPLE.COM") == ["ADA.LOVELACE@EXAMPLE.COM"]
    assert find_numbers(b"GET /callers/email:ada.lovelace%40example.com") == ["ada.lovelace%40example.com"]
    assert find_numbers(b"account acct-zeta-qx") == ["acct-zeta-qx"]
