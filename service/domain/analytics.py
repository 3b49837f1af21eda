"""Repeat-caller analytics: what the end of a conversation records, and what analysts can ask.

Nothing here holds caller data: a conversation is recorded with hour-rounded times, its outcome and, for a
returning caller, the outcome of the caller's *first* interaction inside the retention window (never the
most recent one: chaining calls would link a caller beyond retention). Counters per hour, day and week let
a report read a handful of buckets however many conversations were ever recorded.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence

import orjson

from .clock import BUCKET_MS, HOUR_MS, bucket_start, floor_hour_ms, iso_utc
from .errors import InvalidInput
from .projects import Project
from .reports import (
    BreakdownRow,
    CallbackBucketName,
    Interval,
    RepeatCallerMetrics,
    RepeatCallerReport,
    SeriesPoint,
)
from .store import (
    AnalyticsInput,
    CallerRef,
    ConversationEntry,
    Counters,
    EndAnalytics,
    FirstInteraction,
    ListingPage,
    Outcome,
    Recording,
    Store,
)

INTERVALS = ("hour", "day", "week")
#: Most buckets one report may span (e.g. 41 days by the hour, 2.7 years by the day).
MAX_BUCKETS = 1000
MAX_PAGE = 1000

#: Time to callback: hours from the first interaction's hour to the repeat call's hour.
TTC_BUCKETS: tuple[tuple[CallbackBucketName, int], ...] = (
    ("same_hour", 1),
    ("under_1_day", 24),
    ("1_to_7_days", 7 * 24),
    ("7_to_30_days", 30 * 24),
    ("30_days_or_more", 1 << 62),
)
BREAKDOWNS = ("qa", "handoff_reason", "handoff_to")


def ttc_bucket(hours: int) -> str:
    return next(name for name, below in TTC_BUCKETS if hours < below)


def metrics(first: FirstInteraction | None) -> RepeatCallerMetrics:
    """The REPEAT_CALLER_* metrics of a repeat call (empty for a first interaction)."""
    if first is None:
        return {}
    return {
        "REPEAT_CALLER_CONV_ID": first.conversation_id,
        "REPEAT_CALLER_DATETIME": iso_utc(first.hour),
        "REPEAT_CALLER_QA": first.qa,
        "REPEAT_CALLER_HANDOFF_REASON": first.handoff_reason,
        "REPEAT_CALLER_HANDOFF_TO": first.handoff_to,
    }


def increments(entry: ConversationEntry, new_buckets: Iterable[str]) -> list[Counters]:
    """What one conversation adds to the counters of its hour, day and week."""
    values: dict[str, int] = {"conversations": 1}
    if entry.first is None:
        values["first"] = 1
    else:
        values["repeat"] = 1
        values["ttc:" + ttc_bucket((entry.hour - entry.first.hour) // HOUR_MS)] = 1
        for dimension in BREAKDOWNS:
            values[f"first_{dimension}:" + orjson.dumps(getattr(entry.first, dimension)).decode()] = 1
        # Repeat calls by their own caller-ID attestation (how many returning callers were verified).
        values["repeat_attestation:" + orjson.dumps(entry.attestation).decode()] = 1
    new = set(new_buckets)
    return [
        Counters(kind, bucket_start(kind, entry.hour), values | ({"distinct": 1} if kind in new else {}))
        for kind in INTERVALS
    ]


def encode_cursor(sort_key: str) -> str:
    return base64.urlsafe_b64encode(sort_key.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        key = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except ValueError:  # binascii.Error, UnicodeDecodeError, and non-ASCII input alike
        key = ""
    if len(key) < 15 or key[13] != ":" or not key[:13].isdigit():
        raise InvalidInput("cursor is not one this service returned; start again without it", field="cursor")
    return key


class AnalyticsService:
    def __init__(self, store: Store) -> None:
        self._store = store

    @staticmethod
    def input_for(project: Project, now: int, outcome: Outcome) -> AnalyticsInput:
        hour = floor_hour_ms(now)
        return AnalyticsInput(
            hour=hour,
            day=bucket_start("day", hour),
            week=bucket_start("week", hour),
            outcome=outcome,
            first_expires_at=now + project.retention_ms,
            # The retention in force now, not the one a stored first interaction was created under.
            first_after=now - project.retention_ms,
        )

    @staticmethod
    def recording(
        project: Project,
        caller: CallerRef,
        conversation_id: str,
        *,
        channel: str | None,
        outcome: Outcome,
        found: EndAnalytics,
        made_at: int,
        now: int,
        ended_by: str = "explicit",
        end_reason: str | None = None,
        attestation: str | None = None,
    ) -> Recording:
        """What lists and counts a conversation, from what the end of it found (:attr:`EndResult.analytics`),
        for :meth:`~caller_memory.service.domain.store.Store.record_conversation` (which the end's processing calls with its webhook
        events, :meth:`~caller_memory.service.domain.conversations.ending.ConversationService.process_end`). Recording it is idempotent: a
        replay records nothing again, and completes a recording that an earlier attempt could not finish
        (the service died between the two steps). A caller erased at or after ``made_at`` is not listed
        (the store sees to it, whatever ran first)."""
        entry = ConversationEntry(
            conversation_id=conversation_id,
            hour=found.hour,
            channel=channel,
            qa=outcome.qa,
            handoff_reason=outcome.handoff_reason,
            handoff_to=outcome.handoff_to,
            first=found.first,
            ended_by=ended_by,
            end_reason=end_reason,
            attestation=attestation,
        )
        return Recording(
            caller=caller,
            entry=entry,
            increments=increments(entry, found.new_buckets),
            expires_at=now + project.retention_ms,
            made_at=made_at,
        )

    # Queries ------------------------------------------------------------------------------------------

    async def conversations(
        self,
        project: Project,
        *,
        start: int,
        stop: int,
        repeat: bool | None,
        cursor: str | None,
        limit: int,
        descending: bool,
        now: int,
    ) -> tuple[list[ConversationEntry], str | None]:
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidInput(f"limit must be between 1 and {MAX_PAGE}", field="limit")
        # The project's current retention applies to what was recorded under a longer one: nothing recorded
        # before its cutoff is listed (an entry's hour is at most an hour before it was recorded, so the
        # range starts at the cutoff's hour; the store checks the exact time).
        cutoff = now - project.retention_ms
        page = ListingPage(
            start=f"{max(start, floor_hour_ms(cutoff)):013d}:",
            stop=f"{stop:013d}:",
            repeat=repeat,
            after=decode_cursor(cursor) if cursor else None,
            limit=limit + 1,  # one more, to know whether there is a next page
            descending=descending,
            recorded_after=cutoff,
        )
        entries = await self._store.list_conversations(project.project_id, page, now)
        if len(entries) > limit:
            return entries[:limit], encode_cursor(entries[limit - 1].sort_key)
        return entries, None

    async def repeat_callers(
        self, project: Project, *, start: int, stop: int, interval: Interval, now: int
    ) -> RepeatCallerReport:
        if interval not in INTERVALS:
            raise InvalidInput("interval must be hour, day or week", field="interval")
        first, last = bucket_start(interval, start), bucket_start(interval, stop - 1)
        count = (last - first) // BUCKET_MS[interval] + 1
        if count > MAX_BUCKETS:
            raise InvalidInput(
                f"the range spans {count:,} {interval}s; at most {MAX_BUCKETS:,} (use a wider interval)",
                field="interval",
            )
        buckets = await self._store.counters(
            project.project_id, interval, first, last, now, recorded_after=now - project.retention_ms
        )
        return summarise(buckets, first, last, interval)


def _rate(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _breakdown(counts: dict[str, int], repeat: int) -> list[BreakdownRow]:
    """Rows by value (JSON-encoded in the counter names), most frequent first, null last among equals."""
    rows: list[BreakdownRow] = [
        {"value": orjson.loads(value), "repeat_conversations": amount, "share": _rate(amount, repeat)}
        for value, amount in counts.items()
    ]
    rows.sort(key=lambda row: (-row["repeat_conversations"], row["value"] is None, str(row["value"])))
    return rows


def summarise(buckets: Sequence[Counters], first: int, last: int, interval: Interval) -> RepeatCallerReport:
    """The report: a series with every bucket of the range (empty ones too), totals and breakdowns."""
    by_start = {c.bucket: c.values for c in buckets}
    series: list[SeriesPoint] = []
    totals = {"conversations": 0, "repeat": 0, "first": 0}
    ttc: dict[str, int] = dict.fromkeys((name for name, _ in TTC_BUCKETS), 0)
    breakdowns: dict[str, dict[str, int]] = {d: {} for d in BREAKDOWNS}
    attestations: dict[str, int] = {}
    for start in range(first, last + 1, BUCKET_MS[interval]):
        values = by_start.get(start, {})
        conversations, repeat = values.get("conversations", 0), values.get("repeat", 0)
        series.append(
            {
                "start": iso_utc(start),
                "conversations": conversations,
                "repeat_conversations": repeat,
                "first_conversations": values.get("first", 0),
                "repeat_rate": _rate(repeat, conversations),
                "distinct_callers": values.get("distinct", 0),
            }
        )
        for name in totals:
            totals[name] += values.get(name, 0)
        for name, amount in values.items():
            kind, _, value = name.partition(":")
            if kind == "ttc":
                ttc[value] = ttc.get(value, 0) + amount
            elif kind.startswith("first_") and kind[6:] in breakdowns:
                breakdowns[kind[6:]][value] = breakdowns[kind[6:]].get(value, 0) + amount
            elif kind == "repeat_attestation":
                attestations[value] = attestations.get(value, 0) + amount
    return {
        "interval": interval,
        "from": iso_utc(first),
        "to": iso_utc(last + BUCKET_MS[interval]),
        "totals": {
            "conversations": totals["conversations"],
            "repeat_conversations": totals["repeat"],
            "first_conversations": totals["first"],
            "repeat_rate": _rate(totals["repeat"], totals["conversations"]),
        },
        "series": series,
        "time_to_callback": [
            {"bucket": name, "repeat_conversations": ttc[name], "share": _rate(ttc[name], totals["repeat"])}
            for name, _ in TTC_BUCKETS
        ],
        "breakdowns": {
            "qa": _breakdown(breakdowns["qa"], totals["repeat"]),
            "handoff_reason": _breakdown(breakdowns["handoff_reason"], totals["repeat"]),
            "handoff_to": _breakdown(breakdowns["handoff_to"], totals["repeat"]),
            "attestation": _breakdown(attestations, totals["repeat"]),
        },
    }
