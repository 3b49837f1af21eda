"""An erasure wins over a replay of a conversation whose effects it removed, with or without ``ended_at``.

Through a real server on SQLite, Redis and Redis Cluster, with a fake clock (issue 12).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from tests.conftest import Api
from tests.http.test_api import CALLER, CONFIG, memory_path

PROJECT = "cheese-shop"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens(PROJECT, {**CONFIG, "analytics_enabled": True})


async def end(api: Api, token: str, conv: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await api.call("POST", f"/v1/projects/{PROJECT}/conversations/{conv}/end", token=token, json=body)
    assert reply.status == 200, reply.body
    result: dict[str, Any] = reply.body
    return result


async def listed(api: Api, token: str) -> list[str]:
    reply = await api.call(
        "GET", f"/v1/projects/{PROJECT}/analytics/conversations?from=2000-01-01", token=token
    )
    return [row["conversation_id"] for row in reply.body["conversations"]]


@pytest.mark.parametrize("with_ended_at", [False, True])
async def test_a_replay_after_the_erasure_brings_nothing_back(
    api: Api, shop: dict[str, str], with_ended_at: bool
) -> None:
    body: dict[str, Any] = {"caller": CALLER, "state": {"caller_name": "Ada"}, "outcome": {"qa": "resolved"}}
    if with_ended_at:  # as the SDK sends it: when the call ended, the first attempt's time on every retry
        body["ended_at"] = datetime.fromtimestamp(api.clock.now_ms() / 1000, UTC).isoformat()
    first = await end(api, shop["agent"], "c1", body)
    assert first["erased"] is False and first["persisted"] == ["caller_name"]
    api.clock.advance(60)
    erased = await api.call("DELETE", f"/v1/projects/{PROJECT}/callers/{CALLER}", token=shop["admin"])
    assert erased.status == 200 and erased.body["removed"]["conversation_links"] == 1
    for delay in (1, 3600, 86_400):  # a retry soon after, an hour later, a day later (an SDK outbox)
        api.clock.advance(delay)
        again = await end(api, shop["agent"], "c1", body)
        assert again["erased"] is True and again["persisted"] == [] and again["repeat_caller"] == {}
        read = await api.call("GET", memory_path(PROJECT), token=shop["agent"])
        assert read.body["fields"] == {}
        assert await listed(api, shop["analytics"]) == []
    # Not even a first-interaction record came back: the caller's next call is a first interaction.
    new = await end(api, shop["agent"], "c2", {"caller": CALLER, "state": {"caller_name": "Ada"}})
    assert new["erased"] is False and new["repeat_caller"] == {}
    assert (await api.call("GET", memory_path(PROJECT), token=shop["agent"])).body["fields"] == {
        "caller_name": "Ada"
    }
    assert await listed(api, shop["analytics"]) == ["c2"]


async def test_an_erased_conversation_id_stays_erased_for_another_body_too(
    api: Api, shop: dict[str, str]
) -> None:
    await end(api, shop["agent"], "c1", {"caller": CALLER, "state": {"caller_name": "Ada"}})
    await api.call("DELETE", f"/v1/projects/{PROJECT}/callers/{CALLER}", token=shop["admin"])
    api.clock.advance(10)
    # The erasure kept nothing to recognise the request by (no fingerprint, no caller): any end of the id
    # changes nothing and says so, until the id's recall window is over.
    for body in (
        {"caller": CALLER, "state": {"caller_name": "Bea"}},
        {"caller": "+447700900123", "state": {"caller_name": "Cy"}},
    ):
        assert (await end(api, shop["agent"], "c1", body))["erased"] is True
    assert (await api.call("GET", memory_path(PROJECT), token=shop["agent"])).body["fields"] == {}
    other = await api.call("GET", memory_path(PROJECT, "+447700900123"), token=shop["agent"])
    assert other.body["fields"] == {}
    # After the recall window (7 days) the id is free again, like any id.
    api.clock.advance(7 * 86_400)
    late = await end(api, shop["agent"], "c1", {"caller": "+447700900123", "state": {"caller_name": "Cy"}})
    assert late["erased"] is False and late["persisted"] == ["caller_name"]
