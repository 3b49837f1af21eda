"""The redaction's search runs window by window (service/domain/redaction.py, issue 27): a long text without
numbers is not searched in one call that holds the event loop. The windows must change nothing: whatever their
size, the same spans are found as by one search of the whole text."""

from __future__ import annotations

import pytest
from caller_memory.service.domain import redaction
from caller_memory.service.domain.redaction import Finder, Mask, plans_of
from caller_memory.service.domain.redaction_batches import CpuBudget, redact_batch_async
from hypothesis import given, settings
from hypothesis import strategies as st

REGIONS = ("GB", "US")
PART_TEXTS = (
    ["415", "555", "0100", "+1", "+44", "07911", "123456", " ", "-", ".", "/", "(", ")", "\u00a0", "\u200b",
     "call me on", "at", "x", "10:30", "12/03/2024", "\n", "ok.", "\uff0b", "\u0664\u0661"]
)  # fmt: skip
PARTS = st.sampled_from(PART_TEXTS)


def spans(text: str) -> list[tuple[int, int]]:
    return Finder(text, plans_of(REGIONS)).run()


@settings(max_examples=300, deadline=None)
@given(st.lists(PARTS, max_size=60).map("".join))
def test_windows_of_any_size_find_what_one_search_finds(text: str) -> None:
    whole = spans(text)
    previous = redaction._WINDOW
    try:
        for size in (1, 3, 8):
            redaction._WINDOW = size
            assert spans(text) == whole, size
    finally:
        redaction._WINDOW = previous


def test_a_long_text_of_words_is_searched_in_windows() -> None:
    text = "gouda brie ok " * 5000 + "call 415 555 0100 now"
    finder = Finder(text, plans_of(REGIONS))
    steps = sum(1 for _ in finder.steps())
    assert steps >= len(text) // redaction._WINDOW  # a step (a chance to give the loop back) per window
    assert [text[a:b] for a, b in finder.found] == ["415 555 0100"]


async def test_a_large_batch_without_digits_is_not_searched() -> None:
    budget = CpuBudget()
    texts = ["gouda brie ok " * 1200] * 4
    assert await redact_batch_async(texts, REGIONS, budget=budget, key="shop") == texts
    assert budget.slices == 0


@pytest.mark.parametrize("text", ["1 2 3 4 5 6 7 8 9 0 " * 800, "    " * 5000, "4155550100" * 2000])
def test_text_without_a_cut_is_one_window(text: str) -> None:
    assert len(list(redaction._windows(text))) == 1


CALLER = "+14155550100"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*PART_TEXTS, "0100", "555 0100", "415 555 0100", "1 0 0"]), max_size=80))
def test_a_known_numbers_search_reads_only_around_its_last_digits_and_finds_the_same(
    parts: list[str],
) -> None:
    """With only the caller's own numbers masked, the search skips to where their last digits occur (a text
    of digits spelled one by one is otherwise read from every digit); it masks what reading everything would."""
    text = " ".join(parts) * 3  # long enough, often, to be read as a long span
    own = Mask(every=False, numbers=frozenset({CALLER}))
    everything = Mask(every=False, holds=lambda e164: e164 == CALLER)  # no tails: every window is read
    previous = redaction.ASK_FIRST
    redaction.ASK_FIRST = 10**9  # the reference asks about every number (no budget: no masking past it)
    try:
        expected = Finder(text, plans_of(REGIONS), everything).run()
    finally:
        redaction.ASK_FIRST = previous
    assert Finder(text, plans_of(REGIONS), own).run() == expected


def test_spelled_digits_cost_what_their_known_tails_need() -> None:
    text = " ".join("7" for _ in range(20_000)) + " 4 1 5 5 5 5 0 1 0 0"
    own = Finder(text, plans_of(REGIONS), Mask(every=False, numbers=frozenset({CALLER})))
    own.run()
    assert [text[a:b] for a, b in own.found] == ["4 1 5 5 5 5 0 1 0 0"]
    assert own.starts < 100  # read only around the one place its last digits occur, not from every digit


def test_a_mask_known_by_pseudonyms_is_asked_a_bounded_number_of_times() -> None:
    """Identifiers known only by pseudonym (links; an append that does not name its caller) cost a parse and
    an HMAC per question: a text is asked about at most 64 numbers plus one per 128 characters, and past that
    every number is masked (more, never less)."""
    asked: list[str] = []

    def holds(e164: str) -> bool:
        asked.append(e164)
        return e164 == CALLER

    text = " ".join(str(n % 10) for n in range(30_000)) + " call me on 415 555 0100"
    finder = Finder(text, plans_of(REGIONS), Mask(every=False, holds=holds))
    finder.run()
    assert len(asked) <= redaction.ASK_FIRST + len(text) // redaction.ASK_EVERY
    assert len(set(asked)) == len(asked)  # each number asked about once
    assert text[finder.found[-1][0] : finder.found[-1][1]] == "415 555 0100"  # the caller's own: masked
