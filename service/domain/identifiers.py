"""Caller identifiers: parsing to a canonical form and pseudonymisation at rest.

Three kinds (SPEC section 13): a phone number (canonical form E.164, ``+14155550100``), an email address
(``email:`` then the address trimmed and case-folded as a whole: ``email:ada@example.com``, with the
spellings that mail and DNS read as one address written one way: see ``_email``) and a
project-defined account id (``account:`` then 1-64 of ``[A-Za-z0-9._-]``, kept as written). The prefixes are
read case-insensitively.

A raw identifier never leaves this module towards the store: the store sees only
``pseudonym(project, canonical)``, an HMAC-SHA256 keyed with the server secret. The project is part of the
message, so one caller's pseudonyms in two projects cannot be linked without the key; the canonical form starts
with ``+``, ``email:`` or ``account:``, so pseudonyms of different kinds never collide (and a phone number's is
the one it always was).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import unicodedata
from functools import lru_cache

import phonenumbers

from .errors import InvalidIdentifier
from .limits import MAX_EMAIL_CHARS, MAX_IDENTIFIER_CHARS

_PARSE_REASONS = {
    phonenumbers.NumberParseException.INVALID_COUNTRY_CODE: (
        "no country code, and the project has no default_region to read it with"
    ),
    phonenumbers.NumberParseException.NOT_A_NUMBER: "it does not look like a phone number",
    phonenumbers.NumberParseException.TOO_SHORT_AFTER_IDD: "too short after the international prefix",
    phonenumbers.NumberParseException.TOO_SHORT_NSN: "too short",
    phonenumbers.NumberParseException.TOO_LONG: "too long",
}

_LETTERS = "it holds letters (vanity numbers are refused: send the digits)"

#: Pseudonyms are 128 bits, hex encoded.
PSEUDONYM_HEX_CHARS = 32
PSEUDONYM_RE = re.compile(r"\A[0-9a-f]{32}\Z")


@lru_cache(maxsize=65536)
def normalize(raw: str, default_region: str | None = None) -> str:
    """Return the E.164 form of ``raw`` or raise :class:`InvalidIdentifier` (the message holds no digits).

    Possible but unassigned numbers (test numbers) are accepted; only the shape is checked. Letters are
    refused: libphonenumber reads a vanity number's letters as keypad digits (``CALL`` as ``2255``), and
    a caller identifier is the number as dialled, never a spelling of it.
    """
    if not raw or len(raw) > MAX_IDENTIFIER_CHARS:
        raise InvalidIdentifier(f"empty or longer than {MAX_IDENTIFIER_CHARS} characters")
    letters = any(ch.isalpha() for ch in raw)
    try:
        number = phonenumbers.parse(raw, default_region)
    except phonenumbers.NumberParseException as exc:
        reason = _LETTERS if letters else _PARSE_REASONS.get(exc.error_type, "it cannot be parsed")
        raise InvalidIdentifier(reason) from None
    if number.extension:
        raise InvalidIdentifier("extensions are not part of a caller identifier")
    if letters:
        raise InvalidIdentifier(_LETTERS)
    if not phonenumbers.is_possible_number(number):
        raise InvalidIdentifier("not a possible number for its country (wrong length)")
    return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)


EMAIL_PREFIX = "email:"
ACCOUNT_PREFIX = "account:"
_ACCOUNT_RE = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")
#: What an address may not hold anywhere: whitespace, controls, and the characters that quote or separate.
_EMAIL_BAD = re.compile(r"[\s\x00-\x1f\x7f<>()\[\],;:\\\"]")
_EMAIL_HELP = (
    "it is 'email:' then one address: a local part, '@' and a domain with a dot, "
    f"at most {MAX_EMAIL_CHARS} characters, without spaces or quotes"
)


@lru_cache(maxsize=65536)  # every request names a caller: the hot path, as normalize() below
def parse_identifier(raw: str, default_region: str | None = None) -> str:
    """The canonical form of any kind of identifier, or :class:`InvalidIdentifier` (never echoing it)."""
    prefix = raw.lstrip()[:8].lower()
    raw = raw.lstrip() if prefix.startswith((EMAIL_PREFIX, ACCOUNT_PREFIX)) else raw
    if prefix.startswith(EMAIL_PREFIX):
        return _email(raw[len(EMAIL_PREFIX) :])
    if prefix == ACCOUNT_PREFIX:
        account = raw[len(ACCOUNT_PREFIX) :]
        if not _ACCOUNT_RE.match(account):
            raise InvalidIdentifier(
                "an account identifier is 'account:' then 1-64 letters, digits, '.', '_' or '-'"
            )
        return ACCOUNT_PREFIX + account
    return normalize(raw, default_region)


def legacy_spelling(raw: str) -> str | None:
    """The canonical form an earlier release gave this ``email:`` identifier (the address trimmed and
    case-folded, nothing more), when it differs from today's (a domain's root dot, an A-label, a decomposed
    accent, an ideographic dot): what was stored under it is the same caller's, and an erasure takes both.
    None for other identifiers and for addresses both releases write alike."""
    if not raw.lstrip()[:8].lower().startswith(EMAIL_PREFIX):
        return None
    canonical = parse_identifier(raw)
    legacy = EMAIL_PREFIX + raw.lstrip()[len(EMAIL_PREFIX) :].strip().casefold()
    return legacy if legacy != canonical else None


#: What a domain name is read with as its dots (IDNA, RFC 3490 section 3.1): the ideographic and full-width
#: full stops are the same separator as '.', so ``example。com`` is ``example.com``.
_DOMAIN_DOTS = str.maketrans({"\u3002": ".", "\uff0e": ".", "\uff61": "."})


def _visible(text: str) -> bool:
    """No character of ``text`` is invisible or a separator (controls, format characters such as the
    zero-width space, unassigned or private-use code points, spaces of any kind): no mail system takes one
    in an address, and each would make a look-alike of an address into a distinct identity."""
    return not any(unicodedata.category(c)[0] in "CZ" for c in text)


def _domain_label(label: str) -> str:
    """A domain label in its Unicode form: an A-label (``xn--``, punycode) decoded to the U-label it
    spells, so that both spellings of an internationalised domain name one identity. A label that does not
    decode to non-ASCII text is not an A-label and is kept as written."""
    if not label.startswith("xn--"):
        return label
    try:
        decoded = label[4:].encode("ascii").decode("punycode")
    except (UnicodeError, ValueError):
        return label
    return _caseless(decoded) if not decoded.isascii() and _visible(decoded) else label


def _caseless(text: str) -> str:
    """Case-folded for caseless matching (Unicode's canonical caseless match): the composed and decomposed
    spellings of one accented letter fold to one text."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", text).casefold())


