"""Phone-number redaction (issue 27, item 5): the classes of numbers it used to miss, its cost bounded per byte
(counted in units of work and readings tested, not timed: CPU targets live in bench/redaction.py), a large
transcript redacted whole, and the asynchronous path that gives the event loop back under a CPU budget."""

from __future__ import annotations

import asyncio
import random

import pytest
from caller_memory.service.domain.conversations.messages import redact, region_of, regions_to_try
from caller_memory.service.domain.redaction import MAX_DIGITS, PHONE_MASK, Finder, Mask, plans_of
from caller_memory.service.domain.redaction_batches import CpuBudget, redact_batch, redact_batch_async

EVERY = None


def digits_left(text: str) -> int:
    return sum(char.isdecimal() for char in text)


# The classes of numbers that were missed -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("caller", "spoken"),
    [
        ("+15555550123", "call me back on (555) 555-0123 tonight"),  # a test range: possible, not valid
        ("+19995550100", "it's 999 555 0100, my new line"),  # a range the metadata does not know yet
    ],
)
def test_a_callers_possible_but_not_valid_number_is_read_in_their_country_codes_main_region(
    caller: str, spoken: str
) -> None:
    # The project reads numbers as GB ones and masks only the caller's own (redact_phone_numbers off); the
    # caller's number is in no region's valid ranges, so their region is the main one of their country code.
    assert region_of(caller) == "US"
    redacted = redact(spoken, regions_to_try("GB", region_of(caller)), lambda e164: e164 == caller)
    assert PHONE_MASK in redacted and digits_left(redacted) == 0, redacted


@pytest.mark.parametrize(
    "separated",
    [
        "415\u2009555\u20090100",  # thin space
        "415\u202f555\u202f0100",  # narrow no-break space
        "4\u200d1\u200d5\u200d5\u200d5\u200d5\u200d0\u200d1\u200d0\u200d0",  # zero-width joiners
        "415\ufeff555\ufeff0100",  # zero-width no-break space (BOM)
        "415\u00b7555\u00b70100",  # middle dot
    ],
)
def test_numbers_split_by_chat_separators_are_masked(separated: str) -> None:
    assert redact(f"text me at {separated} ok", ["US"], EVERY) == f"text me at {PHONE_MASK} ok"


@pytest.mark.parametrize(
    "separated",
    [
        "415.555.0100",
        "415 555 0100",
        "(415)555-0100",
        "415/555/0100",
        "415\u2013555\u20130100",
        "415\u00a0555\u00a00100",
        "4 1 5 5 5 5 0 1 0 0",
        "\uff14\uff11\uff15\uff0d\uff15\uff15\uff15\uff0d\uff10\uff11\uff10\uff10",  # full-width
    ],
)
def test_the_separators_found_before_still_are(separated: str) -> None:
    assert redact(f"text me at {separated} ok", ["US"], EVERY) == f"text me at {PHONE_MASK} ok"


def test_a_number_said_across_two_messages_of_a_batch_is_masked_in_each() -> None:
    said = ["my number is 415 555", "0100, call me", "thanks, noted"]
    assert redact_batch(said, ["US"]) == [
        f"my number is {PHONE_MASK}",
        f"{PHONE_MASK}, call me",
        "thanks, noted",
    ]
    mine = Mask(every=False, numbers=frozenset({"+14155550100"}))
    assert redact_batch(["it's +1 415", "555-0100"], ["GB"], mine) == [f"it's {PHONE_MASK}", PHONE_MASK]
    assert redact_batch(["it's +1 415", "555-0199"], ["GB"], mine) == ["it's +1 415", "555-0199"]


def test_only_the_callers_own_number_is_masked_among_others() -> None:
    mine = Mask(every=False, numbers=frozenset({"+14155550100"}))
    text = "mine is 12 415 555 0100, my wife's 415 555 0199, the shop 020 7946 0018"
    assert (
        redact(text, ["US", "GB"], mine)
        == f"mine is 12 {PHONE_MASK}, my wife's 415 555 0199, the shop 020 7946 0018"
    )


def test_dates_times_and_short_figures_are_not_numbers() -> None:
    text = "on 12/03/2024 at 10:30, or 2024-03-12 10:45, for 2 people, 1,250 pounds"
    assert redact(text, ["US", "GB"], EVERY) == text
    assert (
        redact("12/03/2024 10:30 call 415 555 0100", ["US"], EVERY) == f"12/03/2024 10:30 call {PHONE_MASK}"
    )
    assert redact("01.23.45.67.89", ["FR"], EVERY) == PHONE_MASK  # a French number is no date


