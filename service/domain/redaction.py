"""Phone numbers found in text and replaced by ``[phone]``, at a cost bounded per byte (SPEC section 10).

How a number is found, and why it costs what it costs:

1. A compiled regular expression (run in C, linear: its separator and digit classes are disjoint) finds the
   *spans* where a number may be: at least :data:`MIN_DIGITS` digits joined by at most four separators each
   (spaces of every kind, ``-``, ``.``, ``/``, parentheses, Unicode dashes, zero-width characters), with an
   optional leading ``+``.
2. In a span, the runs of digits are its *groups*; a number is a *window* of consecutive groups of at most
   :data:`MAX_DIGITS` digits. From each start group, the windows are tried longest first; a window found is
   masked and the search goes on after it.
3. A window's *readings* come from libphonenumber's metadata of each region tried: the digits as a national
   number, without the national prefix (and its transform rule), without the region's country code, after
   the international prefix and a country code, or after ``+`` and a country code. A window is a number when
   one of its readings is a possible number: libphonenumber's own test, which depends only on the country
   code and the national number's length, asked once per country code and length (:func:`possible_lengths`).
   Where ``parse`` settles on one reading, this tries all of them, so it finds every number ``parse`` plus
   ``is_possible_number`` would, without a ``parse`` per candidate: ``parse`` costs some 11 us, the readings
   of a start a few regular-expression matches and set lookups.
4. ``masked`` (when given) says which numbers to mask, by E.164 (the caller's own ones); it sees only readings
   that are possible numbers, at most once each per call.

The work per start group is bounded (at most :data:`MAX_DIGITS` windows, a few readings each), so the cost is
linear in the text. :class:`Finder` yields every :data:`STEP` units of work so that an asynchronous caller
(:func:`redact_batch_async`) can give the event loop back between slices, under a per-key CPU budget
(:class:`CpuBudget`).

Texts of one batch (the messages of one append) are searched together, as if joined by a separator, so that
a number said across two messages is found; each text is masked only within itself.
"""

from __future__ import annotations

import bisect
import itertools
import re
import unicodedata
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import phonenumbers
from phonenumbers import PhoneMetadata, PhoneNumber

#: What replaces a phone number found in text.
PHONE_MASK = "[phone]"
#: Fewest digits of a number found (no text with fewer is looked at), and most digits of one (an
#: international prefix of up to 4 digits, a country code of up to 3, and a national number of up to 15).
MIN_DIGITS = 5
MAX_DIGITS = 22
#: Units of work (a span, or a start group in a span) between two points where a caller may yield.
STEP = 32
#: Inputs up to this many characters are redacted in one go, even on the asynchronous path.
SMALL_INPUT = 4096

#: What may stand between two digits of one number: whitespace (NBSP, thin and other Unicode spaces
#: included), hyphen-minus, dot, slash, parentheses, soft hyphen, Unicode dashes and minus, full-width
#: hyphen, katakana prolonged sound mark, zero-width space/joiners, word joiner, BOM, full-width dot, slash
#: and parentheses, middle dot and bullet, and the unit
#: separator that joins the texts of a batch.
_SEP = (
    r"[\s\-./()\u00ad\u2010-\u2015\u2212\ufe58\ufe63\uff0d\u30fc\u200b-\u200d\u2060\ufeff\x1f"
    r"\uff0e\uff0f\uff08\uff09\u00b7\u2022]"
)
#: A span is matched in pieces of at most this many digits (one regular-expression call holds the event
#: loop for the whole of what it matches); pieces joined by separators are read as one span.
_PIECE = 256
_SPAN = re.compile(
    r"(?:[+\uff0b][\s(]{0,2})?\(?\d(?:" + _SEP + r"{0,4}\d){" + f"{MIN_DIGITS - 1},{_PIECE - 1}" + "}"
)
_GAP = re.compile(_SEP + "{0,4}")
#: A character no span holds (neither a digit, nor a separator, nor what may open a number): where the text
#: may be cut into windows that are searched one at a time (one search of a long text without numbers, such as
#: 64 KiB of words, holds the event loop for milliseconds).
_CUT = re.compile("[^\\d+\uff0b" + _SEP[1:-1] + "]")
#: About how many characters one window holds (it ends at the first cut after this many).
_WINDOW = 4096
#: Spans up to this many characters have their groups read at once; longer ones as they are searched.
_SHORT_SPAN = 512
_DIGITS = re.compile(r"\d+")
#: Dates are not numbers: day/month/year in any order with one separator repeated, or year-month-day.
_DATE = re.compile(r"\d{1,2}([/.-])\d{1,2}\1(?:\d{2}|\d{4})|\d{4}([/.-])\d{1,2}\2\d{1,2}")
#: What joins the texts of a batch (a separator, so that a number may run across it).
_JOIN = "\x1f"

