"""Sweeps, erasure with its tombstone, the audit log and metrics, through a real server."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from caller_memory.service.domain.clock import FakeClock, SystemClock
from caller_memory.service.domain.retention import SWEEP_LEASE
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.http.platform_routes import INGESTION

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import CALLER, CONFIG, assert_problem, memory_path
from tests.support.redis_server import RedisServer


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await api.project_with_tokens("cheese-shop", {**CONFIG, "analytics_enabled": True})


async def test_operators_run_and_list_sweeps(api: Api, shop: dict[str, str]) -> None:
    for i in range(5):
        await api.call(
            "PATCH",
            memory_path("cheese-shop", f"+1415555{i:04d}"),
            token=shop["admin"],
            json={"verified": True},
        )
    await api.call(
        "PATCH",
        memory_path("cheese-shop"),
        token=shop["admin"],
        json={"caller_name": "Ada", "verified": True},
    )
    api.clock.advance(3601)  # `verified` lives an hour
    reply = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert reply.status == 200, reply.body
    report = reply.body
    assert (
        report["removed"]["fields"] == 6 and report["removed"]["callers"] == 5 and report["complete"] is True
    )
    assert re.fullmatch(r"[0-9a-f]{32}", report["sweep_id"]) and report["duration_ms"] >= 0
    assert report.pop("inactivity_ends") == 0  # the run's, not the sweep's: not in the listing
    listed = await api.call("GET", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert listed.body["sweeps"][0] == report
    assert (await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])).body["fields"] == {
        "caller_name": "Ada"
    }
    for role in ("agent", "analytics", "admin"):
        assert_problem(await api.call("POST", "/v1/admin/sweeps", token=shop[role]), 403, mentions="operator")
        assert_problem(await api.call("GET", "/v1/admin/sweeps", token=shop[role]), 403)
    assert_problem(
        await api.call("GET", "/v1/admin/sweeps?limit=0", token=OPERATOR_TOKEN), 422, mentions="limit"
    )


async def test_a_sweep_elsewhere_holds_the_lease(api: Api, shop: dict[str, str]) -> None:
    services = api.app[SERVICES]
    assert await services.store.acquire_lease(SWEEP_LEASE, "another-replica", api.clock.now_ms(), 60_000)
    reply = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert_problem(reply, 409, mentions="another replica")
    await services.store.release_lease(SWEEP_LEASE, "another-replica")
    assert (await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)).status == 200


async def test_two_services_sweeping_at_once_do_not_double_run(store_url: str, clock: FakeClock) -> None:
    # A generous store timeout: this is about two sweeps excluding each other, not speed (four sweeps of two
    # services in this one process outlasted the default 0.5 s once on a cluster in CI).
    async with (
        running_api(store_url, clock, store_timeout=5.0) as first,
        running_api(store_url, clock, store_timeout=5.0) as second,
    ):
        tokens = await first.project_with_tokens("shop", {"state_keys": ["a"], "field_ttls": {"a": "PT1S"}})
        for i in range(20):
            await first.call(
                "PATCH", memory_path("shop", f"+1415555{i:04d}"), token=tokens["admin"], json={"a": i}
            )
        clock.advance(1.1)  # the fields are due; Redis may expire their hashes by its own clock as well
        replies = await asyncio.gather(
            *(
                svc.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
                for svc in (first, second, first, second)
            )
        )
        statuses = sorted(r.status for r in replies)
        assert statuses.count(200) >= 1 and set(statuses) <= {200, 409}
        # Each caller was emptied once (on Redis the hash may already be gone by Redis's own expiry).
        assert sum(r.body["removed"]["callers"] for r in replies if r.status == 200) == 20


async def test_erasure_receipt_audit_and_no_number_anywhere(api: Api, shop: dict[str, str]) -> None:
    await api.call(
        "POST",
        "/v1/projects/cheese-shop/conversations/c1/end",
        token=shop["agent"],
        json={"caller": CALLER, "state": {"caller_name": "Ada"}, "outcome": {"qa": "resolved"}},
    )
    receipt = await api.call("DELETE", f"/v1/projects/cheese-shop/callers/{CALLER}", token=shop["admin"])
    assert receipt.body["removed"] == {
        "fields": 1,
        "first_interaction": True,
        "conversation_links": 1,
        "analytics_conversations": 1,
        "transcripts": 0,
        "webhook_deliveries": 0,
        "archived_conversations": 0,
        "links": 0,
    }
    listed = await api.call(
        "GET", "/v1/projects/cheese-shop/analytics/conversations", token=shop["analytics"]
    )
    assert listed.body["conversations"] == []
    audit = await api.call("GET", "/v1/projects/cheese-shop/audit", token=shop["admin"])
    records = audit.body["records"]
    actions = [r["action"] for r in records]
    assert (
        actions[0] == "caller.erased" and "project.created" in actions and actions.count("token.created") == 3
    )
    erased = records[0]
    assert erased["receipt_id"] == receipt.body["receipt_id"]
    assert erased["actor"].startswith("token:") and erased["at"] == receipt.body["erased_at"]
    assert erased["details"]["removed"] == receipt.body["removed"]
    assert "4155550100" not in str(audit.body) and "Ada" not in str(audit.body)
    assert_problem(await api.call("GET", "/v1/projects/cheese-shop/audit", token=shop["agent"]), 403)
    page = await api.call("GET", "/v1/projects/cheese-shop/audit?limit=2", token=OPERATOR_TOKEN)
    assert len(page.body["records"]) == 2 and page.body["next_cursor"] == page.body["records"][-1]["id"]
    rest = await api.call(
        "GET", f"/v1/projects/cheese-shop/audit?before={page.body['next_cursor']}", token=OPERATOR_TOKEN
    )
    assert [r["id"] for r in page.body["records"] + rest.body["records"]] == [r["id"] for r in records]
    assert_problem(
        await api.call("GET", "/v1/projects/cheese-shop/audit?before=bogus!", token=OPERATOR_TOKEN), 422
    )


async def test_token_revocation_is_audited(api: Api, shop: dict[str, str]) -> None:
    token_id = shop["agent"].split("_")[1]
    await api.call("DELETE", f"/v1/projects/cheese-shop/tokens/{token_id}", token=shop["admin"])
    audit = await api.call("GET", "/v1/projects/cheese-shop/audit", token=shop["admin"])
    assert audit.body["records"][0]["action"] == "token.revoked"
    assert audit.body["records"][0]["details"] == {"token_id": token_id}
    assert shop["agent"].split("_", 2)[2] not in str(audit.body)  # never a secret


async def test_the_erasure_race(store_url: str) -> None:
    """End-of-call writes made before an erasure, racing with it, never bring the caller back."""
    # A generous store timeout: this checks who wins the race, not how fast 60 concurrent writes to one
    # caller are (on the cluster each waits for a replica's fsync; under the suite's load one can outlast
    # the default 0.5 s, a right 503 but not what this tests).
    async with running_api(store_url, SystemClock(), store_timeout=5.0) as api:  # type: ignore[arg-type]
        tokens = await api.project_with_tokens(
            "shop", {"state_keys": ["caller_name", "n"], "analytics_enabled": True}
        )
        before = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()

        landed: list[int] = []
        some_landed = asyncio.Event()

        async def end(i: int) -> bool:
            body = {"caller": CALLER, "state": {"n": i}, "ended_at": before}
            path = f"/v1/projects/shop/conversations/c{i}/end"
            reply = await api.call("POST", path, token=tokens["agent"], json=body)
            assert reply.status == 200, reply.body
            landed.append(i)
            if len(landed) == 5:
                some_landed.set()
            return bool(reply.body["erased"])

        async def erase_amid_more_writes() -> list[object]:
            await some_landed.wait()  # a few writes have landed, others are in flight, and more start now
            reply = api.call("DELETE", f"/v1/projects/shop/callers/{CALLER}", token=tokens["admin"])
            return await asyncio.gather(reply, *(end(i) for i in range(30, 60)))

        first_wave = asyncio.gather(*(end(i) for i in range(30)))
        (erasure, *late), early = await asyncio.gather(erase_amid_more_writes(), first_wave)
        assert erasure.status == 200  # type: ignore[attr-defined]
        unlinked = erasure.body["removed"]["conversation_links"]  # type: ignore[attr-defined]
        dropped = sum(bool(d) for d in [*early, *late])
        print(f"erasure race: {unlinked} writes landed before the erasure, {dropped} were refused after it")
        assert unlinked + dropped == 60  # every write was either erased or refused: none came back
        assert unlinked >= 5 and dropped > 0  # both sides of the race happened
        read = await api.call("GET", memory_path("shop"), token=tokens["agent"])
        assert read.body["fields"] == {}
        listed = await api.call("GET", "/v1/projects/shop/analytics/conversations", token=tokens["analytics"])
        # Conversations recorded before the erasure were unlinked by it; the later ones were never written.
        assert listed.body["conversations"] == []
        # A new call after the erasure is remembered again.
        after = {"caller": CALLER, "state": {"caller_name": "Ada"}}
        await api.call("POST", "/v1/projects/shop/conversations/new/end", token=tokens["agent"], json=after)
        assert (await api.call("GET", memory_path("shop"), token=tokens["agent"])).body["fields"] == {
            "caller_name": "Ada"
        }


async def test_metrics(api: Api, shop: dict[str, str]) -> None:
    await api.call("GET", memory_path("cheese-shop"), token=shop["agent"])
    await api.call("GET", memory_path("cheese-shop", "hello"), token=shop["agent"])
    await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    await api.call("DELETE", f"/v1/projects/cheese-shop/callers/{CALLER}", token=shop["admin"])
    reply = await api.call("GET", "/metrics")
    assert reply.status == 200 and reply.content_type == "text/plain"
    text = reply.body
    route = "/v1/projects/{project}/callers/{identifier}/memory"
    assert f'caller_memory_http_requests_total{{method="GET",route="{route}",status="200"}} 1.0' in text
    assert f'caller_memory_http_requests_total{{method="GET",route="{route}",status="422"}} 1.0' in text
    assert 'caller_memory_sweeps_total{outcome="completed"} 1.0' in text
    assert "caller_memory_erasures_total 1.0" in text
    assert "caller_memory_http_request_duration_seconds_bucket" in text
    assert "4155550100" not in text and "hello" not in text and "cheese-shop" not in text


async def test_metrics_count_the_read_caches_hits_and_misses(
    redis_server: RedisServer, clock: FakeClock
) -> None:
    with redis_server.client() as client:
        client.flushall()
    async with running_api(redis_server.url, clock, store_timeout=5.0, read_cache_seconds=1.0) as api:
        tokens = await api.project_with_tokens("shop", CONFIG)
        patched = await api.call(
            "PATCH", memory_path("shop"), token=tokens["admin"], json={"caller_name": "Ada"}
        )
        assert patched.status == 200, patched.body

        async def counted() -> dict[str, float]:
            text = (await api.call("GET", "/metrics")).body
            found = re.findall(
                r'^caller_memory_read_cache_reads_total\{outcome="(hit|miss)"\} (\S+)$', text, re.M
            )
            return {outcome: float(value) for outcome, value in found}

        for _ in range(5):
            reply = await api.call("GET", memory_path("shop"), token=tokens["agent"])
            assert reply.body["fields"] == {"caller_name": "Ada"}
        first = await counted()
        assert first["miss"] >= 1 and first["hit"] >= 4, first
        for _ in range(3):
            await api.call("GET", memory_path("shop"), token=tokens["agent"])
        assert await counted() == {"hit": first["hit"] + 3, "miss": first["miss"]}
    # Without the cache there is nothing to count.
    async with running_api(redis_server.url, clock, store_timeout=5.0) as api:
        await api.call("GET", memory_path("shop"), token=tokens["agent"])
        text = (await api.call("GET", "/metrics")).body
        assert not re.search(r"^caller_memory_read_cache_reads_total\{", text, re.M)


async def test_the_service_sweeps_on_its_own(store_url: str) -> None:
    async with running_api(store_url, SystemClock(), sweep_interval=0.2) as api:  # type: ignore[arg-type]
        # The scheduler (real time) calls the service's sweeper: told when a run ends, the test waits for that.
        sweeper = api.app[SERVICES].sweeper
        ran = asyncio.Event()
        run = sweeper.run

        async def observed() -> Any:
            try:
                return await run()
            finally:
                ran.set()

        sweeper.run = observed  # type: ignore[method-assign]
        await asyncio.wait_for(ran.wait(), 10)
        listed = await api.call("GET", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
        assert listed.body["sweeps"][0]["complete"] is True
        metrics = await api.call("GET", "/metrics")
        assert 'caller_memory_sweeps_total{outcome="completed"}' in metrics.body


async def test_store_errors_are_counted(redis_server: RedisServer, clock: FakeClock) -> None:
    with redis_server.client() as client:
        client.flushall()
    async with running_api(redis_server.url, clock) as api:
        tokens = await api.project_with_tokens("shop", {"state_keys": ["a"]})
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            reply = await api.call("GET", memory_path("shop"), token=tokens["agent"])
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        assert reply.status == 503
        metrics = await api.call("GET", "/metrics")
        assert 'caller_memory_store_errors_total{kind="store-unavailable"} 1.0' in metrics.body


async def test_a_shortened_retention_applies_to_analytics_at_once_and_sweeps_remove_them(
    api: Api, shop: dict[str, str]
) -> None:
    """Like memory fields, analytics obey the retention in force now, not the one they were recorded under."""
    analytics = "/v1/projects/cheese-shop/analytics"
    config = {**CONFIG, "analytics_enabled": True}  # retention P30D
    body = {"caller": CALLER, "state": {}, "outcome": {"qa": "resolved"}, "channel": "voice"}
    end = "/v1/projects/cheese-shop/conversations/{}/end"
    assert (await api.call("POST", end.format("c1"), token=shop["agent"], json=body)).status == 200
    api.clock.advance(10 * 86_400)

    async def listed() -> list[str]:
        reply = await api.call("GET", f"{analytics}/conversations?from=2000-01-01", token=shop["analytics"])
        return [row["conversation_id"] for row in reply.body["conversations"]]

    async def exported() -> str:
        reply = await api.call(
            "GET",
            f"{analytics}/conversations?from=2000-01-01",
            token=shop["analytics"],
            headers={"Accept": "text/csv"},
        )
        assert reply.status == 200 and reply.content_type == "text/csv"
        text: str = reply.body
        return text

    async def reported() -> int:
        reply = await api.call("GET", f"{analytics}/repeat-callers?interval=day", token=shop["analytics"])
        total: int = reply.body["totals"]["conversations"]
        return total

    assert await listed() == ["c1"] and "c1" in await exported() and await reported() == 1
    assert (await api.put_project("cheese-shop", {**config, "retention": "P7D"})).status == 200
    # c1 is 10 days old: past the new retention, at once, in the listing, the export and the report.
    assert await listed() == [] and "c1" not in await exported() and await reported() == 0
    # The caller's next call is a first interaction, not a repeat of a call older than the retention.
    again = await api.call("POST", end.format("c2"), token=shop["agent"], json=body)
    assert again.body["repeat_caller"] == {}
    # A sweep removes c1 from the store: restoring the longer retention does not bring it back.
    sweep = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert sweep.status == 200 and sweep.body["removed"]["analytics_entries"] == 1
    assert (await api.put_project("cheese-shop", config)).status == 200
    assert await listed() == ["c2"] and "c1" not in await exported()
    third = await api.call("POST", end.format("c3"), token=shop["agent"], json=body)
    assert third.body["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "c2"


async def test_what_the_platform_ingestion_meets_is_counted_in_the_metrics(api: Api) -> None:
    before = (await api.call("GET", "/metrics")).body
    for kind in ("clamped_time", "failed_open", "transcript_refused"):
        assert f'caller_memory_platform_events_total{{kind="{kind}"}} 0.0' in before
    # The app's ingestion reports to its own metrics (each app has its registry).
    api.app[INGESTION].observe("clamped_time")
    after = (await api.call("GET", "/metrics")).body
    assert 'caller_memory_platform_events_total{kind="clamped_time"} 1.0' in after
    assert 'caller_memory_platform_events_total{kind="failed_open"} 0.0' in after
