"""Caller-ID attestation normalisation: every provider value the service reads, as each provider documents it
(sources in service/domain/attestation.py), and what it refuses."""

from __future__ import annotations

import pytest
from caller_memory.service.domain.attestation import ATTESTATIONS, normalize_attestation
from caller_memory.service.domain.errors import InvalidInput

#: (provider, the value as the provider sends it, what it counts as).
TABLE: list[tuple[str, str, str]] = [
    # Twilio: StirVerstat (Programmable Voice) and X-Twilio-VerStat (Elastic SIP Trunking), same values.
    ("twilio", "TN-Validation-Passed-A", "A"),
    ("twilio", "TN-Validation-Passed-B", "B"),
    ("twilio", "TN-Validation-Passed-C", "C"),
    ("twilio", "TN-Validation-Failed-A", "failed"),
    ("twilio", "TN-Validation-Failed-B", "failed"),
    ("twilio", "TN-Validation-Failed-C", "failed"),
    ("twilio", "TN-Validation-Failed", "failed"),
    ("twilio", "No-TN-Validation", "unknown"),
    ("twilio", "TN-Validation-Passed-A-Diverted", "A"),
    ("twilio", "TN-Validation-Passed-B-Diverted", "B"),
    ("twilio", "TN-Validation-Passed-C-Diverted", "C"),
    ("twilio", "TN-Validation-Failed-A-Diverted", "failed"),
    ("twilio", "TN-Validation-Failed-B-Diverted", "failed"),
    ("twilio", "TN-Validation-Failed-C-Diverted", "failed"),
    # Telnyx: verstat of P-Asserted-Identity; its A level has no -A suffix.
    ("telnyx", "TN-Validation-Passed", "A"),
    ("telnyx", "TN-Validation-Passed-B", "B"),
    ("telnyx", "TN-Validation-Passed-C", "C"),
    ("telnyx", "TN-Validation-Failed", "failed"),
    ("telnyx", "No-TN-Validation", "unknown"),
    # Telnyx TeXML (ShakenStirAttestation) and Bandwidth (attestationIndicator): the level itself.
    ("telnyx texml, bandwidth", "A", "A"),
    ("telnyx texml, bandwidth", "B", "B"),
    ("telnyx texml, bandwidth", "C", "C"),
    # Plivo: STIR Verification.
    ("plivo", "Verified", "A"),
    ("plivo", "Not Verified", "C"),
    ("plivo", "Not Applicable", "unknown"),
    # The normalised names themselves (what the service answers can be sent back).
    ("normalised", "failed", "failed"),
    ("normalised", "unknown", "unknown"),
]


@pytest.mark.parametrize(("provider", "raw", "expected"), TABLE, ids=[f"{p}:{r}" for p, r, _ in TABLE])
def test_every_documented_value_is_read(provider: str, raw: str, expected: str) -> None:
    assert normalize_attestation(raw) == expected
    # Whatever case and surrounding whitespace it arrives with (headers and form fields are copied by hand).
    for written in (raw.lower(), raw.upper(), raw.swapcase(), f"  {raw}\t", f"\n{raw.title()} "):
        assert normalize_attestation(written) == expected, written


def test_the_table_covers_every_normalised_value() -> None:
    assert ATTESTATIONS == ("A", "B", "C", "failed", "unknown")
    assert {expected for _, _, expected in TABLE} == set(ATTESTATIONS)
    for name in ATTESTATIONS:
        assert normalize_attestation(name) == name  # idempotent: a normalised value stays itself
        assert normalize_attestation(normalize_attestation(name.swapcase())) == name


@pytest.mark.parametrize("raw", [None, "", " ", "\t\r\n"])
def test_no_attestation_is_unknown(raw: str | None) -> None:
    assert normalize_attestation(raw) == "unknown"


REFUSED = [
    "D",
    "AB",
    "A B",
    "passed",
    "TN-Validation",
    "TN-Validation-Passed-D",
    "TN-Validation-Passed-A-Passthrough",  # not in Twilio's documentation: refused rather than guessed at
    "TN-Validation-Passed-Diverted",
    "TN-Verification-Passed",  # a typo Bandwidth's own docs once had
    "TN_Validation_Passed_A",
    "TN-Validation-Passed-A;verstat",
    "verstat=TN-Validation-Passed",  # the header parameter as written, not its value
    "attest=A",  # an Identity header's claim is no verification result
    "TN\u2010Validation\u2010Passed\u2010A",  # Unicode hyphens
    "\uff21",  # a full-width A
    "A\x00",
    "+14155550100",
    "email:ada@example.com",
    "A" * 65,
    "TN-Validation-Passed-A" + " " * 60,  # longer than any value, whitespace or not
]


@pytest.mark.parametrize("raw", REFUSED)
def test_anything_else_is_refused(raw: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        normalize_attestation(raw)
    error = caught.value
    assert error.field == "attestation" and error.status == 422
    assert [e["field"] for e in error.errors] == ["attestation"]
    # The message says briefly what is accepted.
    assert "A, B, C, failed or unknown" in error.detail and "StirVerstat" in error.detail


@pytest.mark.parametrize("raw", ["+14155550100", "email:ada@example.com", "TN-Validation-Passed-Q7x9"])
def test_a_refused_value_is_never_quoted(raw: str) -> None:
    """It came from a client and may be a number or an address: the message (logged, answered) omits it."""
    with pytest.raises(InvalidInput) as caught:
        normalize_attestation(raw)
    text = caught.value.detail + repr(caught.value.errors)
    assert raw not in text and "4155550100" not in text and "ada@" not in text and "Q7x9" not in text


def test_a_value_that_is_no_string_is_refused() -> None:
    with pytest.raises(InvalidInput):
        normalize_attestation(1)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        normalize_attestation(["A"])  # type: ignore[arg-type]
