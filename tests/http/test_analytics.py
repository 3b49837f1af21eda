"""Repeat-caller analytics through a real server, on SQLite and Redis, with a fake clock."""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest
from caller_memory.service.domain.clock import HOUR_MS, bucket_start, iso_utc

from tests.conftest import Api
from tests.http.test_api import assert_problem

ADA, BO, CY = "+14155550100", "+14155550101", "+14155550102"
CONFIG = {
    "analytics_enabled": True,
    "state_keys": ["caller_name"],
    "retention": "P30D",
    "identifier_blacklist": ["+440000000000"],
}
ANALYTICS = "/v1/projects/shop/analytics"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    # Start at a known hour boundary plus 10 minutes, so hour arithmetic in the tests is exact.
    api.clock.advance((HOUR_MS - api.clock.now_ms() % HOUR_MS) / 1000 + 600)
    return await api.project_with_tokens("shop", CONFIG)


async def end(api: Api, token: str, conv: str, caller: str, **outcome: Any) -> dict[str, Any]:
    reply = await api.call(
        "POST",
        f"/v1/projects/shop/conversations/{conv}/end",
        token=token,
        json={"caller": caller, "state": {}, "outcome": outcome, "channel": "voice"},
    )
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_first_and_repeat_calls_refer_to_the_first_interaction(api: Api, shop: dict[str, str]) -> None:
    first_hour = api.clock.now_ms() - api.clock.now_ms() % HOUR_MS
    one = await end(
        api, shop["agent"], "c1", ADA, qa="unresolved", handoff_reason="billing", handoff_to="human"
    )
    assert one["repeat_caller"] == {}
    api.clock.advance(3 * 3600)
    two = await end(api, shop["agent"], "c2", ADA, qa="resolved")
    expected = {
        "REPEAT_CALLER_CONV_ID": "c1",
        "REPEAT_CALLER_DATETIME": iso_utc(first_hour),
        "REPEAT_CALLER_QA": "unresolved",
        "REPEAT_CALLER_HANDOFF_REASON": "billing",
        "REPEAT_CALLER_HANDOFF_TO": "human",
    }
    assert two["repeat_caller"] == expected
    api.clock.advance(24 * 3600)
    three = await end(api, shop["agent"], "c3", "+1 (415) 555-0100", qa="resolved")
    assert three["repeat_caller"] == expected  # the first interaction, not the second
    listed = await api.call("GET", f"{ANALYTICS}/conversations?order=asc", token=shop["analytics"])
    rows = listed.body["conversations"]
    assert [r["conversation_id"] for r in rows] == ["c1", "c2", "c3"]
    assert rows[0]["repeat"] is False and rows[0]["REPEAT_CALLER_CONV_ID"] is None
    assert {k: rows[1][k] for k in expected} == expected
    assert rows[1]["time_to_callback_hours"] == 3 and rows[2]["time_to_callback_hours"] == 27
    assert all(r["ended_at"].endswith(":00:00Z") for r in rows)
    assert "+1415" not in str(listed.body) and "4155550100" not in str(listed.body)