# The bound -------------------------------------------------------------------------------------------------


def adversarial(size: int, seed: int = 7) -> dict[str, str]:
    """Texts of ``size`` characters that cost the most per byte: dense digit groups in every shape."""
    rng = random.Random(seed)

    def numbers(shape: str) -> str:
        out: list[str] = []
        total = 0
        while total < size:
            digits = str(rng.randrange(10**9, 10**10))
            out.append(shape.format(digits[:3], digits[3:6], digits[6:]))
            total += len(out[-1])
        return "".join(out)[:size]

    return {
        "groups": ("415 555 0100 " * (size // 13 + 1))[:size],
        "distinct": numbers("{} {} {} "),
        "mixed": numbers("{}-{}.{}/"),
        "spelled": " ".join(str(rng.randrange(10)) for _ in range(size))[:size],
        "plus": ("+1 415 555 01 " * (size // 14 + 1))[:size],
        "local": numbers("{}{}{} ")[:size],
        "run": ("1234567890" * (size // 10 + 1))[:size],
    }


@pytest.mark.parametrize("mask", [Mask(), Mask(every=False, numbers=frozenset({"+14155550100"}))])
def test_the_work_per_byte_is_bounded(mask: Mask) -> None:
    plans = plans_of(["GB", "DE", "US"])
    for name, text in adversarial(64 * 1024).items():
        finder = Finder(text, plans, mask)
        finder.run()
        small = Finder(text[:1024], plans, mask)
        small.run()
        # Linear: 64 KiB costs about 64 times what 1 KiB costs, and a few readings per character at most.
        assert finder.checks <= 2 * len(text), name
        assert finder.units <= len(text) // 2 + len(text) // 128 + 1, (
            name
        )  # a start per digit, a piece per 256
        work, small_work = finder.checks + finder.units, small.checks + small.units
        assert work <= 64 * small_work * 1.5 + 200, name


def test_a_window_is_never_longer_than_a_number() -> None:
    text = "my card is 4111 1111 1111 1111 1111 1111, my code 12345678901234567890123"
    finder = Finder(text, plans_of(["US"]))
    for start, end in finder.run():
        assert digits_left(text[start:end]) <= MAX_DIGITS


def test_a_transcript_of_a_mebibyte_is_redacted_whole() -> None:
    text = ("call 415 555 0100 or +44 20 7946 0018; " * 30_000)[: 1024 * 1024]
    cut = text.rfind(";") + 1
    redacted = redact(text[:cut], ["US", "GB"], EVERY)
    assert digits_left(redacted) == 0
    assert redacted.count(PHONE_MASK) == 2 * text[:cut].count(";")


# The asynchronous path -------------------------------------------------------------------------------------


async def test_a_large_batch_gives_the_event_loop_back_and_is_redacted_whole() -> None:
    texts = [("my number is 415 555 0100 " * 700)[:16_000] for _ in range(16)]
    budget = CpuBudget()
    turns = 0
    done = asyncio.Event()

    async def other_tenant() -> None:
        nonlocal turns
        while not done.is_set():
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_tenant())
    redacted = await redact_batch_async(texts, ["US"], budget=budget, key="big")
    done.set()
    await other
    assert all(digits_left(text) == 0 for text in redacted)
    assert redacted == redact_batch(texts, ["US"])
    assert budget.slices > 0 and turns >= budget.slices  # the other task ran between slices


async def test_a_small_batch_runs_in_one_go() -> None:
    budget = CpuBudget()
    assert await redact_batch_async(["call 415 555 0100"], ["US"], budget=budget, key="p") == [
        f"call {PHONE_MASK}"
    ]
    assert budget.slices == 0


def test_a_key_over_its_budget_waits_and_others_do_not() -> None:
    now = [100.0]
    budget = CpuBudget(rate=0.5, burst=0.1, clock=lambda: now[0])
    assert budget.charge("busy", 0.05) == 0.0  # within its burst
    assert budget.charge("busy", 0.15) == pytest.approx(0.2)  # 0.1 over at 0.5 s/s: wait 0.2 s
    assert budget.charge("quiet", 0.05) == 0.0  # another project is not held back
    now[0] += 0.2
    assert budget.charge("busy", 0.0) == 0.0  # it refilled while waiting
