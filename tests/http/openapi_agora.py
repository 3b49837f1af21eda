"""The Agora notifications' operation in tests/http/test_openapi.py's walkthrough: no bearer token (Agora signs
with the connection's secret), so its answers are provoked here rather than by the shared answers' loop."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
from typing import Any, Protocol

import orjson

TEMPLATE = "/v1/projects/{project}/platforms/agora/notifications"
PATH = "/v1/projects/shop/platforms/agora/notifications"
CONNECTION = "/v1/projects/shop/platforms/agora"
SECRET = "agora-openapi-secret"
OWN = {"200", "401", "404", "422"}


class Check(Protocol):
    async def __call__(
        self, method: str, template: str, path: str, status: int, *, token: str | None = ..., **kw: Any
    ) -> Any: ...


def signed(document: Any, secret: str = SECRET) -> dict[str, Any]:
    body = document if isinstance(document, bytes) else orjson.dumps(document)
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"data": body, "headers": {"Content-Type": "application/json", "Agora-Signature-V2": signature}}


def notice(event_type: int, now_ms: int, **payload: Any) -> dict[str, Any]:
    return {
        "noticeId": f"n-{event_type}-{now_ms}",
        "productId": 17,
        "eventType": event_type,
        "notifyMs": now_ms,
        "payload": payload,
    }


async def agora_walkthrough(check: Check, now_ms: int, platform_max_body: int) -> None:
    """No connection (404), then one: unsigned and forged (401), a signed body that is not JSON (400) or not a
    notification (422), too large (413), not JSON's media type (415); a notice Caller Memory does not use
    and an agent-left naming a conversation (200)."""
    await check("POST", TEMPLATE, PATH, 404, token=None, **signed(notice(101, now_ms)))
    await check("POST", TEMPLATE, "/v1/projects/nope/platforms/agora/notifications", 404, token=None, json={})
    await check(
        "PUT", "/v1/projects/{project}/platforms/{platform}", CONNECTION, 201, json={"secret": SECRET}
    )
    await check("POST", TEMPLATE, PATH, 401, token=None, json=notice(101, now_ms))
    await check("POST", TEMPLATE, PATH, 401, token=None, **signed(notice(101, now_ms), "another"))
    await check("POST", TEMPLATE, PATH, 400, token=None, **signed(b"{"))
    await check("POST", TEMPLATE, PATH, 422, token=None, **signed({"eventType": 102}))
    big = b'{"x": "' + b"y" * platform_max_body + b'"}'
    headers = {"Content-Type": "application/json"}
    await check("POST", TEMPLATE, PATH, 413, token=None, data=io.BytesIO(big), headers=headers)
    await check("POST", TEMPLATE, PATH, 415, token=None, data=b"{}", headers={"Content-Type": "text/plain"})
    await check("POST", TEMPLATE, PATH, 200, token=None, **signed(notice(111, now_ms)))
    left = notice(102, now_ms, status="STOPPED", message="OK", labels={"caller_memory_conversation": "c-1"})
    await check("POST", TEMPLATE, PATH, 200, token=None, **signed(left))


async def agora_slow_and_overloaded(check: Check, *, overloaded: bool, stalled: Any) -> None:
    """503 while the service has its limit of requests in flight; 408 for a body that does not arrive."""
    if overloaded:
        await check("POST", TEMPLATE, PATH, 503, token=None, json={})
        return
    never = asyncio.Event()
    await check(
        "POST",
        TEMPLATE,
        PATH,
        408,
        token=None,
        data=stalled(never),
        headers={"Content-Type": "application/json"},
    )
