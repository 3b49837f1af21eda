"""The dashboard page in a real browser: headless Chromium (Debian's package) against the real service.

The service runs on a real socket over SQLite with a fake clock that starts 20 days ago, and is filled through
the API with a generated data set (about 300 conversations of 80 callers). The expected figures are worked
out here from what was sent, not asked of the API; then the test reads the page: totals, the chart's bars
(from their data-* attributes), the time-to-callback and breakdown tables, the recent repeat conversations,
and the CSV download.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from caller_memory.service.domain.clock import FakeClock

from tests.conftest import Api, running_api
from tests.http.test_api import assert_problem
from tests.support.browser import Chromium, Page

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
PROJECT = "cheese-shop"
BLACKLISTED = "+14155550000"
CONFIG = {
    "analytics_enabled": True,
    "state_keys": ["caller_name"],
    "retention": "P90D",
    "identifier_blacklist": [BLACKLISTED],
}
DAYS = 20
MINUTE_MS, HOUR_MS, DAY_MS = 60_000, 3_600_000, 86_400_000
#: A stored outcome that would run script if the page ever parsed data as markup.
MARKUP = '<img src="x" onerror="window.__injected = true">'
#: Range choice -> (interval, bucket length, buckets), as the page offers them.
RANGES = {"24h": ("hour", HOUR_MS, 24), "30d": ("day", DAY_MS, 30), "12w": ("week", 7 * DAY_MS, 12)}
#: Time to callback in whole hours from the first interaction: bucket name, label on the page, upper bound.
TTC = (
    ("same_hour", "Same hour", 1),
    ("under_1_day", "Under 1 day", 24),
    ("1_to_7_days", "1 to 7 days", 7 * 24),
    ("7_to_30_days", "7 to 30 days", 30 * 24),
    ("30_days_or_more", "30 days or more", 1 << 62),
)
STORAGE_KEY = "caller-memory.dashboard"
NO_RATE = "\N{EN DASH}"  # what the page shows for a rate of nothing


# The data set ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    conversation_id: str
    caller: str
    at: int
    channel: str
    qa: str | None
    handoff_reason: str | None
    handoff_to: str | None

    @property
    def hour(self) -> int:
        return self.at - self.at % HOUR_MS


@dataclass(frozen=True)
class Recorded:
    """What analytics must hold for a call: the call, and the caller's first interaction if it is a repeat."""

    call: Call
    first: Call | None


def _outcome(rng: random.Random) -> tuple[str, str | None, str | None, str | None]:
    channel = rng.choices(("voice", "chat"), weights=(85, 15))[0]
    qa = rng.choices(("resolved", "unresolved", "partially_resolved", None), weights=(50, 28, 14, 8))[0]
    if rng.random() < 0.4:
        reason = rng.choice(("billing", "technical_issue", "complaint", "cancellation"))
        return channel, qa, reason, rng.choice(("human_agent", "billing_team", "voicemail"))
    return channel, qa, None, None


