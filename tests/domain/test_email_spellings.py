"""Issue 27, item 13: two spellings of one mailbox are one identity (one pseudonym), so that a blacklist entry
or an erasure written one way reaches the other; spellings of different mailboxes stay apart."""

from __future__ import annotations

import unicodedata

import pytest
from caller_memory.service.domain.errors import InvalidIdentifier
from caller_memory.service.domain.identifiers import Pseudonymizer, parse_identifier

KEY = b"pseudonym-key-for-tests-0123456789abcdef"

#: Each row: spellings of one mailbox, the first being its canonical form.
SAME = [
    ["email:ada@example.com", "email:ada@example.com.", "EMAIL:Ada@Example.COM.", " email:ada@example.com. "],
    ["email:ada@example.com", "email:ada@example\u3002com", "email:ada@example\uff0ecom\uff61"],
    ["email:ada@b\u00fccher.example", "email:ada@xn--bcher-kva.example", "email:ADA@XN--BCHER-KVA.EXAMPLE."],
    ["email:ada@b\u00fccher.example", "email:ada@B\u00dcCHER.example", "email:ada@bu\u0308cher.example"],
    ["email:ad\u00e9@example.com", "email:" + unicodedata.normalize("NFD", "AD\u00c9@example.com")],
]


@pytest.mark.parametrize("spellings", SAME)
def test_spellings_of_one_mailbox_are_one_identity(spellings: list[str]) -> None:
    pseudonym = Pseudonymizer(KEY).pseudonym
    canonical = spellings[0]
    for written in spellings:
        assert parse_identifier(written) == canonical, written
        assert pseudonym("shop", parse_identifier(written)) == pseudonym("shop", canonical)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("email:ada@example.com", "email:a.da@example.com"),  # no provider's rules: dots stay
        ("email:ada@example.com", "email:ada+news@example.com"),  # and so do tags
        ("email:ada@example.com", "email:ada@example.co"),
        ("email:ada@abc.com", "email:ada@xn--abc-.com"),  # not an A-label: kept as written
        ("email:ada@example.com", "email:\uff41da@example.com"),  # full-width 'a' is another letter
    ],
)
def test_different_mailboxes_stay_apart(one: str, other: str) -> None:
    assert parse_identifier(one) != parse_identifier(other)


@pytest.mark.parametrize(
    "written",
    [
        "email:ada@example.com..",
        "email:ada@.example.com",
        "email:ada@example..com",
        "email:ada@com.",
        "email:ada\u200b@example.com",  # a zero-width space: a look-alike, not an address
        "email:ada@exa\u00admple.com",  # a soft hyphen
        "email:ada\u202e@example.com",  # a right-to-left override
    ],
)
def test_look_alikes_and_empty_labels_are_refused_naming_the_rule(written: str) -> None:
    with pytest.raises(InvalidIdentifier, match="'email:' then one address"):
        parse_identifier(written)