#: How many final digits of a known number a window must share with it (see :class:`Mask`).
TAIL = 4
#: How many numbers a mask's ``holds`` is asked about in a text: this many, and one more for every this many
#: characters (:meth:`Finder._masks`).
ASK_FIRST, ASK_EVERY = 64, 128


@dataclass(frozen=True, slots=True)
class Mask:
    """Which numbers found are masked: every one (``every``), else those whose E.164 is one of ``numbers``
    or that ``holds`` (given an E.164) says are to be masked. With ``numbers`` only, a window is looked at
    only when it ends with the last :data:`TAIL` digits of one of them, so the caller's own numbers cost
    what every number costs."""

    every: bool = True
    numbers: frozenset[str] = frozenset()
    holds: Callable[[str], bool] | None = None
    tails: frozenset[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.every and self.holds is None:
            object.__setattr__(self, "tails", frozenset(number[-TAIL:] for number in self.numbers))

    def __call__(self, e164: str) -> bool:
        return self.every or e164 in self.numbers or (self.holds is not None and self.holds(e164))

    @classmethod
    def of(cls, masked: Callable[[str], bool] | Mask | None) -> Mask:
        """A mask from a predicate on E.164 (None: every number)."""
        if masked is None:
            return EVERY
        if isinstance(masked, Mask):
            return masked
        return cls(every=False, holds=masked)


EVERY = Mask()
Masked = Callable[[str], bool] | Mask | None


@lru_cache(maxsize=512)
def possible_lengths(country_code: int) -> frozenset[int]:
    """The national number lengths libphonenumber calls possible for ``country_code``: its
    ``is_possible_number`` depends on nothing else, so asking once per length is its own judgement."""
    return frozenset(
        length
        for length in range(2, 18)
        if phonenumbers.is_possible_number(
            PhoneNumber(country_code=country_code, national_number=int("1" * length))
        )
    )


class _Plan(NamedTuple):
    """What a region's metadata says about reading digits written there."""

    country_code: int
    prefix: str  # the country code as digits
    international: re.Pattern[str] | None
    national: re.Pattern[str] | None
    transform: str | None


def _plan_of(metadata: PhoneMetadata | None) -> _Plan | None:
    if metadata is None or not metadata.country_code:
        return None
    idd = metadata.international_prefix
    npp = metadata.national_prefix_for_parsing or metadata.national_prefix
    return _Plan(
        metadata.country_code,
        str(metadata.country_code),
        re.compile(idd) if idd else None,
        re.compile(npp) if npp else None,
        metadata.national_prefix_transform_rule or None,
    )


@lru_cache(maxsize=512)
def region_plan(region: str) -> _Plan | None:
    """The plan of a region (``US``, ``GB``...); None for an unknown one."""
    return _plan_of(PhoneMetadata.metadata_for_region(region.upper(), None))


@lru_cache(maxsize=512)
def code_plan(country_code: int) -> _Plan | None:
    """The plan of a country calling code (its main region's, or the non-geographic entity's)."""
    if country_code not in phonenumbers.COUNTRY_CODE_TO_REGION_CODE:
        return None
    main = phonenumbers.region_code_for_country_code(country_code)
    return _plan_of(PhoneMetadata.metadata_for_region_or_calling_code(country_code, main))


def _country_code(digits: str, at: int) -> int:
    """The country calling code that ``digits`` begin with at ``at`` (codes are prefix-free), or 0."""
    if digits[at : at + 1] in ("", "0"):
        return 0
    for size in (1, 2, 3):
        if len(digits) < at + size:
            return 0
        code = int(digits[at : at + size])
        if code in phonenumbers.COUNTRY_CODE_TO_REGION_CODE:
            return code
    return 0


#: A reading: country code, how many leading digits it drops, digits it puts in front (a transform rule's),
#: and the possible national number lengths of that country code.
Reading = tuple[int, int, str, frozenset[int]]


def _national(plan: _Plan, digits: str, at: int, out: list[Reading]) -> None:
    """Readings of ``digits[at:]`` as a national number of ``plan``: as it is, and without its national
    prefix (as libphonenumber strips it: the transform rule when its last group matched)."""
    lengths = possible_lengths(plan.country_code)
    out.append((plan.country_code, at, "", lengths))
    if plan.national is None:
        return
    match = plan.national.match(digits, at)
    if match is None:
        return
    last = match.lastindex
    if plan.transform and last and match.group(last):
        out.append((plan.country_code, match.end(), match.expand(plan.transform), lengths))
    elif match.end() > at:
        out.append((plan.country_code, match.end(), "", lengths))


def _international(digits: str, at: int, out: list[Reading]) -> None:
    code = _country_code(digits, at)
    plan = code_plan(code) if code else None
    if plan is not None:
        _national(plan, digits, at + len(plan.prefix), out)


def readings(digits: str, plus: bool, plans: Sequence[_Plan]) -> list[Reading]:
    """Every way libphonenumber may read ``digits`` (``+digits`` with ``plus``) in the regions of
    ``plans``."""
    out: list[Reading] = []
    if plus:
        _international(digits, 0, out)
        return out
    for plan in plans:
        _national(plan, digits, 0, out)
        if digits.startswith(plan.prefix):
            _national(plan, digits, len(plan.prefix), out)
        if plan.international is not None:
            match = plan.international.match(digits)
            if match is not None and match.end() > 0:
                _international(digits, match.end(), out)
    return out


def _ascii(digits: str) -> str:
    """Decimal digits of any script as ASCII ones (libphonenumber reads them all)."""
    return digits if digits.isascii() else "".join(str(unicodedata.decimal(char)) for char in digits)


def plans_of(regions: Sequence[str | None]) -> tuple[_Plan, ...]:
    """The plans of ``regions`` in order, without repeats and unknown ones."""
    plans: list[_Plan] = []
    for region in dict.fromkeys(regions):
        plan = region_plan(region) if region else None
        if plan is not None and plan not in plans:
            plans.append(plan)
    return tuple(plans)


@dataclass
class Finder:
    """Finds the spans of ``text`` to mask. :meth:`steps` does the work, yielding every :data:`STEP` units
    (run it to its end; :attr:`found` then holds the spans, in order); :meth:`run` does it in one go.
    :attr:`checks` counts the readings tested and :attr:`units` the units of work (for tests of the bound)."""

    text: str
    plans: tuple[_Plan, ...]
    mask: Mask = EVERY
    found: list[tuple[int, int]] = field(default_factory=list)
    checks: int = 0
    units: int = 0
    #: How many groups a window was read from (for tests of what the search skips).
    starts: int = 0
    #: How many numbers the mask's ``holds`` was asked about (each a pseudonym: a parse and an HMAC), and its
    #: answers. Bounded: see :meth:`_masks`.
    asked: int = 0
    _answers: dict[str, bool] = field(default_factory=dict)

    def run(self) -> list[tuple[int, int]]:
        for _ in self.steps():
            pass
        return self.found

    def steps(self) -> Iterator[None]:
        text = self.text
        wide = not text.isascii()
        span: tuple[int, int] | None = None  # the span being read: its pieces joined by separators
        for low, high in _windows(text):
            for piece in _SPAN.finditer(text, low, high):
                if (
                    span is not None
                    and text[piece.start()] not in "+\uff0b"
                    and _GAP.fullmatch(text, span[1], piece.start())
                ):
                    span = (span[0], piece.end())  # the next piece goes on where this one stopped
                    self.units += 1
                    if self.units % STEP == 0:
                        yield
                    continue
                if span is not None:
                    yield from self._span(span[0], span[1], wide)
                span = piece.span()
            self.units += 1
            yield  # a window searched: the runner may give the event loop back
        if span is not None:
            yield from self._span(span[0], span[1], wide)

    def _groups(self, start: int, end: int, wide: bool) -> Iterator[tuple[int, int, str]]:
        """The runs of digits of a long span, read lazily, without a time's hour and minutes."""
        for match in _DIGITS.finditer(self.text, start, end):
            low, high = match.span()
            if not (self._minutes(low, start) or self._hour(low, high, end)):
                yield low, high, _ascii(match.group()) if wide else match.group()

    def _all_groups(self, start: int, end: int, wide: bool) -> list[tuple[int, int, str]]:
        """The runs of digits of a short span, at once, without a time's hour and minutes."""
        groups = [(m.start(), m.end(), m.group()) for m in _DIGITS.finditer(self.text, start, end)]
        if wide:
            groups = [(low, high, _ascii(digits)) for low, high, digits in groups]
        if groups and self._minutes(groups[0][0], start):
            del groups[0]
        if groups and self._hour(groups[-1][0], groups[-1][1], end):
            del groups[-1]
        return groups

    def _read(
        self, start: int, end: int, wide: bool
    ) -> Generator[None, None, tuple[list[tuple[int, int, str]], Iterator[tuple[int, int, str]] | None]]:
        """The span's groups (yielding as it reads), and what is left to read of them (None: all read)."""
        if end - start <= _SHORT_SPAN:  # nearly every span: its groups at once
            return self._all_groups(start, end, wide), None
        groups: list[tuple[int, int, str]] = []
        if self.mask.tails is not None:  # a long one, for known numbers only: read whole (see _skipper)
            for group in self._groups(start, end, wide):
                groups.append(group)
                self.units += 1
                if self.units % STEP == 0:
                    yield
            return groups, None
        source = self._groups(start, end, wide)  # a long one (a whole text of digit groups): read as it goes
        groups.extend(itertools.islice(source, 2 * MAX_DIGITS))
        return groups, source

    def _skipper(self, groups: list[tuple[int, int, str]]) -> Callable[[int], int]:
        """:func:`_skipper` for this mask's tails, stopping short of a date it would jump into (a date's
        groups are passed over together, never read from their middle)."""
        assert self.mask.tails is not None
        skip = _skipper(groups, self.mask.tails)

        def next_index(index: int) -> int:
            found = skip(index)
            for date in (found - 2, found - 1):
                if index <= date < found and self._date(groups, date):
                    return date
            return found

        return next_index

    def _hour(self, low: int, high: int, end: int) -> bool:
        """Whether the run of digits ``low:high`` ending its span at ``end`` is a time's hour ("10:30")."""
        text = self.text
        return (
            high == end
            and high - low <= 2
            and text[end : end + 1] == ":"
            and text[end + 1 : end + 2].isdigit()
        )

    def _minutes(self, low: int, start: int) -> bool:
        """Whether the run of digits at ``low`` beginning its span at ``start`` is a time's minutes."""
        text = self.text
        return low == start and low > 1 and text[low - 1] == ":" and text[low - 2].isdigit()

    def _span(self, start: int, end: int, wide: bool) -> Iterator[None]:
        text = self.text
        plus = text[start] in "+\uff0b"
        groups, source = yield from self._read(start, end, wide)
        if not groups:
            return
        skip = self._skipper(groups) if self.mask.tails is not None else None
        first = groups[0][0]  # a '+' or '(' before the first digits (not a time's minutes) is the number's
        lead = start if _DIGITS.search(text, start, first) is None else first
        index = 0
        while index < len(groups):
            if skip is not None:
                index = skip(index)
                if index >= len(groups):
                    break
            if source is not None and len(groups) - index < MAX_DIGITS:  # enough ahead for the longest window
                if index >= 1024:  # drop what is behind
                    del groups[:index]
                    index = 0
                groups.extend(itertools.islice(source, 2 * MAX_DIGITS))
            self.units += 1
            self.starts += 1
            if self.units % STEP == 0:
                yield
            if self._date(groups, index):
                index += 3
                continue
            leading = groups[index][0] == first
            digits = ""
            ends: list[tuple[int, int]] = []
            for last in range(index, len(groups)):
                digits += groups[last][2]
                if len(digits) > MAX_DIGITS:
                    break
                if len(digits) >= MIN_DIGITS:
                    ends.append((last, len(digits)))
            last = self._longest(digits, plus and leading, ends) if ends else -1
            if last < 0:
                index += 1
                continue
            self.found.append((lead if leading else groups[index][0], groups[last][1]))
            index = last + 1

    def _longest(self, digits: str, plus: bool, ends: list[tuple[int, int]]) -> int:
        """The last group of the longest window (of ``ends``: last group, digits) that is a number to mask,
        or -1."""
        mask = self.mask
        tails = mask.tails
        if tails is not None:  # only known numbers: a window must end as one of them does
            ends = [end for end in ends if digits[end[1] - TAIL : end[1]] in tails]
            if not ends:
                return -1
        options = readings(digits, plus, self.plans)
        for last, size in reversed(ends):
            for code, drop, head, lengths in options:
                self.checks += 1
                if (
                    drop < size
                    and size - drop + len(head) in lengths
                    and (mask.every or self._masks(f"+{code}{head}{digits[drop:size]}"))
                ):
                    return last
        return -1

    def _masks(self, e164: str) -> bool:
        """Whether the mask masks ``e164``. Its ``holds`` (the caller's identifiers known by pseudonym only:
        each answer costs a parse and an HMAC) is asked at most :data:`ASK_FIRST` times plus one for every
        :data:`ASK_EVERY` characters of the text; past that, every number found is masked (more is masked,
        never less: the cost stays bounded per byte whatever the text)."""
        mask = self.mask
        if mask.holds is None or e164 in mask.numbers:
            return mask(e164)
        answer = self._answers.get(e164)
        if answer is None:
            self.asked += 1
            if self.asked > ASK_FIRST + len(self.text) // ASK_EVERY:
                return True
            answer = self._answers[e164] = mask(e164)
        return answer

    def _date(self, groups: list[tuple[int, int, str]], index: int) -> bool:
        """Whether the three groups from ``index`` are a date (12/03/2024, 2024-03-12), not followed by
        their separator and more digits (01.23.45.67.89 is a French number)."""
        if index + 2 >= len(groups) or not 1 <= len(groups[index][2]) <= 4 or len(groups[index + 1][2]) > 2:
            return False
        end = groups[index + 2][1]
        if _DATE.fullmatch(self.text, groups[index][0], end) is None:
            return False
        separator = self.text[groups[index][1]]
        return index + 3 == len(groups) or self.text[end] != separator


def _skipper(groups: Sequence[tuple[int, int, str]], tails: frozenset[str]) -> Callable[[int], int]:
    """For a mask of known numbers only: given a group's index, the first index from it where a window may
    start that ends with one of ``tails`` (the known numbers' last digits), within the lengths a window has;
    ``len(groups)`` when none is left. A span of digits spelled one by one is then read only around where a
    known number's last digits occur, not window by window from each digit."""
    offsets = list(itertools.accumulate((len(group[2]) for group in groups), initial=0))
    digits = "".join(group[2] for group in groups)
    intervals: list[tuple[int, int]] = []
    for tail in tails:
        at = digits.find(tail)
        while at >= 0:
            intervals.append((at + TAIL - MAX_DIGITS, at + TAIL - MIN_DIGITS))
            at = digits.find(tail, at + 1)
    intervals.sort()
    merged: list[list[int]] = []
    for low, high in intervals:
        if merged and low <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    highs = [high for _, high in merged]
    size = len(groups)

    def next_index(index: int) -> int:
        offset = offsets[index]
        k = bisect.bisect_left(highs, offset)
        if k == len(merged):
            return size
        low = merged[k][0]
        return index if offset >= low else min(size, bisect.bisect_left(offsets, low, index))

    return next_index


def _windows(text: str) -> Iterator[tuple[int, int]]:
    """``text`` cut into windows of about :data:`_WINDOW` characters, each ending at a character no span
    holds (so that searching the windows one by one finds exactly what searching the whole finds). A stretch
    with no such character (digits and separators only) stays whole: its spans come one piece at a time."""
    n, low = len(text), 0
    while low < n:
        high = min(n, low + _WINDOW)
        while high < n:
            cut = _CUT.search(text, high, min(n, high + _WINDOW))
            if cut is not None:
                high = cut.start()
                break
            high = min(n, high + _WINDOW)
        yield low, max(high, low + 1)
        low = max(high, low + 1)


def _mask(text: str, spans: Sequence[tuple[int, int]]) -> str:
    if not spans:
        return text
    parts: list[str] = []
    at = 0
    for start, end in spans:
        parts.append(text[at:start])
        parts.append(PHONE_MASK)
        at = end
    parts.append(text[at:])
    return "".join(parts)


def redact_text(text: str, regions: Sequence[str | None], masked: Masked = None) -> str:
    """``text`` with the numbers found (reading them in each of ``regions``) replaced by ``[phone]``:
    every one, or those ``masked`` says (given the E.164 of each possible reading)."""
    if not enough_digits(text):
        return text
    return _mask(text, Finder(text, plans_of(regions), Mask.of(masked)).run())


_ASCII_DIGIT_BYTES = b"0123456789"


def enough_digits(text: str) -> bool:
    """Whether ``text`` has at least :data:`MIN_DIGITS` digits (else no number is in it)."""
    if text.isascii():
        raw = text.encode()
        return len(raw) - len(raw.translate(None, _ASCII_DIGIT_BYTES)) >= MIN_DIGITS
    return sum(char.isdecimal() for char in text) >= MIN_DIGITS
