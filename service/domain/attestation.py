"""Caller-ID attestation (SPEC section 13): what carriers and telephony providers say about a call's caller
ID, normalised to one of :data:`ATTESTATIONS`.

STIR/SHAKEN gives a signed call one of three attestation levels (A: the originating carrier knows the caller
and that they may use the number; B: it knows the caller, not their right to the number; C: it only carried
the call, e.g. from an international gateway). The terminating carrier verifies the signature and passes the
result on, each provider in its own words. What this module reads, and where each value is documented:

- **Twilio** Programmable Voice: the ``StirVerstat`` parameter of the incoming-call webhook; Elastic SIP
  Trunking: the ``X-Twilio-VerStat`` header, same values. ``TN-Validation-Passed-A|B|C`` (verified, at that
  level), ``TN-Validation-Failed-A|B|C`` (a PASSporT at that level that could not be verified),
  ``TN-Validation-Failed`` (not verified, no level), ``No-TN-Validation`` (a PASSporT that was not validated:
  malformed, stale, or not matching the call), and the same six with ``-Diverted`` for a forwarded call
  whose diversion PASSporT was checked. Twilio sends nothing for a call without a PASSporT.
  https://www.twilio.com/docs/voice/trusted-calling-with-shakenstir ,
  https://www.twilio.com/changelog/twilio-performs-shakenstir-verification-on-incoming-calls-to-your-phone-numbers-sipt
- **Telnyx**: the ``verstat`` parameter of ``P-Asserted-Identity``. ``TN-Validation-Passed`` is the A level
  (no ``-A`` suffix), ``TN-Validation-Passed-B``, ``TN-Validation-Passed-C``, ``TN-Validation-Failed``, and
  ``No-TN-Validation`` (no Identity header). TeXML webhooks carry ``ShakenStirAttestation`` (a letter) and
  ``ShakenStirValidated`` (a boolean): send the letter when it is true, ``failed`` when it is false.
  https://developers.telnyx.com/docs/voice/stir-shaken/sip-header-parameters ,
  https://telnyx.com/release-notes/new-shaken-stir-verstat-parameters ,
  https://developers.telnyx.com/api-reference/callbacks/texml-call-initiated
- **Plivo**: the "STIR Verification" of a Voice API call. ``Verified`` is the A level; ``Not Verified``
  covers B, C and unsigned calls alike, so it counts as C (the lowest level: it never grants what a B call
  would not have); ``Not Applicable`` (no STIR/SHAKEN, e.g. outside the US) is unknown.
  https://www.plivo.com/docs/voice/concepts/stir-shaken ,
  https://www.plivo.com/docs/sip-trunking/concepts/stir-shaken
- **Bandwidth**: ``stirShaken.verstat`` is ``TN-Validation-Passed`` or ``TN-Validation-Failed`` with the level
  apart, in ``attestationIndicator`` (A, B or C): send the indicator when verstat passed, else ``failed``.
  Its bare ``TN-Validation-Passed`` would read as Telnyx's A level. The ``StirShaken`` schema of
  Bandwidth's OpenAPI document: https://github.com/Bandwidth/python-sdk/blob/main/docs/StirShaken.md
- The levels themselves, ``A``, ``B``, ``C``, and this module's own ``failed`` and ``unknown``.

Deliberately not read: the ``attest`` claim of a SIP ``Identity`` header's PASSporT. It is what the
originating carrier claims, not a verification result, and anyone can put an Identity header on a call.
Anything not in the table is refused (a provider's new value must be added here, with its source, rather
than guessed at). ``No-TN-Validation`` counts as unknown, not failed: no verification took place, and a
project says how a call without attestation counts (``unknown_attestation``).
"""

from __future__ import annotations

from typing import Final

from .errors import InvalidInput

#: The normalised attestations, from the most trusted to the least.
ATTESTATIONS: Final = ("A", "B", "C", "failed", "unknown")

#: The longest value read (the longest in the table is 31 characters); a longer one is refused unread.
MAX_ATTESTATION_CHARS: Final = 64


def _table() -> dict[str, str]:
    table: dict[str, str] = {name: name for name in ATTESTATIONS}
    for level in "ABC":
        for suffix in ("", "-Diverted"):
            table[f"TN-Validation-Passed-{level}{suffix}"] = level  # Twilio
            table[f"TN-Validation-Failed-{level}{suffix}"] = "failed"  # Twilio
    table |= {
        "TN-Validation-Passed": "A",  # Telnyx: its A level has no suffix
        "TN-Validation-Failed": "failed",  # Twilio, Telnyx
        "No-TN-Validation": "unknown",  # Twilio, Telnyx
        "Verified": "A",  # Plivo
        "Not Verified": "C",  # Plivo: B, C or unsigned
        "Not Applicable": "unknown",  # Plivo
    }
    # Keys in ASCII lower case: values are matched by their ASCII letters only (see normalize_attestation).
    return {key.lower(): value for key, value in table.items()}


_NORMALISED: Final = _table()

_ACCEPTED = (
    "attestation must be A, B, C, failed or unknown, or a provider's value as sent (Twilio StirVerstat, "
    "e.g. TN-Validation-Passed-A; Telnyx verstat, e.g. TN-Validation-Passed; Plivo STIR verification, e.g. "
    "Verified); leave it out when the call has none"
)


def normalize_attestation(raw: str | None) -> str:
    """One of :data:`ATTESTATIONS` for ``raw`` (ASCII, any case, surrounding whitespace ignored); ``"unknown"`` for
    None or an empty value. Raises :class:`InvalidInput` (field ``attestation``) for anything else; the
    message lists what is accepted and never quotes the value (it came from a client)."""
    if raw is None:
        return "unknown"
    # ASCII only, before any case mapping: Unicode's mappings take look-alikes to ASCII letters (the Kelvin
    # sign lowers to 'k', the long s and the ligature 'ﬅ' case-fold to 's' and 'st', 'ﬁ' upper-cases to
    # 'FI'), and no provider sends anything but ASCII. For ASCII text, lower() changes A-Z only.
    if not isinstance(raw, str) or len(raw) > MAX_ATTESTATION_CHARS or not raw.isascii():
        raise InvalidInput(_ACCEPTED, field="attestation")
    text = raw.strip()
    if not text:
        return "unknown"
    try:
        return _NORMALISED[text.lower()]
    except KeyError:
        raise InvalidInput(_ACCEPTED, field="attestation") from None