async def test_the_first_interaction_expires_with_retention(api: Api, shop: dict[str, str]) -> None:
    await end(api, shop["agent"], "c1", ADA)
    api.clock.advance(29 * 86400)
    assert (await end(api, shop["agent"], "c2", ADA))["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "c1"
    api.clock.advance(1 * 86400 + 1)  # 30 days after the first call
    assert (await end(api, shop["agent"], "c3", ADA))["repeat_caller"] == {}
    api.clock.advance(3600)
    assert (await end(api, shop["agent"], "c4", ADA))["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "c3"
    # Conversations past retention are not listed any more.
    listed = await api.call("GET", f"{ANALYTICS}/conversations?from=2000-01-01", token=shop["analytics"])
    assert [r["conversation_id"] for r in listed.body["conversations"]] == ["c4", "c3", "c2"]


async def test_blacklisted_callers_and_disabled_projects_record_nothing(
    api: Api, shop: dict[str, str]
) -> None:
    assert (await end(api, shop["agent"], "c1", "+440000000000"))["repeat_caller"] == {}
    await api.put_project("shop", {**CONFIG, "analytics_enabled": False})
    await end(api, shop["agent"], "c2", ADA)
    await end(api, shop["agent"], "c3", ADA)
    listed = await api.call("GET", f"{ANALYTICS}/conversations", token=shop["analytics"])
    assert listed.body == {"conversations": [], "next_cursor": None}
    report = await api.call("GET", f"{ANALYTICS}/repeat-callers", token=shop["analytics"])
    assert report.body["totals"]["conversations"] == 0
    await api.put_project("shop", CONFIG)
    assert (await end(api, shop["agent"], "c4", ADA))["repeat_caller"] == {}  # nothing was remembered


async def test_retries_do_not_double_count(api: Api, shop: dict[str, str]) -> None:
    await end(api, shop["agent"], "c1", ADA)
    api.clock.advance(60)
    first = await end(api, shop["agent"], "c2", ADA, qa="resolved")
    api.clock.advance(7200)  # a retry two hours later gets the same answer and counts nothing
    again = await end(api, shop["agent"], "c2", ADA, qa="resolved")
    assert again == first
    report = await api.call("GET", f"{ANALYTICS}/repeat-callers?interval=hour", token=shop["analytics"])
    assert report.body["totals"] == {
        "conversations": 2,
        "repeat_conversations": 1,
        "first_conversations": 1,
        "repeat_rate": 0.5,
    }


async def test_report_series_distinct_callers_time_to_callback_and_breakdowns(
    api: Api, shop: dict[str, str]
) -> None:
    agent = shop["agent"]
    day0 = api.clock.now_ms()
    await end(api, agent, "a1", ADA, qa="unresolved", handoff_to="human")
    await end(api, agent, "b1", BO, qa="resolved")
    api.clock.advance(600)
    await end(api, agent, "a2", ADA)  # same hour as a1
    api.clock.advance(2 * 86400)
    await end(api, agent, "a3", ADA)  # 2 days later
    await end(api, agent, "b2", BO)
    await end(api, agent, "c1", CY)
    start = iso_utc(day0 - day0 % 86_400_000)
    report = await api.call(
        "GET", f"{ANALYTICS}/repeat-callers?interval=day&from={start}", token=shop["analytics"]
    )
    body = report.body
    assert body["interval"] == "day" and body["from"] == start
    series = {row["start"]: row for row in body["series"]}
    d0, d2 = series[start], series[iso_utc(day0 - day0 % 86_400_000 + 2 * 86_400_000)]
    assert (d0["conversations"], d0["repeat_conversations"], d0["distinct_callers"]) == (3, 1, 2)
    assert (d2["conversations"], d2["repeat_conversations"], d2["distinct_callers"]) == (3, 2, 3)
    assert d2["repeat_rate"] == round(2 / 3, 4)
    assert body["totals"]["conversations"] == 6 and body["totals"]["repeat_conversations"] == 3
    ttc = {row["bucket"]: row["repeat_conversations"] for row in body["time_to_callback"]}
    assert ttc == {
        "same_hour": 1,
        "under_1_day": 0,
        "1_to_7_days": 2,
        "7_to_30_days": 0,
        "30_days_or_more": 0,
    }
    assert [row["share"] for row in body["time_to_callback"]] == [
        round(1 / 3, 4),
        0.0,
        round(2 / 3, 4),
        0.0,
        0.0,
    ]
    assert [row["value"] for row in body["breakdowns"]["handoff_to"]] == [
        "human",
        None,
    ]  # no value sorts last
    qa = {row["value"]: row["repeat_conversations"] for row in body["breakdowns"]["qa"]}
    assert qa == {"unresolved": 2, "resolved": 1}
    handoff = {row["value"]: row["share"] for row in body["breakdowns"]["handoff_to"]}
    assert handoff == {"human": round(2 / 3, 4), None: round(1 / 3, 4)}
    hourly = await api.call(
        "GET", f"{ANALYTICS}/repeat-callers?interval=hour&from={start}", token=shop["analytics"]
    )
    first_hour = next(row for row in hourly.body["series"] if row["conversations"])
    assert (first_hour["conversations"], first_hour["distinct_callers"]) == (3, 2)
    weekly = await api.call(
        "GET", f"{ANALYTICS}/repeat-callers?interval=week&from={start}", token=shop["analytics"]
    )
    same_week = bucket_start("week", day0) == bucket_start("week", day0 + 2 * 86_400_000)
    # One week: Ada, Bo and Cy. Split by a Monday: Ada and Bo, then Ada, Bo and Cy.
    assert [row["distinct_callers"] for row in weekly.body["series"] if row["conversations"]] == (
        [3] if same_week else [2, 3]
    )


async def test_listing_filters_paging_and_csv(api: Api, shop: dict[str, str]) -> None:
    for i in range(7):
        await end(api, shop["agent"], f"c{i}", ADA if i % 2 else BO)
        api.clock.advance(1800)
    page1 = await api.call("GET", f"{ANALYTICS}/conversations?limit=3&order=asc", token=shop["analytics"])
    assert [r["conversation_id"] for r in page1.body["conversations"]] == ["c0", "c1", "c2"]
    cursor = page1.body["next_cursor"]
    assert page1.headers["X-Next-Cursor"] == cursor and 'rel="next"' in page1.headers["Link"]
    await end(api, shop["agent"], "c7", ADA)  # a new conversation arriving between pages
    page2 = await api.call(
        "GET", f"{ANALYTICS}/conversations?limit=3&order=asc&cursor={cursor}", token=shop["analytics"]
    )
    assert [r["conversation_id"] for r in page2.body["conversations"]] == ["c3", "c4", "c5"]
    page3 = await api.call(
        "GET",
        f"{ANALYTICS}/conversations?limit=3&order=asc&cursor={page2.body['next_cursor']}",
        token=shop["analytics"],
    )
    assert [r["conversation_id"] for r in page3.body["conversations"]] == ["c6", "c7"]
    assert page3.body["next_cursor"] is None
    exact = await api.call("GET", f"{ANALYTICS}/conversations?limit=8", token=shop["analytics"])
    assert len(exact.body["conversations"]) == 8 and exact.body["next_cursor"] is None  # nothing follows
    repeats = await api.call("GET", f"{ANALYTICS}/conversations?repeat=true", token=shop["analytics"])
    assert [r["conversation_id"] for r in repeats.body["conversations"]] == [
        "c7",
        "c6",
        "c5",
        "c4",
        "c3",
        "c2",
    ]
    firsts = await api.call("GET", f"{ANALYTICS}/conversations?repeat=false", token=shop["analytics"])
    assert [r["conversation_id"] for r in firsts.body["conversations"]] == ["c1", "c0"]
    as_csv = await api.call(
        "GET", f"{ANALYTICS}/conversations", token=shop["analytics"], headers={"Accept": "text/csv"}
    )
    assert as_csv.content_type == "text/csv"
    table = list(csv.DictReader(io.StringIO(as_csv.body)))
    as_json = (await api.call("GET", f"{ANALYTICS}/conversations", token=shop["analytics"])).body[
        "conversations"
    ]
    assert list(table[0]) == list(as_json[0])  # the same columns
    assert [row["conversation_id"] for row in table] == [row["conversation_id"] for row in as_json]
    assert (
        table[0]["repeat"] == "true"
        and table[0]["REPEAT_CALLER_CONV_ID"] == as_json[0]["REPEAT_CALLER_CONV_ID"]
    )
    # The time range, by hour: c0 and c1 ended in the first hour, c2 and c3 in the second, and so on.
    hour0 = api.clock.now_ms() - api.clock.now_ms() % HOUR_MS - 3 * HOUR_MS
    since, until = iso_utc(hour0 + 2 * HOUR_MS), iso_utc(hour0 + 3 * HOUR_MS)
    recent = await api.call("GET", f"{ANALYTICS}/conversations?from={since}", token=shop["analytics"])
    assert [r["conversation_id"] for r in recent.body["conversations"]] == ["c7", "c6", "c5", "c4"]
    window = await api.call(
        "GET", f"{ANALYTICS}/conversations?from={since}&to={until}", token=shop["analytics"]
    )
    assert [r["conversation_id"] for r in window.body["conversations"]] == ["c5", "c4"]


async def test_csv_cells_cannot_run_as_formulas(api: Api, shop: dict[str, str]) -> None:
    await end(api, shop["agent"], "c1", ADA, qa='=HYPERLINK("http://x")')
    as_csv = await api.call(
        "GET", f"{ANALYTICS}/conversations", token=shop["analytics"], headers={"Accept": "text/csv"}
    )
    assert next(iter(csv.DictReader(io.StringIO(as_csv.body))))["qa"].startswith("'=")


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/conversations?from=yesterday", "from"),
        ("/conversations?to=2026-13-01", "to"),
        ("/conversations?from=2026-02-01&to=2026-01-01", "from"),
        ("/conversations?limit=0", "limit"),
        ("/conversations?limit=many", "limit"),
        ("/conversations?cursor=not-a-cursor", "cursor"),
        ("/conversations?cursor=%7C%C2%AA", "cursor"),
        ("/conversations?order=sideways", "order"),
        ("/conversations?repeat=maybe", "repeat"),
        ("/repeat-callers?interval=minute", "interval"),
        ("/repeat-callers?interval=hour&from=2020-01-01", "interval"),
    ],
)
async def test_bad_queries_are_422_naming_the_parameter(
    api: Api, shop: dict[str, str], path: str, field: str
) -> None:
    reply = await api.call("GET", ANALYTICS + path, token=shop["analytics"])
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == field


async def test_roles_and_tenancy(api: Api, shop: dict[str, str]) -> None:
    for path in ("/conversations", "/repeat-callers"):
        assert (await api.call("GET", ANALYTICS + path, token=shop["analytics"])).status == 200
        assert (await api.call("GET", ANALYTICS + path, token=shop["admin"])).status == 200
        assert_problem(await api.call("GET", ANALYTICS + path, token=shop["agent"]), 403)
        other = await api.project_with_tokens("bakery", {"analytics_enabled": True})
        assert_problem(await api.call("GET", ANALYTICS + path, token=other["analytics"]), 404)


async def test_an_erased_caller_starts_again_as_a_first_interaction(api: Api, shop: dict[str, str]) -> None:
    await end(api, shop["agent"], "c1", ADA, qa="unresolved")
    assert (await end(api, shop["agent"], "c2", ADA))["repeat_caller"]["REPEAT_CALLER_CONV_ID"] == "c1"
    erased = await api.call("DELETE", f"/v1/projects/shop/callers/{ADA}", token=shop["admin"])
    assert erased.status == 200
    assert (await end(api, shop["agent"], "c3", ADA))["repeat_caller"] == {}
