"""Cost of one failed authentication in the failure throttle, by failures already in its window.

    .venv/bin/python bench/throttle.py [--rounds 7]

For each fill (1k, 10k, 100k failures in the window, all from one source: the attacker's case, and spread
over 10,000 sources: the table full), it times 2,000 further failures and reports the median cost per
failure over the rounds, next to the throttle this one replaced (a list of times per source, filtered on
every failure), run side by side in the same process. What matters is the ratio across fills (flat: O(1)),
not the absolute numbers, which depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from caller_memory.service.domain.tokens import FailureThrottle

FILLS = (1_000, 10_000, 100_000)
PROBES = 2_000


class ListThrottle:
    """The previous implementation (before issue 12), kept here as the baseline: O(failures in window)."""

    def __init__(self, limit: int = 20, window: float = 60.0, max_sources: int = 10_000) -> None:
        self.limit, self.window, self.max_sources = limit, window, max_sources
        self._failures: dict[str, list[float]] = {}

    def failure(self, source: str) -> int | None:
        now = time.monotonic()
        times = [t for t in self._failures.get(source, []) if now - t < self.window]
        times.append(now)
        self._failures.pop(source, None)
        self._failures[source] = times
        while len(self._failures) > self.max_sources:
            del self._failures[next(iter(self._failures))]
        if len(times) > self.limit:
            return max(1, int(self.window - (now - times[-self.limit - 1])) + 1)
        return None

    def preload(self, names: list[str], fill: int) -> None:
        """What ``fill`` calls of failure() over ``names`` leave (calling it would take O(fill**2))."""
        now = time.monotonic()
        for i, name in enumerate(names):
            self._failures[name] = [now] * (fill // len(names) + (i < fill % len(names)))


def per_failure_ns(make: Callable[[], object], fill: int, sources: int, probes: int) -> float:
    throttle = make()
    failure = throttle.failure  # type: ignore[attr-defined]
    names = [f"10.0.{i // 256}.{i % 256}" for i in range(sources)]
    if isinstance(throttle, ListThrottle):
        throttle.preload(names, fill)
    else:
        for i in range(fill):
            failure(names[i % sources])
    started = time.perf_counter_ns()
    for i in range(probes):
        failure(names[i % sources])
    return (time.perf_counter_ns() - started) / probes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", action="store_true", help="also time the previous implementation")
    args = parser.parse_args()
    kinds: list[tuple[str, Callable[[], object]]] = [("ring (now)", FailureThrottle)]
    if args.baseline:
        kinds.append(("list (before)", ListThrottle))
    for sources in (1, 10_000):
        print(f"\nfailures from {sources} source(s); median ns per failure over {args.rounds} rounds")
        print(
            f"{'implementation':<16}"
            + "".join(f"{f'{fill:,} in window':>20}" for fill in FILLS)
            + "   100k/1k"
        )
        for name, make in kinds:
            medians = []
            for fill in FILLS:
                # The baseline at 100k from one source costs seconds per probe batch: fewer probes.
                probes = PROBES if make is FailureThrottle or sources > 1 else max(20, PROBES * 1_000 // fill)
                runs = [per_failure_ns(make, fill, sources, probes) for _ in range(args.rounds)]
                medians.append(statistics.median(runs))
            cells = "".join(f"{m:>20,.0f}" for m in medians)
            print(f"{name:<16}{cells}   {medians[-1] / medians[0]:>7.2f}x")


if __name__ == "__main__":
    main()
