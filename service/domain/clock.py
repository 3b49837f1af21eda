"""Time source. Production uses the wall clock; tests inject a :class:`FakeClock`."""

from __future__ import annotations

import time
from typing import Protocol

HOUR_MS = 3_600_000


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