@lru_cache(maxsize=65536)
def _email(address: str) -> str:
    """``email:`` and the address trimmed and case-folded as a whole (SPEC 14), and written one way where
    the mail and domain name systems read two spellings as one address: the domain's root dot dropped
    (``example.com.`` is ``example.com``), the IDNA dots as '.', A-labels as their Unicode labels, and
    Unicode in its composed form. Nothing provider-specific (dots or ``+tags`` in a local part stay)."""
    folded = _caseless(address.strip())
    local, at, domain = folded.rpartition("@")
    domain = domain.translate(_DOMAIN_DOTS)
    if domain.endswith(".") and not domain.endswith(".."):
        domain = domain[:-1]  # the root label: a fully qualified name of the same domain
    labels = domain.split(".")
    if (
        not at
        or not local
        or "@" in local
        or len(folded) > MAX_EMAIL_CHARS
        or _EMAIL_BAD.search(folded)
        or not _visible(folded)
        or len(labels) < 2
        or not all(labels)
    ):
        raise InvalidIdentifier(_EMAIL_HELP, kind="email")
    return f"{EMAIL_PREFIX}{local}@{'.'.join(_domain_label(label) for label in labels)}"


def kind_of(canonical: str) -> str:
    """``phone``, ``email`` or ``account``, of a canonical identifier."""
    if canonical.startswith(EMAIL_PREFIX):
        return "email"
    if canonical.startswith(ACCOUNT_PREFIX):
        return "account"
    return "phone"


def mask(e164: str) -> str:
    """A form fit for logs: the country code and the last two digits, nothing else."""
    if len(e164) < 6:
        return "+***"
    return e164[:2] + "*" * (len(e164) - 4) + e164[-2:]


class Pseudonymizer:
    """Keyed hashing of identifiers; the only way identifiers are turned into store keys."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the pseudonym key must be at least 16 bytes")
        self._key = key
        self.pseudonym = lru_cache(maxsize=65536)(self._pseudonym)

    def _pseudonym(self, project: str, e164: str) -> str:
        digest = hmac.new(self._key, f"{project}\x00{e164}".encode(), hashlib.sha256).hexdigest()
        return digest[:PSEUDONYM_HEX_CHARS]
