"""Time source. Production uses the wall clock; tests inject a :class:`FakeClock`."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from functools import lru_cache
from typing import Protocol

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
WEEK_MS = 7 * DAY_MS
#: 1970-01-01 was a Thursday: weeks start on Mondays (ISO 8601), 4 days later, in UTC.
_WEEK_OFFSET_MS = 4 * DAY_MS
BUCKET_MS = {"hour": HOUR_MS, "day": DAY_MS, "week": WEEK_MS}


class Clock(Protocol):
    def now_ms(self) -> int:
        """Current time as integer milliseconds since the Unix epoch."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class FakeClock:
    """A clock that only moves when told to. Starts at the current wall-clock time by default."""

    def __init__(self, start_ms: int | None = None) -> None:
        self._now = start_ms if start_ms is not None else SystemClock().now_ms()

    def now_ms(self) -> int:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += int(seconds * 1000)


def floor_hour_ms(ms: int) -> int:
    """Round an event time down to the hour (when something happened)."""
    return ms - ms % HOUR_MS


def ceil_hour_ms(ms: int) -> int:
    """Round an expiry time up to the hour: the data is gone by then at the latest."""
    return -(-ms // HOUR_MS) * HOUR_MS


def bucket_start(kind: str, ms: int) -> int:
    """Start of the hour, day or ISO week (Monday 00:00 UTC) that holds ``ms``."""
    if kind == "week":
        return ms - (ms - _WEEK_OFFSET_MS) % WEEK_MS
    return ms - ms % BUCKET_MS[kind]


def bucket_starts(kind: str, first: int, last: int) -> list[int]:
    """Every bucket start of ``kind`` from the bucket holding ``first`` to the one holding ``last``."""
    return list(range(bucket_start(kind, first), bucket_start(kind, last) + 1, BUCKET_MS[kind]))


def iso_utc(ms: int) -> str:
    """``2026-11-30T14:00:00Z``: how the API writes times (whole seconds, UTC)."""
    return _iso_second(ms // 1000)


# Cached by the second, not the millisecond: times about callers are hour-rounded (few distinct values), and
# the times the service stamps now (a webhook's timestamp at every end) repeat within their second.
@lru_cache(maxsize=4096)
def _iso_second(seconds: int) -> str:
    t = datetime.fromtimestamp(seconds, tz=UTC)
    # Formatted by hand: strftime's %Y writes year 1 as "1", which is not RFC 3339 (four digits always).
    return f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}Z"
