"""Caller identifiers: every written form of a number is one E.164 number, anything else is refused with a
reason that repeats none of it; pseudonyms are keyed per project. No I/O."""

from __future__ import annotations

import re

import pytest
from caller_memory.service.domain.errors import InvalidIdentifier
from caller_memory.service.domain.identifiers import Pseudonymizer, mask, normalize

from tests.conftest import PSEUDONYM_KEY

#: Identifiers refused in a project whose default region is GB (as the HTTP tests' shop), as they reach the
#: domain (the last one was sent percent-encoded: ``+14155550100%20ext.%205``).
BAD_IDENTIFIERS = [
    "hello",
    "12",
    "+999999999",
    "+1415555010000000",
    "anonymous",
    "1" * 80,
    "+14155550100 ext. 5",
]


@pytest.mark.parametrize("identifier", BAD_IDENTIFIERS)
def test_a_bad_identifier_is_refused_without_echo(identifier: str) -> None:
    with pytest.raises(InvalidIdentifier) as refused:
        normalize(identifier, "GB")
    error = refused.value
    assert error.status == 422 and error.field == "identifier" and error.errors[0]["field"] == "identifier"
    assert "identifier" in error.detail
    assert identifier not in error.detail and not re.search(r"\d{3}", error.detail), error.detail


@pytest.mark.parametrize(
    ("written", "region"),
    [
        ("+14155550100", None),
        ("+1 (415) 555-0100", None),
        ("(415) 555-0100", "US"),
        ("415-555-0100", "US"),
        ("+1 415 555 0100", "GB"),
        (
            "".join(chr(0xFF10 + int(d)) for d in "0014155550100"),
            "GB",
        ),  # full-width digits, dialled with the international prefix
    ],
)
def test_written_forms_are_one_number(written: str, region: str | None) -> None:
    assert normalize(written, region) == "+14155550100"


@pytest.mark.parametrize(
    ("written", "region", "reason"),
    [
        ("(415) 555-0100", None, "default_region"),
        ("1-800-FLOWERS", "US", "letters"),
        ("+1 415 555 0100 ext. 5", None, "extensions"),
        ("", None, "empty"),
        ("+44 20", None, "wrong length"),
        ("+1", None, "does not look like a phone number"),
    ],
)
def test_each_refusal_says_why(written: str, region: str | None, reason: str) -> None:
    with pytest.raises(InvalidIdentifier, match=reason):
        normalize(written, region)


def test_national_numbers_read_with_the_region() -> None:
    assert normalize("020 7946 0000", "GB") == "+442079460000"
    assert normalize("07700 900123", "GB") == "+447700900123"


def test_pseudonyms_are_keyed_per_project_and_stable() -> None:
    pseudonymizer = Pseudonymizer(PSEUDONYM_KEY)
    shop = pseudonymizer.pseudonym("shop", "+14155550100")
    assert re.fullmatch(r"[0-9a-f]{32}", shop)
    assert pseudonymizer.pseudonym("shop", "+14155550100") == shop
    assert Pseudonymizer(PSEUDONYM_KEY).pseudonym("shop", "+14155550100") == shop  # the same in every process
    assert pseudonymizer.pseudonym("bakery", "+14155550100") != shop
    assert Pseudonymizer(b"another-key-of-enough-length").pseudonym("shop", "+14155550100") != shop
    with pytest.raises(ValueError, match="16 bytes"):
        Pseudonymizer(b"short")


def test_a_masked_number_shows_its_country_code_and_last_two_digits_only() -> None:
    assert mask("+14155550100") == "+1********00"
    assert mask("+1234") == "+***"