def generate_calls(start: int, end: int, seed: int = 4) -> list[Call]:
    """About 300 calls of 80 callers between ``start`` and ``end``, plus a few of a blacklisted number.

    Most callers come back, after minutes, hours, days or weeks; outcomes vary. Caller 1's first call has an
    outcome that is markup. Times are on the half minute, so no call sits on an hour boundary."""
    rng = random.Random(seed)
    span = end - start
    plans: list[tuple[int, str, tuple[str, str | None, str | None, str | None]]] = []
    for n in range(1, 81):
        caller = f"+1415555{n:04d}"
        calls = 3 if n == 1 else rng.choices(range(1, 11), weights=(7, 8, 10, 12, 12, 12, 10, 8, 6, 4))[0]
        when = start + rng.randrange(span // 4 if n == 1 else span)
        for index in range(calls):
            if index:
                hours = rng.choice(
                    (rng.uniform(0.1, 0.8), rng.uniform(1, 20), rng.uniform(24, 140), 24 * 7.5)
                )
                when += int(hours * HOUR_MS)
            if when >= end:
                break
            outcome = _outcome(rng)
            if n == 1 and index == 0:
                outcome = (outcome[0], MARKUP, "billing", "human_agent")
            plans.append((when - when % MINUTE_MS + 30_000, caller, outcome))
    for _ in range(5):
        when = start + rng.randrange(span)
        plans.append((when - when % MINUTE_MS + 30_000, BLACKLISTED, _outcome(rng)))
    plans.sort()
    return [Call(f"conv-{i:04d}", caller, at, *outcome) for i, (at, caller, outcome) in enumerate(plans, 1)]


def recorded(calls: list[Call]) -> list[Recorded]:
    """Blacklisted callers count for nothing; a caller's first call is the first interaction of every later
    one (retention is 90 days, the data spans 20)."""
    firsts: dict[str, Call] = {}
    out = []
    for call in calls:
        if call.caller != BLACKLISTED:
            first = firsts.setdefault(call.caller, call)
            out.append(Recorded(call, None if first is call else first))
    return out


async def send_all(api: Api, agent_token: str, calls: list[Call]) -> None:
    for call in calls:
        api.clock.advance((call.at - api.clock.now_ms()) / 1000)
        body = {
            "caller": call.caller,
            "state": {},
            "outcome": {"qa": call.qa, "handoff_reason": call.handoff_reason, "handoff_to": call.handoff_to},
            "channel": call.channel,
        }
        path = f"/v1/projects/{PROJECT}/conversations/{call.conversation_id}/end"
        reply = await api.call("POST", path, token=agent_token, json=body)
        assert reply.status == 200, reply.body


# What the page must show -------------------------------------------------------------------------------


def bucket_start(interval: str, ms: int) -> int:
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    if interval == "hour":
        start = moment.replace(minute=0, second=0, microsecond=0)
    else:
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        if interval == "week":
            start -= timedelta(days=start.weekday())
    return int(start.timestamp() * 1000)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def shown_time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M")


def from_iso(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def rate(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def percent(value: float | None) -> str:
    """As the page writes it: JavaScript's ``(value * 100).toFixed(1)`` rounds the exact double half up."""
    if value is None:
        return NO_RATE
    return f"{Decimal(value * 100).quantize(Decimal('0.1'), rounding=ROUND_HALF_UP)}%"


def shown_or_dash(value: str | None, dash: str = "—") -> str:
    return dash if value is None else value


def expected_view(records: list[Recorded], interval: str, start: int, stop: int) -> dict[str, Any]:
    """Everything the page must show for the buckets from ``start`` to ``stop``."""
    step = RANGES[next(key for key, spec in RANGES.items() if spec[0] == interval)][1]
    inside = [r for r in records if start <= r.call.hour < stop]
    repeats = [r for r in inside if r.first is not None]
    bars = []
    for bucket in range(start, stop, step):
        here = [r for r in inside if bucket_start(interval, r.call.hour) == bucket]
        again = sum(r.first is not None for r in here)
        bars.append(
            {
                "start": iso(bucket),
                "conversations": len(here),
                "repeat": again,
                "rate": rate(again, len(here)),
            }
        )
    ttc = dict.fromkeys((name for name, _, _ in TTC), 0)
    breakdowns: dict[str, dict[str | None, int]] = {"qa": {}, "handoff_reason": {}, "handoff_to": {}}
    for r in repeats:
        assert r.first is not None
        hours = (r.call.hour - r.first.hour) // HOUR_MS
        ttc[next(name for name, _, below in TTC if hours < below)] += 1
        for dimension, counts in breakdowns.items():
            value = getattr(r.first, dimension)
            counts[value] = counts.get(value, 0) + 1
    total = len(repeats)
    newest = sorted(repeats, key=lambda r: (r.call.hour, r.call.conversation_id), reverse=True)[:20]
    return {
        "totals": [f"{len(inside):,}", f"{total:,}", percent(rate(total, len(inside)))],
        "bars": bars,
        "ttc": [
            [name, label, str(ttc[name]), percent(ttc[name] / total if total else None)]
            for name, label, _ in TTC
        ],
        "breakdowns": {
            dimension: sorted(
                [shown_or_dash(value, "(none)"), str(n), percent(rate(n, total))]
                for value, n in counts.items()
            )
            for dimension, counts in breakdowns.items()
        },
        "recent": [
            [
                shown_time(r.call.hour),
                r.call.conversation_id,
                r.call.channel,
                shown_or_dash(r.call.qa),
                r.first.conversation_id,
                shown_time(r.first.hour),
                shown_or_dash(r.first.qa),
                shown_or_dash(r.first.handoff_reason),
                shown_or_dash(r.first.handoff_to),
                str((r.call.hour - r.first.hour) // HOUR_MS),
            ]
            for r in newest
            if r.first is not None
        ],
        "conversation_ids": sorted(r.call.conversation_id for r in inside),
    }


# Reading the page --------------------------------------------------------------------------------------

READ_PAGE = """(() => {
  const text = (node) => node.textContent.trim();
  const rows = (id) => [...document.querySelectorAll(`#${id} tbody tr`)].map((tr) => [...tr.cells].map(text));
  const chart = document.querySelector("#chart svg");
  return {
    totals: ["total-conversations", "total-repeat", "total-rate"].map((id) => text(document.getElementById(id))),
    interval: chart.dataset.interval,
    from: chart.dataset.from,
    to: chart.dataset.to,
    label: [...chart.querySelectorAll(":scope > title, :scope > desc")].map(text),
    labelledBy: chart.getAttribute("aria-labelledby"),
    bars: [...chart.querySelectorAll("g.bucket")].map((g) => ({
      start: g.dataset.start,
      conversations: Number(g.dataset.conversations),
      repeat: Number(g.dataset.repeatConversations),
      rate: g.dataset.repeatRate === "" ? null : Number(g.dataset.repeatRate),
      title: text(g.querySelector("title")),
    })),
    ttc: [...document.querySelectorAll("#ttc tbody tr")].map((tr) => [tr.dataset.bucket, ...[...tr.cells].map(text)]),
    breakdowns: Object.fromEntries(
      ["qa", "handoff_reason", "handoff_to"].map((d) => [d, rows(`breakdown-${d}`)]),
    ),
    recent: rows("recent"),
  };
})()"""


def keep(name: str, png: bytes) -> None:
    """Save a screenshot as a test artefact (test-artifacts/ at the root of the repository, git-ignored)."""
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / name).write_bytes(png)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def shown(page: Page, interval: str) -> dict[str, Any]:
    """What the page shows, once it shows the ``interval`` view without error."""
    await page.wait_for(
        f"""(() => {{
          const status = document.querySelector("#status").dataset.kind;
          if (status === "error") throw new Error(document.querySelector("#status").textContent);
          return status === "ok" && document.querySelector("#chart svg")?.dataset.interval === "{interval}";
        }})()""",
        what=f"the {interval} view",
    )
    view: dict[str, Any] = await page.evaluate(READ_PAGE)
    return view


def check_view(view: dict[str, Any], records: list[Recorded], choice: str, before: int, after: int) -> None:
    """The page shows whole buckets up to the current one (the browser's clock) and the right figures."""
    interval, step, buckets = RANGES[choice]
    start, stop = from_iso(view["from"]), from_iso(view["to"])
    assert view["interval"] == interval
    assert stop in {bucket_start(interval, before) + step, bucket_start(interval, after) + step}, view["to"]
    assert stop - start == buckets * step
    expected = expected_view(records, interval, start, stop)
    assert view["totals"] == expected["totals"]
    assert [
        {k: bar[k] for k in ("start", "conversations", "repeat", "rate")} for bar in view["bars"]
    ] == expected["bars"]
    for bar in view["bars"]:  # each bar says its figures to people too (a tooltip)
        assert (
            f"{bar['conversations']} conversations, {bar['repeat']} repeat ({percent(bar['rate'])})"
            in bar["title"]
        )
    assert view["labelledBy"] == "chart-title chart-desc" and all(view["label"])
    assert view["ttc"] == expected["ttc"]
    assert {d: sorted(rows) for d, rows in view["breakdowns"].items()} == expected["breakdowns"]
    for rows in view["breakdowns"].values():  # most frequent first
        counts = [int(row[1]) for row in rows if len(row) == 3]
        assert counts == sorted(counts, reverse=True)
    assert view["recent"] == expected["recent"]


# Tests -------------------------------------------------------------------------------------------------


async def test_dashboard_shows_the_figures_of_a_generated_data_set(tmp_path: Path) -> None:
    end = now_ms() - 10 * MINUTE_MS
    start = end - DAYS * DAY_MS
    calls = generate_calls(start, end)
    records = recorded(calls)
    assert 250 <= len(records) <= 350 and sum(r.first is not None for r in records) > 150  # realistic
    assert len({r.call.caller for r in records}) == 80
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    async with running_api(f"sqlite:///{tmp_path}/memory.db", FakeClock(start)) as api, Chromium() as browser:
        tokens = await api.project_with_tokens(PROJECT, CONFIG)
        await send_all(api, tokens["agent"], calls)
        await browser.allow_downloads(downloads)
        page = await browser.new_page()
        await page.navigate(f"{api.base_url}/dashboard")
        assert await page.evaluate("document.querySelector('#report').hidden")  # nothing before a token

        await page.type("#project", PROJECT)
        await page.type("#token", tokens["analytics"])
        before = now_ms()
        await page.click("#load")
        view = await shown(page, "day")
        check_view(view, records, "30d", before, now_ms())
        # The whole data set is inside the last 30 days.
        assert view["totals"][0] == f"{len(records):,}"
        assert MARKUP in [row[0] for row in view["breakdowns"]["qa"]]
        # ...and shown as text: no element was made of it, nothing ran.
        assert await page.evaluate("document.querySelectorAll('img').length === 0 && !window.__injected")
        keep("dashboard.png", await page.screenshot())

        # The token is kept in this tab's session storage only, never in the address.
        assert tokens["analytics"] not in await page.evaluate("location.href")
        assert (
            json.loads(await page.evaluate(f"sessionStorage.getItem('{STORAGE_KEY}')"))["token"]
            == tokens["analytics"]
        )
        assert (
            await page.evaluate("localStorage.length") == 0 and await page.evaluate("document.cookie") == ""
        )

        # CSV: every conversation of the range, fetched with the token and saved from a Blob URL.
        finished = browser.expect(
            "Browser.downloadProgress", lambda p: p["state"] in ("completed", "canceled")
        )
        await page.click("#download")
        assert (await asyncio.wait_for(finished, 15))["state"] == "completed"
        (saved,) = downloads.iterdir()
        assert saved.name == f"caller-memory-{PROJECT}-{view['from'][:10]}-to-{view['to'][:10]}.csv"
        table = list(csv.DictReader(io.StringIO(saved.read_text(encoding="utf-8"))))
        assert sorted(row["conversation_id"] for row in table) == sorted(
            r.call.conversation_id for r in records
        )
        firsts = {r.call.conversation_id: r.first for r in records}
        for row in table:
            first = firsts[row["conversation_id"]]
            assert row["REPEAT_CALLER_CONV_ID"] == (first.conversation_id if first else "")

        # The other ranges.
        for choice in ("24h", "12w"):
            before = now_ms()
            await page.select("#range", choice)
            check_view(await shown(page, RANGES[choice][0]), records, choice, before, now_ms())

        # A reload of the tab shows the same view again without asking for the token.
        before = now_ms()
        await page.reload()
        view = await shown(page, "week")
        check_view(view, records, "12w", before, now_ms())
        assert view["totals"][0] == f"{len(records):,}"

        # Nothing was asked of anyone but the service, and the page logged no error (CSP reports included).
        origin = api.base_url
        assert page.requests and all(
            url.startswith((f"{origin}/", f"blob:{origin}/")) for url in page.requests
        ), page.requests
        # Not even the icon is missing (browsers ask for one by themselves).
        assert page.problems == []
        assert api.count("GET", "/analytics/repeat-callers", 200) == 4
        assert api.count("GET", "/analytics/repeat-callers") == 4


async def test_clear_errors_for_bad_tokens_unknown_projects_and_an_unreachable_service(
    tmp_path: Path,
) -> None:
    error = """(() => {{
      const status = document.querySelector("#status");
      return status.dataset.kind === "error" && status.textContent.includes({mark!r}) && status.textContent;
    }})()"""
    async with Chromium() as browser:
        async with running_api(f"sqlite:///{tmp_path}/memory.db", FakeClock()) as api:
            tokens = await api.project_with_tokens(PROJECT, CONFIG)
            page = await browser.new_page()
            await page.navigate(f"{api.base_url}/dashboard")
            cases = [
                (PROJECT, "cm_000000000000_not-a-real-token", "401", "The token was not accepted"),
                (PROJECT, tokens["agent"], "403", "Use a token with the analytics or admin role"),
                ("bakery", tokens["analytics"], "404", 'Project "bakery" was not found'),
            ]
            for project, token, status, message in cases:
                await page.type("#project", project)
                await page.type("#token", token)
                await page.click("#load")
                shown_message = await page.wait_for(error.format(mark=status), what=f"the {status} message")
                assert message in shown_message
                assert await page.evaluate("document.querySelector('#report').hidden")
            keep("dashboard-error.png", await page.screenshot())

            # The form itself refuses what cannot be right, without asking the service.
            asked = len(api.requests)
            await page.type("#project", "Not A Project!")
            await page.click("#load")
            assert "Enter a project id" in await page.wait_for(error.format(mark="project id"))
            await page.type("#project", PROJECT)
            await page.type("#token", "")
            await page.click("#load")
            assert "Enter a token" in await page.wait_for(error.format(mark="token"))
            assert len(api.requests) == asked

            # With a good token the report shows; "Forget token" removes it from the tab and hides the data.
            await page.type("#token", tokens["admin"])
            await page.click("#load")
            assert (await shown(page, "day"))["totals"] == ["0", "0", NO_RATE]
            await page.click("#forget")
            stored = json.loads(await page.evaluate(f"sessionStorage.getItem('{STORAGE_KEY}')"))
            assert stored == {"project": PROJECT, "range": "30d"}
            assert await page.evaluate("document.querySelector('#token').value") == ""
            assert await page.evaluate("document.querySelector('#report').hidden")
            assert "forgotten" in await page.evaluate("document.querySelector('#status').textContent")
        # The service has stopped: the page says so.
        await page.type("#token", tokens["analytics"])
        await page.click("#load")
        assert "Could not reach the Caller Memory service" in await page.wait_for(error.format(mark="reach"))


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


async def test_the_page_and_its_files_are_served_with_strict_headers(tmp_path: Path) -> None:
    async with running_api(f"sqlite:///{tmp_path}/memory.db", FakeClock()) as api:
        files = {}
        for path, media in (
            ("/dashboard", "text/html"),
            ("/dashboard/dashboard.js", "text/javascript"),
            ("/dashboard/dashboard.css", "text/css"),
            ("/dashboard/favicon.svg", "image/svg+xml"),
            ("/favicon.ico", "image/svg+xml"),
        ):
            reply = await api.call("GET", path)  # no token: the page holds no data
            assert reply.status == 200 and reply.content_type == media, (path, reply.status)
            assert reply.headers["Content-Type"].endswith("charset=utf-8")
            assert reply.headers["X-Content-Type-Options"] == "nosniff"
            assert reply.headers["Cache-Control"] == "no-cache"
            policy = dict(
                d.strip().split(" ", 1) for d in reply.headers["Content-Security-Policy"].split(";")
            )
            assert policy["default-src"] == policy["script-src"] == policy["connect-src"] == "'self'"
            assert (
                policy["form-action"] == "'none'" and "unsafe" not in reply.headers["Content-Security-Policy"]
            )
            again = await api.call("GET", path, headers={"If-None-Match": reply.headers["ETag"]})
            assert again.status == 304 and again.body == ""
            files[path] = reply.body
        for unknown in (
            "/dashboard/index.py",
            "/dashboard/app.py",
            "/dashboard/..%2Fdashboard.py",
            "/dashboard/x.js",
        ):
            assert_problem(await api.call("GET", unknown), 404)

    # The page loads only its own files, by relative address (so it also works behind a path prefix), and
    # has no inline script, style or event handler; the script never writes markup.
    parser = _Tags()
    parser.feed(files["/dashboard"])
    addresses = [
        value or ""
        for _, attrs in parser.tags
        for name, value in attrs.items()
        if name in ("src", "href", "action", "srcset", "poster", "data")
    ]
    assert sorted(addresses) == ["dashboard/dashboard.css", "dashboard/dashboard.js", "dashboard/favicon.svg"]
    assert all(tag != "script" or attrs.get("src") for tag, attrs in parser.tags)
    assert not [
        (tag, name)
        for tag, attrs in parser.tags
        for name in attrs
        if name == "style" or name.startswith("on")
    ]
    assert all(tag != "style" for tag, _ in parser.tags)
    assert [attrs.get("name") for tag, attrs in parser.tags if tag == "input"] == [
        None,
        None,
    ]  # nothing to submit
    script = files["/dashboard/dashboard.js"]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink
