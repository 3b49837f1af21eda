"""Analytics arithmetic without a store: what one conversation adds to its hour, day and week, and the report
summed from counters (every bucket of the range, rates, time to callback, breakdowns); cursors."""

from __future__ import annotations

import pytest
from caller_memory.service.domain.analytics import (
    decode_cursor,
    encode_cursor,
    increments,
    metrics,
    summarise,
    ttc_bucket,
)
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS, bucket_start, iso_utc
from caller_memory.service.domain.errors import InvalidInput
from caller_memory.service.domain.store import ConversationEntry, Counters, FirstInteraction

#: Monday 2027-01-04 00:00 UTC (weeks start on Mondays).
MONDAY = 1_799_020_800_000
assert bucket_start("week", MONDAY) == MONDAY and iso_utc(MONDAY) == "2027-01-04T00:00:00Z"


def entry(hour: int, first: FirstInteraction | None = None, conv: str = "c2") -> ConversationEntry:
    return ConversationEntry(conv, hour, "voice", "resolved", None, None, first)


FIRST = FirstInteraction("c1", MONDAY + 3 * HOUR_MS, "unresolved", "billing", None)


@pytest.mark.parametrize(
    ("hours", "bucket"),
    [
        (0, "same_hour"),
        (1, "under_1_day"),
        (23, "under_1_day"),
        (24, "1_to_7_days"),
        (167, "1_to_7_days"),
        (168, "7_to_30_days"),
        (719, "7_to_30_days"),
        (720, "30_days_or_more"),
        (10**6, "30_days_or_more"),
    ],
)
def test_time_to_callback_buckets_have_exclusive_upper_bounds(hours: int, bucket: str) -> None:
    assert ttc_bucket(hours) == bucket


def test_a_first_interaction_counts_once_per_interval() -> None:
    hour = MONDAY + 2 * DAY_MS + 5 * HOUR_MS
    counters = increments(entry(hour), ["hour", "week"])
    assert [(c.kind, c.bucket) for c in counters] == [
        ("hour", hour),
        ("day", MONDAY + 2 * DAY_MS),
        ("week", MONDAY),
    ]
    assert [dict(c.values) for c in counters] == [
        {"conversations": 1, "first": 1, "distinct": 1},
        {"conversations": 1, "first": 1},  # the caller was already counted that day
        {"conversations": 1, "first": 1, "distinct": 1},
    ]


def test_a_repeat_call_counts_its_time_to_callback_and_the_first_outcome() -> None:
    hour = FIRST.hour + 26 * HOUR_MS
    (by_hour, *_) = increments(entry(hour, FIRST), [])
    assert dict(by_hour.values) == {
        "conversations": 1,
        "repeat": 1,
        "ttc:1_to_7_days": 1,
        # JSON-encoded values, so that null and the string "null" are two values.
        'first_qa:"unresolved"': 1,
        'first_handoff_reason:"billing"': 1,
        "first_handoff_to:null": 1,
        # The repeat call's own attestation (none recorded for this one).
        "repeat_attestation:null": 1,
    }
    assert metrics(FIRST) == {
        "REPEAT_CALLER_CONV_ID": "c1",
        "REPEAT_CALLER_DATETIME": "2027-01-04T03:00:00Z",
        "REPEAT_CALLER_QA": "unresolved",
        "REPEAT_CALLER_HANDOFF_REASON": "billing",
        "REPEAT_CALLER_HANDOFF_TO": None,
    }
    assert metrics(None) == {}


def add(buckets: dict[tuple[str, int], dict[str, int]], counters: list[Counters]) -> None:
    for c in counters:
        into = buckets.setdefault((c.kind, c.bucket), {})
        for name, amount in c.values.items():
            into[name] = into.get(name, 0) + amount


def test_the_report_sums_the_increments_of_its_range() -> None:
    buckets: dict[tuple[str, int], dict[str, int]] = {}
    add(buckets, increments(entry(FIRST.hour, conv="c1"), ["hour", "day", "week"]))
    add(buckets, increments(entry(FIRST.hour, FIRST, "c2"), []))  # same hour
    add(buckets, increments(entry(FIRST.hour + 2 * DAY_MS, FIRST, "c3"), ["day"]))
    second = FirstInteraction("b1", FIRST.hour, None, None, "human")
    add(buckets, increments(entry(FIRST.hour + 2 * DAY_MS, second, "b2"), ["day"]))
    days = [Counters(kind, start, values) for (kind, start), values in buckets.items() if kind == "day"]
    last = MONDAY + 3 * DAY_MS
    report = summarise(days, MONDAY, last, "day")
    assert (report["interval"], report["from"], report["to"]) == (
        "day",
        iso_utc(MONDAY),
        iso_utc(last + DAY_MS),
    )
    assert [(p["start"], p["conversations"], p["repeat_conversations"]) for p in report["series"]] == [
        (iso_utc(MONDAY), 2, 1),
        (iso_utc(MONDAY + DAY_MS), 0, 0),  # empty buckets are listed too
        (iso_utc(MONDAY + 2 * DAY_MS), 2, 2),
        (iso_utc(last), 0, 0),
    ]
    assert [p["repeat_rate"] for p in report["series"]] == [0.5, None, 1.0, None]
    assert [p["distinct_callers"] for p in report["series"]] == [1, 0, 2, 0]  # as the store said: new
    assert report["totals"] == {
        "conversations": 4,
        "repeat_conversations": 3,
        "first_conversations": 1,
        "repeat_rate": 0.75,
    }
    assert [(r["bucket"], r["repeat_conversations"], r["share"]) for r in report["time_to_callback"]] == [
        ("same_hour", 1, round(1 / 3, 4)),
        ("under_1_day", 0, 0.0),
        ("1_to_7_days", 2, round(2 / 3, 4)),
        ("7_to_30_days", 0, 0.0),
        ("30_days_or_more", 0, 0.0),
    ]
    # Most frequent first; among equals, null last.
    assert report["breakdowns"]["qa"] == [
        {"value": "unresolved", "repeat_conversations": 2, "share": round(2 / 3, 4)},
        {"value": None, "repeat_conversations": 1, "share": round(1 / 3, 4)},
    ]
    assert [r["value"] for r in report["breakdowns"]["handoff_to"]] == [None, "human"]


def test_an_empty_report_has_no_rates() -> None:
    report = summarise([], MONDAY, MONDAY, "week")
    assert report["totals"]["repeat_rate"] is None and len(report["series"]) == 1
    assert all(row["share"] is None for row in report["time_to_callback"])
    assert report["breakdowns"] == {"qa": [], "handoff_reason": [], "handoff_to": [], "attestation": []}


def test_cursors_round_trip_and_anything_else_is_refused() -> None:
    key = entry(MONDAY, conv="CA12:leg-2").sort_key
    assert decode_cursor(encode_cursor(key)) == key
    assert "=" not in encode_cursor(key)
    for bad in (
        "not-a-cursor",
        "%7C%C2%AA",
        "|ª",
        "",
        encode_cursor("2027:c1"),
        encode_cursor("x" * 13 + ":c"),
    ):
        with pytest.raises(InvalidInput, match="cursor is not one this service returned") as refused:
            decode_cursor(bad)
        assert refused.value.field == "cursor"
