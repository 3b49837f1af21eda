"""No phone number in the ids a client chooses.

Conversation ids, channels, agent names and message ids outlive the call: they go into webhook payloads, the
archive, analytics and its CSV, the store's keys. They are not masked (an id that changed would not find its
conversation again): one that holds a phone number is refused (422 naming the member, never echoing it) at
the first request that names it, so that the agent's developer sees it at once.

What counts as a number is found by the redaction's own matcher (:class:`.redaction.Finder`), in the same
regions (the project's, and the caller's when the request names them), with two differences made for ids,
which are tokens made by systems rather than words people say:

- Opaque tokens and dates written year first (``2024-06-15``) are set aside first: UUIDs, Twilio-style SIDs (two capitals and 32 hex digits) and any run of
  12 or more hex digits with a letter in it (the random part of the ids earlier releases of the SDK made is
  12 hex digits). Their digit groups are random, and a matcher that weighs only
  possibility finds a "number" in most of them.
- A span the matcher finds is refused when it is written as an international number (a ``+``), or when it is
  a valid number (libphonenumber's ``is_valid_number``) of at least 8 digits, with its leading digits as a
  country code or in one of the regions as people write its numbers (with the national prefix where the
  region has one, as a GB number starts with 0). A run of digits that is merely of a possible length (an order number, epoch
  seconds, a date without separators) is left alone: those are what ids are made of.

Ids that the platform adapters make (``vapi:<uuid>``, ...) follow each vendor's grammar and are checked
against it there instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import phonenumbers

from .errors import InvalidInput
from .redaction import MIN_DIGITS, Finder, enough_digits, plans_of

#: Tokens whose digits are random: UUIDs, two capitals and 32 hex digits (Twilio's SIDs: CA..., PN...), and
#: runs of 12 or more hex digits with at least one letter and one digit.
_OPAQUE = re.compile(
    r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
    r"|[A-Z]{2}[0-9a-fA-F]{32}"
    r"|(?=[0-9A-Fa-f]*[A-Fa-f])(?=[0-9A-Fa-f]*[0-9])[0-9A-Fa-f]{12,}"
)
#: Dates written year first (2024-06-15, 2024.06.15, 2024/06/15, with a time after them or not): ids made of a
#: date and a counter (conv-2024-06-15-123456) would read as a French mobile once the year is passed.
_ISO_DATE = re.compile(r"(?<!\d)\d{4}([-./])\d{2}\1\d{2}(?:[T ]\d{2}(?::\d{2}){1,2})?(?!\d)")
_PLUS = ("+", "\uff0b")
#: Digits a number written without ``+`` must have to count in an id: a counter of six (conv-...-064703) is a
#: valid landline in Rome or Munich, and no id is refused for one.
NATIONAL_DIGITS = 8


def _written_nationally(digits: str, region: str) -> bool:
    """Whether ``digits`` may be a national number of ``region`` as people write one: with the region's
    national prefix where it has one (a GB number starts with 0; without it, a run of ten digits is a valid
    GB number most of the time, epoch seconds included), in any form in North America (where the prefix
    1 is usually left out) and in regions without a prefix."""
    metadata = phonenumbers.PhoneMetadata.metadata_for_region(region, None)
    if metadata is None:
        return False
    prefix = metadata.national_prefix
    return not prefix or metadata.country_code == 1 or digits.startswith(prefix)


def _valid(digits: str, regions: Sequence[str | None]) -> bool:
    candidates: list[tuple[str, str | None]] = [
        (digits, region) for region in regions if region and _written_nationally(digits, region)
    ]
    candidates.append(("+" + digits, None))
    for text, region in candidates:
        try:
            number = phonenumbers.parse(text, region)
        except phonenumbers.NumberParseException:
            continue
        if phonenumbers.is_valid_number(number):
            return True
    return False


@lru_cache(maxsize=8192)
def _holds_number(value: str, regions: tuple[str | None, ...]) -> bool:
    text = _ISO_DATE.sub(" ", _OPAQUE.sub(" ", value))
    if not enough_digits(text):
        return False
    for start, end in Finder(text, plans_of(regions)).run():
        span = text[start:end]
        if span.startswith(_PLUS):
            return True
        digits = "".join(str(int(char)) for char in span if char.isdecimal())
        if len(digits) >= NATIONAL_DIGITS and _valid(digits, regions):
            return True
    return False


#: Eight digits joined by at most four of the separators an id may hold: what every number that counts in an
#: id has (ids are letters, digits, '.', '_', ':' and '-', so neither '+' nor other separators occur).
_EIGHT_DIGITS = re.compile(r"\d(?:[._:\-]{0,4}\d){7}")


def might_hold_number(ids: str) -> bool:
    """Whether any of ``ids`` (joined by newlines) might hold a number that counts: one search for a batch's
    ids, before each is read (:func:`holds_phone_number`) only when it might."""
    return not ids.isascii() or _EIGHT_DIGITS.search(ids) is not None


def _worth_reading(value: str) -> bool:
    """Whether ``value`` has digits enough for what counts in an id (a ``+``, or :data:`NATIONAL_DIGITS`),
    counted in ASCII at C speed: most ids (``call-17``, an SDK's message id) stop here."""
    if value.isascii():
        raw = value.encode()
        digits = len(raw) - len(raw.translate(None, b"0123456789"))
        return digits >= NATIONAL_DIGITS or (digits >= MIN_DIGITS and b"+" in raw)
    return enough_digits(value)


def holds_phone_number(value: str, regions: Sequence[str | None]) -> bool:
    """Whether the id ``value`` holds a phone number, read in ``regions`` (see the module's docstring)."""
    return _worth_reading(value) and _holds_number(value, tuple(regions))


def check_chosen_id(value: str | None, field: str, what: str, regions: Sequence[str | None]) -> None:
    """Refuse (422 naming ``field``) an id a client chose that holds a phone number; ``what`` names it in
    words ("conversation id", "channel", ...). The value is never echoed."""
    if value is not None and holds_phone_number(value, regions):
        raise InvalidInput(
            f"a {what} must not hold a phone number (ids go into webhooks, the archive and analytics, "
            "where no number may be): choose one without it, such as a random id",
            field=field,
        )
