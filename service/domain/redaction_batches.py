"""Redaction of a batch of texts: the texts of one append searched together, so that a
number said across two messages is found (each text masked within itself), and the asynchronous path that
does it in slices, giving the event loop back after each, within a CPU budget per project, so that one
tenant's large appends never stall another's requests. The search itself is :mod:`.redaction`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .redaction import (
    _DIGITS,
    _JOIN,
    SMALL_INPUT,
    STEP,
    Finder,
    Mask,
    Masked,
    _mask,
    enough_digits,
    plans_of,
    redact_text,
)


class _Batch(NamedTuple):
    """The texts of a batch joined, and where each begins in the joined text."""

    joined: str
    starts: list[int]


def _joined(texts: Sequence[str]) -> _Batch:
    starts: list[int] = []
    at = 0
    for text in texts:
        starts.append(at)
        at += len(text) + len(_JOIN)
    return _Batch(_JOIN.join(texts), starts)


def _split(texts: Sequence[str], batch: _Batch, spans: Sequence[tuple[int, int]]) -> list[str]:
    """Each text with the parts of ``spans`` that fall in it masked (a part of a number that runs into the
    next text: from its first digit or ``+``/``(`` to its last digit)."""
    out: list[str] = []
    for _ in _split_steps(texts, batch, spans, out):
        pass
    return out


def _split_steps(
    texts: Sequence[str], batch: _Batch, spans: Sequence[tuple[int, int]], out: list[str]
) -> Iterator[None]:
    """:func:`_split` into ``out``, yielding every :data:`STEP` spans."""
    per_text: list[list[tuple[int, int]]] = [[] for _ in texts]
    position = 0
    for count, (start, end) in enumerate(spans, 1):
        if count % STEP == 0:
            yield
        while position + 1 < len(texts) and batch.starts[position + 1] <= start:
            position += 1
        base = batch.starts[position]
        if end - base <= len(texts[position]):  # within one text: the common case
            per_text[position].append((start - base, end - base))
            continue
        index = position
        while index < len(texts) and batch.starts[index] < end:
            base, text = batch.starts[index], texts[index]
            low, high = max(start - base, 0), min(end - base, len(text))
            runs = [match.span() for match in _DIGITS.finditer(text, low, high)]
            if runs:
                per_text[index].append((low if index == position else runs[0][0], runs[-1][1]))
            index += 1
    for text, spans_of in zip(texts, per_text, strict=True):
        yield
        out.append(_mask(text, spans_of))


def redact_batch(texts: Sequence[str], regions: Sequence[str | None], masked: Masked = None) -> list[str]:
    """:func:`redact_text` of the texts of one batch, searched together (a number may run from the end of
    one text into the next), each masked within itself."""
    if len(texts) == 1:
        return [redact_text(texts[0], regions, masked)]
    batch = _joined(texts)
    if not enough_digits(batch.joined):
        return list(texts)
    return _split(texts, batch, Finder(batch.joined, plans_of(regions), Mask.of(masked)).run())


@dataclass
class CpuBudget:
    """CPU seconds per second that each key (a project) may spend redacting: a token bucket of ``rate``
    seconds per second holding at most ``burst``. A key over its budget waits (sleeping, so that other keys'
    work runs) until it is back within it; it is never cut off. Work runs in slices of about ``slice``
    seconds of CPU, the event loop given back after each."""

    rate: float = 0.1
    burst: float = 0.05
    slice: float = 0.00025
    timer: Callable[[], float] = time.thread_time
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Slices run and seconds waited over the budget (for tests and metrics).
    slices: int = 0
    waited: float = 0.0

    def charge(self, key: str, spent: float) -> float:
        """Take ``spent`` CPU seconds from ``key``'s bucket; how long to wait before its next slice."""
        now = self.clock()
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate) - spent
        if len(self._buckets) >= 10_000 and key not in self._buckets:
            self._buckets = {k: v for k, v in self._buckets.items() if v[0] < self.burst}
        self._buckets[key] = (tokens, now)
        return -tokens / self.rate if tokens < 0 else 0.0

    async def run(self, key: str, steps: Iterator[None]) -> None:
        """Run ``steps`` to their end in slices, yielding to the event loop between slices."""
        timer = self.timer
        began = timer()
        for _ in steps:
            spent = timer() - began
            if spent < self.slice:
                continue
            self.slices += 1
            wait = self.charge(key, spent)
            self.waited += wait
            await asyncio.sleep(wait)
            began = timer()
        self.charge(key, timer() - began)


async def redact_batch_async(
    texts: Sequence[str],
    regions: Sequence[str | None],
    masked: Masked = None,
    *,
    budget: CpuBudget | None = None,
    key: str = "",
) -> list[str]:
    """:func:`redact_batch` that gives the event loop back between slices of its work and keeps ``key``
    (the project) within ``budget``. A batch of at most :data:`SMALL_INPUT` characters is redacted in one
    go (a slice's worth at most)."""
    total = sum(len(text) for text in texts)
    if budget is None or total <= SMALL_INPUT:
        return redact_batch(texts, regions, masked)
    batch = _joined(texts)
    if not enough_digits(batch.joined):  # nothing to search (64 KiB of words: microseconds, not a search)
        return list(texts)
    finder = Finder(batch.joined, plans_of(regions), Mask.of(masked))
    out: list[str] = []
    await budget.run(key, itertools.chain(finder.steps(), _split_steps(texts, batch, finder.found, out)))
    return out
